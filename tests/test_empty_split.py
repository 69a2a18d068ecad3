"""An empty split is a dataset of size 0, not an error. BlockExampleGen writes empty split files
for a block without records; a refusal after the grant was charged would make a 0-record split
("run fails") distinguishable from a 1-record one ("model released"): epsilon = infinity.
Every step that reads a split after the charge must run to its release on 0 rows."""
import math
import os

import numpy as np
import pytest
import tensorflow as tf

from sage_tfx.components.dp_trainer.adassp import adassp
from sage_tfx.components.util.user_module import RecordDecoder, UserModule
from sage_tfx.components.oblivious_sample_gen import accounting
from sage_tfx.components.util.examples_io import read_split
from sage_tfx.components.oblivious_sample_gen.sampling import (samples_poisson, samples_swo,
                                                               shuffle_and_split)
from sage_tfx.validators import accuracy_validator, loss_validator

from support import TRIP_MODULE


def test_read_split_returns_0_rows_for_an_empty_split_file(tmp_path):
    directory = tmp_path / "Split-eval"
    directory.mkdir()
    with tf.io.TFRecordWriter(str(directory / "data.gz"), options="GZIP"):
        pass  # what BlockExampleGen writes for a block without records
    records = read_split(str(tmp_path), "eval")
    assert records.dtype == tf.string and records.shape == (0,)
    with pytest.raises(ValueError, match="no 'train' split files"):  # layout, not data
        read_split(str(tmp_path), "train")


@pytest.mark.parametrize("sampler, parameter", [(samples_swo, 3), (shuffle_and_split, 3),
                                                (samples_poisson, 0.2)])
def test_samplers_pad_0_records_to_the_public_size_with_nulls(sampler, parameter):
    samples = sampler(np.zeros((0,), dtype=object), parameter, seed=0, size=12, epochs=2)
    assert samples.descriptor.n == 12 and samples.records.shape[0] > 0
    assert set(samples.records.tolist()) == {b""}  # null records only
    assert not samples.real.any() and not samples.sample_ids.any()


@pytest.mark.parametrize("scheme, sample_size", [("swo", 4), ("shuffle", 4), ("poisson", None)])
def test_a_non_positive_dp_count_is_clamped_to_the_smallest_valid_size(scheme, sample_size):
    # n_hat = -5 (e.g. 0 records and negative noise): N is the size at n_hat = 1 for Poisson,
    # m for SWO and shuffling (one sample), so the sampler can run on it.
    size, _ = accounting.sized_for(scheme, -5, 0.5, sample_size)
    expected, _ = accounting.sized_for(scheme, 1, 0.5, sample_size)
    assert size == max(expected, sample_size or 0) and size >= 1


def test_the_decoder_gives_0_rows_of_the_model_width_for_no_records():
    inputs, labels = RecordDecoder(UserModule.load(TRIP_MODULE, "adassp")).decode([])
    one_input, _ = RecordDecoder(UserModule.load(TRIP_MODULE, "adassp")).decode([b""])
    assert inputs.shape[0] == 0 and labels.shape[0] == 0
    assert inputs.shape[1:] == one_input.shape[1:]


def test_adassp_on_0_rows_releases_noise_only_and_finite_weights():
    result = adassp(np.zeros((0, 2)), np.zeros(0), 1.0, 1e-6, feature_bound=2.0,
                    label_bound=5.0)
    assert result.weights.shape == (3,) and np.isfinite(result.weights).all()
    assert math.isfinite(result.ridge) and result.event is not None


@pytest.mark.parametrize("validate", [
    lambda: loss_validator([], 0.5, 1.0, 0.95, 1.0),
    lambda: accuracy_validator([], 0.5, 1.0, 0.95),
])
def test_the_validators_release_on_0_values(validate):
    result = validate()
    # dp_count ~ 0 + Laplace(2 / epsilon); the outcome is RETRY unless the noise is huge.
    assert math.isfinite(result.dp_count)
    assert math.isfinite(result.dp_estimate)
    assert result.outcome in ("ACCEPT", "REJECT", "RETRY")


@pytest.mark.slow
@pytest.mark.parametrize("spec_name", ["adassp_spec", "dp_sgd_spec"])
def test_an_iteration_on_a_window_of_an_empty_block_releases_finite_values(tmp_path, spec_name,
                                                                         seeded_noise):
    """An iteration (grant, DPTransform, [ObliviousSampleGen,] DPTrainer, SLAedValidator,
    Pusher) on the most recent block of the public schedule, a month without records: both
    granted splits are empty. Before the fix ObliviousSampleGen or DPTrainer raised "... is
    empty" after the grant was charged. DP-SGD runs its public steps on null rows. The noise is
    seeded: the sampler's DP count of the empty split sizes DP-SGD's steps, and a count near 0
    leaves a training share too small for them (refused by the calibration, a DP outcome)."""
    from tfx.orchestration import metadata
    from tfx.orchestration.local.local_dag_runner import LocalDagRunner
    from tfx.types import artifact_utils, standard_artifacts

    from sage_tfx.examples.taxi import pipeline as taxi
    from sage_tfx.examples.taxi.stream import TaxiStream
    from sage_tfx.pipelines.adaptive import build_iteration
    from sage_tfx.sage_access import BlockLedger, connect

    first = next(iter(TaxiStream.load().trips_by_month.items()))
    year, month = (int(part) for part in first[0].split("-"))
    empty_month = f"{year + month // 12:04d}-{month % 12 + 1:02d}"
    store = str(tmp_path / "metadata.sqlite")
    BlockLedger.create(store, min_request_epsilon=0.05, for_tests=True)
    stream = TaxiStream({first[0]: first[1][:40], empty_month: []})
    taxi.TaxiSource(store, str(tmp_path), stream=stream).ingest(2)
    LocalDagRunner().run(build_iteration(
        getattr(taxi, spec_name)(seed=3), "empty-window", str(tmp_path / "run"), store, window=1,
        epsilon=0.5, metadata_config=metadata.sqlite_metadata_connection_config(store)))

    spent = {block.block_id: block.spent[0] for block in BlockLedger(store).blocks()}
    assert spent == {first[0]: 0.0, empty_month: pytest.approx(0.5)}
    mlmd = connect(store)
    [model] = mlmd.get_artifacts_by_type(standard_artifacts.Model.TYPE_NAME)
    assert os.listdir(model.uri)
    blessing_type = mlmd.get_artifact_type(standard_artifacts.ModelBlessing.TYPE_NAME)
    [blessing] = [artifact_utils.deserialize_artifact(blessing_type, artifact) for artifact in
                  mlmd.get_artifacts_by_type(standard_artifacts.ModelBlessing.TYPE_NAME)]
    # The DP metric is finite (kept in [0, B]); with a DP count near 0 the population bound may
    # be infinite, an honest "no information", which the validator never ACCEPTs.
    metric, lower, upper = (float(blessing.get_string_custom_property(name))
                            for name in ("dp_metric", "lower_bound", "upper_bound"))
    assert math.isfinite(metric) and 0.0 <= metric <= 0.25 and lower <= upper
    assert blessing.get_string_custom_property("outcome") in ("ACCEPT", "REJECT", "RETRY")
    assert blessing.get_string_custom_property("outcome") != "ACCEPT" or math.isfinite(upper)
