"""Exact decimals survive ML Metadata (sage_access/exact.py): what every budget record relies on."""
from fractions import Fraction

from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access import connect
from sage_tfx.sage_access.exact import (exact_decimal, exact_fraction, exact_property,
                                        set_exact_property)

# Values whose 7th and later decimals matter: a delta, a share rounded down, a tiny epsilon.
AWKWARD = (1e-7, 0.1 + 0.2, 0.30000000000000004 / 3, 2.5e-12, 123456.789012345)


class _Node:
    """The TFX artifact surface `set_exact_property` uses, on a real MLMD artifact."""

    def __init__(self, artifact):
        self.mlmd_artifact = artifact

    def set_string_custom_property(self, name, value):
        self.mlmd_artifact.custom_properties[name].string_value = value


def test_exact_values_read_back_bit_for_bit_from_a_sqlite_store(store_path):
    store = connect(store_path)
    type_id = store.put_artifact_type(pb.ArtifactType(name="ExactProbe"))
    node = _Node(pb.Artifact(type_id=type_id))
    for index, value in enumerate(AWKWARD):
        set_exact_property(node, f"v{index}", value)
    [artifact_id] = store.put_artifacts([node.mlmd_artifact])
    [stored] = store.get_artifacts_by_id([artifact_id])
    assert [exact_property(stored, f"v{i}") for i in range(len(AWKWARD))] == list(AWKWARD)
    assert exact_property(stored, "absent") is None


def test_decimal_fractions_are_the_decimals_as_written():
    assert exact_fraction("0.1") == exact_fraction(0.1) == Fraction(1, 10)
    assert sum(exact_fraction(f) for f in (0.7, 0.2, 0.1)) == 1 != 0.7 + 0.2 + 0.1
    assert float(exact_decimal(1e-7)) == 1e-7


def _through_kubeflow(artifact):
    """`artifact` as the next task of a Kubeflow job gets it: written to the executor output
    by TFX's V2 entrypoint, published as JSON metadata, parsed again by the next entrypoint."""
    from kfp.pipeline_spec import pipeline_spec_pb2
    from tfx.orchestration.kubeflow.v2 import compiler_utils
    from tfx.orchestration.kubeflow.v2.container import kubeflow_v2_entrypoint_utils as utils

    [published] = utils.translate_executor_output({"x": [artifact]}, {})["x"].artifacts
    published.type.instance_schema = compiler_utils.get_artifact_schema(type(artifact))
    given = pipeline_spec_pb2.ArtifactList(artifacts=[published])
    return utils.parse_raw_artifact_dict({"x": given})["x"][0]


def test_exact_values_survive_kubeflow_passing_artifacts_between_tasks():
    """Custom properties arrive as JSON (struct) values: DPTransform read the grant's epsilon as
    '' after the charge, and DPTrainer the sampling descriptor's integers as 0."""
    from sage_tfx.components.dp_trainer.executor import read_descriptor
    from sage_tfx.components.oblivious_sample_gen.sampling import plan
    from sage_tfx.components.privacy_grant.artifact import PrivacyGrant
    from sage_tfx.sage_access.exact import custom_value, exact_property, set_exact_property
    from tfx.types import standard_artifacts

    grant = PrivacyGrant()
    set_exact_property(grant, "epsilon", 1e-7)
    grant.set_int_custom_property("count", 24)
    passed = _through_kubeflow(grant)
    assert passed.mlmd_artifact.custom_properties["epsilon"].HasField("struct_value")
    assert exact_property(passed, "epsilon") == 1e-7
    assert custom_value(passed, "count") == 24 and custom_value(passed, "absent") is None
    samples = standard_artifacts.Examples()
    descriptor = plan("swo", 1000, 5, sample_size=128)
    for name, value in descriptor.to_properties().items():
        (samples.set_int_custom_property if isinstance(value, int)
         else samples.set_string_custom_property)(name, value)
    assert read_descriptor(_through_kubeflow(samples)) == read_descriptor(samples)
