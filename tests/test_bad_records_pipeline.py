"""One NaN, one infinity and one record missing a feature in the real taxi data: the whole
iteration (BlockExampleGen -> BlockLedger -> DPTransform -> [ObliviousSampleGen ->] DPTrainer ->
SLAedValidator) runs after its charge and releases only finite values (issue 16 §2)."""
import dataclasses
import glob
import math
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_transform as tft

from sage_tfx.examples.taxi.pipeline import TaxiSource, adassp_spec, dp_sgd_spec
from sage_tfx.examples.taxi.stream import TaxiStream
from sage_tfx.pipelines.adaptive import Policy, run_adaptive
from sage_tfx.sage_access import BlockLedger, connect

MONTHS = 2


def bad_taxi_stream() -> TaxiStream:
    """The real sample with, in each of the first months, a trip of NaN miles, one of infinite
    miles and one without a start hour (an empty CSV cell: the feature has no value)."""
    stream = TaxiStream.load()
    for month in stream.months[:MONTHS]:
        trips = stream.trips_by_month[month]
        (t0, _, _, s0), (t1, _, _, s1), (t2, _, m2, s2) = trips[:3]
        trips[:3] = [(t0, 3, math.nan, s0), (t1, 3, math.inf, s1), (t2, None, m2, s2)]
    return stream


def _uris(store, type_name: str) -> list[str]:
    return [artifact.uri for artifact in store.get_artifacts_by_type(type_name)]


def _property(artifact, name: str) -> str:
    return artifact.custom_properties[name].string_value


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["adassp", "dp_sgd"])
def test_an_iteration_on_taxi_data_with_bad_records_releases_finite_values(tmp_path, mode):
    store_path = str(tmp_path / "metadata.sqlite")
    BlockLedger.create(store_path, min_request_epsilon=0.05, for_tests=True)
    source = TaxiSource(store_path, str(tmp_path), stream=bad_taxi_stream())
    source.ingest(MONTHS)
    if mode == "adassp":
        spec = adassp_spec(seed=5)
    else:  # one epoch of small samples: the test is about records, not accuracy
        spec = dp_sgd_spec(seed=5)
        spec = dataclasses.replace(spec, sampling={**spec.sampling, "sample_size": 64,
                                                   "epochs": 1})
    result = run_adaptive(spec, Policy("conserve", initial_epsilon=1.0, min_window=MONTHS,
                                       max_iterations=1),
                          f"bad-records-{mode}", str(tmp_path / "run"), store_path, source,
                          lambda _: None)

    # The iteration ran to the validator's decision, and its releases are finite.
    [iteration] = result.iterations
    assert iteration.outcome in ("ACCEPT", "RETRY", "REJECT")
    assert all(math.isfinite(value) for value in (iteration.dp_metric, iteration.lower_bound,
                                                  iteration.upper_bound))
    store = connect(store_path)
    # DPTransform's release: the DP mean speed of every hour.
    [transform_uri] = _uris(store, "TransformGraph")
    hours = tf.reshape(tf.range(24, dtype=tf.int64), [24, 1])
    transformed = tft.TFTransformOutput(transform_uri).transform_features_layer()(
        {"trip_miles": tf.ones([24, 1]), "trip_start_hour": hours,
         "trip_seconds": tf.fill([24, 1], tf.constant(600, tf.int64))})
    assert np.isfinite(transformed["hour_speed"].numpy()).all()
    # DPTrainer's release: finite weights, and finite predictions even for the bad trips.
    [model_uri] = _uris(store, "Model")
    loaded = tf.saved_model.load(os.path.join(model_uri, "Format-Serving"))
    assert all(np.isfinite(variable.numpy()).all() for variable in loaded.model.variables)
    records = [tf.train.Example(features=tf.train.Features(feature={
        "trip_miles": tf.train.Feature(float_list=tf.train.FloatList(value=[miles])),
        "trip_start_hour": tf.train.Feature(int64_list=tf.train.Int64List(value=[3]))}))
        .SerializeToString() for miles in (2.0, math.nan, math.inf)]
    outputs = loaded.signatures["serving_default"](examples=tf.constant(records))["outputs"]
    assert np.isfinite(outputs.numpy()).all()
    if mode == "dp_sgd":
        # The ModelRun's TensorBoard holds the public epsilon per epoch, not the training loss.
        [run_uri] = _uris(store, "ModelRun")
        tags = {value.tag for path in glob.glob(os.path.join(run_uri, "events.out.tfevents*"))
                for event in tf.compat.v1.train.summary_iterator(path)
                for value in event.summary.value}
        assert tags == {"epsilon"}
