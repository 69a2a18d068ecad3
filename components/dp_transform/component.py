"""DPTransform component: TFT preprocessing where only DP analyzers see the granted data."""
from __future__ import annotations

from typing import Optional

from tfx.dsl.components.base import base_beam_component, executor_spec
from tfx.types import channel, component_spec, standard_artifacts

from sage_tfx.components.block_ledger import preflight
from sage_tfx.components.block_ledger.component import check_before_charge
from sage_tfx.components.dag_guard import PrivateExamples, ProducesPrivateRecords
from sage_tfx.components.dp_transform import executor
from sage_tfx.components.privacy_grant import PrivacyGrant


class DPTransformSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "module_file": component_spec.ExecutionParameter(type=str),
        "grant_step": component_spec.ExecutionParameter(type=str),
    }
    INPUTS = {
        "examples": component_spec.ChannelParameter(type=PrivateExamples),
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
        # The raw features, as TFX's Transform takes them (DPSchemaGen, ImportSchemaGen).
        "schema": component_spec.ChannelParameter(type=standard_artifacts.Schema,
                                                  optional=True),
    }
    OUTPUTS = {
        "transform_graph": component_spec.ChannelParameter(type=standard_artifacts.TransformGraph),
        "transformed_examples": component_spec.ChannelParameter(type=PrivateExamples),
    }


class DPTransform(ProducesPrivateRecords, base_beam_component.BaseBeamComponent):
    """Runs the `preprocessing_fn(inputs)` of `module_file` with tensorflow_transform on Beam,
    analysing the granted train split. The raw features: the `schema` channel's, as TFX's
    Transform reads them (a feature without a shape as one value per record with its public
    default: executor.schema_feature_spec), else the module's `feature_spec()`.

    The preprocessing_fn may use only the DP analyzers of
    `sage_tfx.components.dp_transform.tft` (tft's names: scale_to_z_score, bucketize,
    compute_and_apply_vocabulary, ...) and `.analyzers` (dp_group_by_mean, dp_mean, dp_count),
    and data-independent ops such as `scale_with_bounds`; each analyzer spends its
    `budget_share` (or an equal part) of the grant's `grant_step` share. A TFT analyzer (tft.mean, tft.vocabulary, ...) is
    refused before any record is read. Outputs a standard TransformGraph (DPTrainer and the
    serving signature apply it) and the transformed train/test Examples, which carry the grant.
    """

    SPEC_CLASS = DPTransformSpec
    SPENDS_GRANT = True  # may read private records (dag_guard)
    EXECUTOR_SPEC = executor_spec.BeamExecutorSpec(executor.Executor)

    def __init__(self, examples: channel.Channel, grant: channel.Channel, module_file: str,
                 grant_step: str = "transform", schema: Optional[channel.Channel] = None):
        super().__init__(spec=DPTransformSpec(
            module_file=module_file, grant_step=grant_step, examples=examples,
            grant=grant, schema=schema,
            transform_graph=channel.Channel(type=standard_artifacts.TransformGraph),
            transformed_examples=channel.Channel(type=PrivateExamples)))
        check_before_charge(grant, preflight.Check(
            component="DPTransform", module_file=module_file, purpose="transform",
            transform_step=grant_step, schema_file=_schema_file(schema)))


def _schema_file(schema: Optional[channel.Channel]) -> Optional[str]:
    """The file the schema channel's producer copies (DPSchemaGen's and TFX ImportSchemaGen's
    `schema_file`), for the BlockLedger's preflight, which runs before any schema artifact
    exists. None without a schema, and for a schema inferred from DP statistics (made after
    the charge): the preflight then reads the module's `feature_spec()`, and refuses the
    module without one before the charge."""
    if not isinstance(schema, channel.OutputChannel):
        return None
    return schema.producer_component.exec_properties.get("schema_file") or None
