"""ObliviousSampleGen on LocalDagRunner after BlockExampleGen -> BlockLedger: samples of the
granted training records, descriptor in MLMD, AES-GCM storage, refusal of ungranted data."""
import base64
import math
import os

import pytest
import tensorflow as tf
from tfx.orchestration import metadata, pipeline
from tfx.orchestration.local.local_dag_runner import LocalDagRunner
from tfx.types import artifact_utils

from sage_tfx.components import PrivateExamples
from sage_tfx.components.oblivious_sample_gen import ObliviousSampleGen
from sage_tfx.components.oblivious_sample_gen import executor as sample_executor
from sage_tfx.components.oblivious_sample_gen.descriptor import SamplingDescriptor
from sage_tfx.components.oblivious_sample_gen.samples_io import read_samples
from sage_tfx.components.privacy_grant import GrantError
from sage_tfx.sage_access import connect

from support.ingest import ingest_and_grant
from support.private import not_private

KEY_VARIABLE = "SAGE_TEST_SAMPLES_KEY"


def trip_seconds(serialized: bytes) -> int:
    return tf.train.Example.FromString(serialized).features.feature["trip_seconds"].int64_list.value[0]


@pytest.mark.slow
def test_sample_gen_samples_granted_records_and_encrypts(tmp_path, monkeypatch, umask_022):
    key = os.urandom(32)
    monkeypatch.setenv(KEY_VARIABLE, base64.b64encode(key).decode())
    root = str(tmp_path)
    store_path = os.path.join(root, "metadata.sqlite")
    gen, grant = ingest_and_grant(root, store_path, split={"training": 0.9,
                                                           "sampling_count": 0.1})
    # The grant's one sampling_count share pays the Poisson sampler's DP count (a share is spent
    # once); the SWO sampler is given a public size instead.
    swo = ObliviousSampleGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                             scheme="swo", sample_size=8, epochs=2, seed=1,
                             public_size=40).with_id("swo")
    poisson = ObliviousSampleGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                                 scheme="poisson", gamma=0.1, epochs=3,
                                 encryption_key_env=KEY_VARIABLE, record_width=1024,
                                 seed=2).with_id("poisson")
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="sampling", pipeline_root=os.path.join(root, "pipeline"),
        components=[gen, grant, swo, poisson],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store_path)))

    store = connect(store_path)
    examples_type = store.get_artifact_type(PrivateExamples.TYPE_NAME)
    examples = [artifact_utils.deserialize_artifact(examples_type, a)
                for a in store.get_artifacts_by_type(PrivateExamples.TYPE_NAME)]
    [granted] = [e for e in examples if e.get_string_custom_property("sage_grant_id")
                 and not e.get_int_custom_property("sampling_n")]
    sampled = {e.get_string_custom_property("sampling_scheme"): e for e in examples
               if e.get_int_custom_property("sampling_n")}
    granted_train = [trip_seconds(r) for r in sample_executor.read_split(granted.uri, "train").numpy()]

    for scheme, artifact in sampled.items():
        props = {name: artifact.mlmd_artifact.custom_properties[name]
                 for name in artifact.mlmd_artifact.custom_properties}
        flat = {name: (value.string_value if value.HasField("string_value") else value.int_value)
                for name, value in props.items()}
        descriptor = SamplingDescriptor.from_properties(flat)
        # The size sampled from is a DP count (Poisson: plus its public slack), not n.
        assert descriptor.n > 0
        # The samples carry the grant of the Examples they came from.
        assert flat["sage_grant_id"] == granted.get_string_custom_property("sage_grant_id")
        encrypted = bool(flat["sampling_encrypted"])
        directory = os.path.join(artifact.uri, "Split-train")
        if encrypted:
            with pytest.raises(ValueError, match="encrypted"):
                read_samples(directory, descriptor, flat.get("sampling_record_width", 0))
            blobs = list(tf.data.TFRecordDataset(os.path.join(directory, "samples.enc.tfrecord"))
                         .as_numpy_iterator())
            assert len({len(b) for b in blobs}) == 1  # every ciphertext has the same length
            assert not any(b"trip_seconds" in b for b in blobs)
        records, ids = read_samples(directory, descriptor, flat.get("sampling_record_width", 0),
                                    key if encrypted else None)
        assert len(records) == descriptor.epochs * descriptor.slots_per_epoch
        real = [trip_seconds(r) for r, i in zip(records, ids) if i > 0]
        assert set(real) <= set(granted_train)
        assert all(r == b"" for r, i in zip(records, ids) if i == 0)
    assert set(sampled) == {"swo", "poisson"}
    assert sampled["swo"].get_int_custom_property("sampling_n") == 40
    assert sampled["swo"].get_int_custom_property("sampling_samples_per_epoch") == 40 // 8
    assert sampled["poisson"].get_int_custom_property("sampling_encrypted") == 1
    # Records are private under umask 022 (they were 0644): the blocks' Examples, the granted
    # Examples, both samples and the ledger.
    assert len(examples) == 3 + 1 + 2
    assert [entry for e in examples for entry in not_private(e.uri)] == []
    assert not_private(store_path) == []

    # Examples of a single block were never granted as such: the executor refuses them.
    per_block = [e for e in examples if e.get_string_custom_property("block_id")]
    grant_artifact = artifact_utils.deserialize_artifact(
        store.get_artifact_type("sage_tfx.PrivacyGrant"),
        store.get_artifacts_by_type("sage_tfx.PrivacyGrant")[0])
    out = artifact_utils.deserialize_artifact(examples_type, store.get_artifacts_by_type(PrivateExamples.TYPE_NAME)[0])
    with pytest.raises(GrantError, match="without a grant"):
        sample_executor.Executor().Do({"examples": [per_block[0]], "grant": [grant_artifact]},
                                      {"samples": [out]}, {"scheme": "swo", "sample_size": 4,
                                                           "epochs": 1})


def test_bad_component_parameters_are_refused():
    with pytest.raises(ValueError, match="gamma"):
        ObliviousSampleGen(examples=None, grant=None, scheme="poisson", sample_size=3)
    with pytest.raises(ValueError, match="unknown scheme"):
        ObliviousSampleGen(examples=None, grant=None, scheme="bernoulli", gamma=0.1)


class _CountShare:
    """The grant as sampled_size uses it: the sampling_count share, and the event it checks."""

    def __init__(self, epsilon):
        self.epsilon, self.checked = epsilon, []

    def share(self, step):
        assert step == "sampling_count"
        return self.epsilon, 0.0

    def check_event(self, step, event):
        self.checked.append((step, event))


def test_the_dp_count_has_the_discrete_laplace_scale_its_share_pays_for(seeded_noise):
    """Issue 29 item 12: the count n_hat = n + Z that sizes the samples, measured. Z is
    DiscreteLaplace with P(z) ~ a^|z|, a = exp(-eps), so P(|Z| >= t) = 2 a^t / (1 + a). At eps
    0.1 and t = 7 that is 0.521; with half the noise scale (eps doubled) 0.271. Of 1000 counts
    (SWO, n = 10,000: N = n_hat), the number with |Z| >= 7 is Binomial(1000, 0.521): outside
    its 1e-6 and 1 - 1e-6 quantiles with probability < 2e-6 (the false-failure rate of a seed;
    seeded_noise fixes it at 0), while half the scale gives 271 +- 14, far below the lower one
    (about 444)."""
    from scipy import stats

    from sage_tfx.sage_access.accounting import pure_dp_event

    epsilon, n, draws, t = 0.1, 10_000, 1000, 7
    grant = _CountShare(epsilon)
    properties = {"scheme": "swo", "sample_size": 16}
    sizes = [sample_executor.sampled_size(tf.zeros([n]), grant, properties)[0]
             for _ in range(draws)]
    far = sum(abs(size - n) >= t for size in sizes)
    a = math.exp(-epsilon)
    p = 2 * a ** t / (1 + a)
    low, high = stats.binom.ppf(1e-6, draws, p), stats.binom.isf(1e-6, draws, p)
    assert low <= far <= high, (far, low, high)
    # What was measured is what the ledger was told: a pure epsilon-DP count.
    assert {step for step, _ in grant.checked} == {"sampling_count"}
    assert all(event == pure_dp_event(epsilon) for _, event in grant.checked)
