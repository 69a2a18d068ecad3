"""DPTransform component: TFT preprocessing where only DP analyzers see the granted data."""
from __future__ import annotations

from tfx.dsl.components.base import base_beam_component, executor_spec
from tfx.types import channel, component_spec, standard_artifacts

from sage_tfx.components.block_ledger import preflight
from sage_tfx.components.block_ledger.component import check_before_charge
from sage_tfx.components.dp_transform import executor
from sage_tfx.components.privacy_grant import PrivacyGrant


class DPTransformSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "module_file": component_spec.ExecutionParameter(type=str),
        "grant_step": component_spec.ExecutionParameter(type=str),
    }
    INPUTS = {
        "examples": component_spec.ChannelParameter(type=standard_artifacts.Examples),
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
    }
    OUTPUTS = {
        "transform_graph": component_spec.ChannelParameter(type=standard_artifacts.TransformGraph),
        "transformed_examples": component_spec.ChannelParameter(type=standard_artifacts.Examples),
    }


class DPTransform(base_beam_component.BaseBeamComponent):
    """Runs the `preprocessing_fn(inputs)` of `module_file` (which also defines `feature_spec()`,
    the raw features) with tensorflow_transform on Beam, analysing the granted train split.

    The preprocessing_fn may use only the DP analyzers of
    `sage_tfx.components.dp_transform.tft` (tft's names: scale_to_z_score, bucketize,
    compute_and_apply_vocabulary, ...) and `.analyzers` (dp_group_by_mean, dp_mean, dp_count),
    and data-independent ops such as `scale_with_bounds`; each analyzer spends its
    `budget_share` (or an equal part) of the grant's `grant_step` share. A TFT analyzer (tft.mean, tft.vocabulary, ...) is
    refused before any record is read. Outputs a standard TransformGraph (DPTrainer and the
    serving signature apply it) and the transformed train/test Examples, which carry the grant.
    """

    SPEC_CLASS = DPTransformSpec
    EXECUTOR_SPEC = executor_spec.BeamExecutorSpec(executor.Executor)

    def __init__(self, examples: channel.Channel, grant: channel.Channel, module_file: str,
                 grant_step: str = "transform"):
        super().__init__(spec=DPTransformSpec(
            module_file=module_file, grant_step=grant_step, examples=examples,
            grant=grant,
            transform_graph=channel.Channel(type=standard_artifacts.TransformGraph),
            transformed_examples=channel.Channel(type=standard_artifacts.Examples)))
        check_before_charge(grant, preflight.Check(
            component="DPTransform", module_file=module_file, purpose="transform",
            transform_step=grant_step))
