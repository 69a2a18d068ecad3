"""SLAedValidator component: DP validation of a trained model on the grant's test split, with
a standard ModelBlessing (blessed only on ACCEPT)."""
from __future__ import annotations

import json
from typing import Optional, Sequence

from tfx.dsl.components.base import base_component, executor_spec
from tfx.types import channel, component_spec, standard_artifacts

from sage_tfx.components.block_ledger import preflight
from sage_tfx.components.block_ledger.component import check_before_charge
from sage_tfx.components.dag_guard import PrivateExamples
from sage_tfx.components.privacy_grant import PrivacyGrant
from sage_tfx.components.util.user_module import raw_spec_needs
from sage_tfx.validators import executor
from sage_tfx.validators.slaed import Metric


class SLAedValidatorSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "module_file": component_spec.ExecutionParameter(type=str),
        "metric": component_spec.ExecutionParameter(type=str),
        "target": component_spec.ExecutionParameter(type=float),
        "confidence": component_spec.ExecutionParameter(type=float),
        "loss_bound": component_spec.ExecutionParameter(type=float, optional=True),
        "grant_step": component_spec.ExecutionParameter(type=str),
        "baseline_margin": component_spec.ExecutionParameter(type=float, optional=True),
        "baseline_outputs": component_spec.ExecutionParameter(type=str, optional=True),  # JSON
    }
    INPUTS = {
        "model": component_spec.ChannelParameter(type=standard_artifacts.Model),
        "examples": component_spec.ChannelParameter(type=PrivateExamples),
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
        "transform_graph": component_spec.ChannelParameter(
            type=standard_artifacts.TransformGraph, optional=True),
        # The latest blessed model, as TFX's Evaluator takes it (a Resolver with
        # LatestBlessedModelStrategy); empty until a model was blessed.
        "baseline_model": component_spec.ChannelParameter(type=standard_artifacts.Model,
                                                          optional=True),
    }
    OUTPUTS = {
        "blessing": component_spec.ChannelParameter(type=standard_artifacts.ModelBlessing),
        # TFX Evaluator's output type: the DP metrics as TFMA reads them (tfma.load_metrics).
        "evaluation": component_spec.ChannelParameter(type=standard_artifacts.ModelEvaluation),
    }


class SLAedValidator(base_component.BaseComponent):
    """Validates `model` on the test split of the granted `examples`, spending the grant's
    `grant_step` share of epsilon (Laplace; no delta).

    `metric` is a slaed.Metric or its value.
    metric 'loss': the module's `loss()` per example, clipped to [0, loss_bound]; ACCEPT only if
    the expected loss is <= target with probability >= 1 - (1 - confidence) / 2.
    metric 'accuracy': ACCEPT only if the expected accuracy is >= target. The predicted class is
    the argmax of the outputs, or outputs >= 0.5 for one output (a module may define
    `predicted_class(outputs)` instead).
    Baselines (as TFX's Evaluator compares a candidate with a baseline): with `baseline_margin`
    (default 0), the model must also beat every public baseline by more than the margin, in
    expected loss (for accuracy, error rate): always predicting each class (so the majority
    class), each constant of `baseline_outputs` (metric 'loss', e.g. a grid around the label's
    mean), and `baseline_model` (the latest blessed model from TFX's Resolver) when given.
    The step's epsilon is then split evenly between the target test and the baseline test, each
    at confidence 1 - (1 - confidence) / 2, so an ACCEPT is wrong with probability at most
    (1 - confidence) / 2 in all (validators/executor.py `validate`); a model that does not beat
    its baselines is RETRY. `baseline_margin=None` turns the comparison off; metric 'loss'
    without baseline_outputs or baseline_model has nothing to compare against.
    With `transform_graph` (the one the model was trained with), the labels are taken from the
    transformed features when the transform outputs the label, as in DPTrainer.
    Output: a ModelBlessing with `blessed` = 1 only on ACCEPT (TFX's Pusher reads it), and the
    custom properties outcome, metric, dp_metric, lower_bound, upper_bound, target,
    confidence, epsilon_used, and with baselines baseline_gap (DP), baseline_gap_lower_bound,
    baseline_margin and baselines (how many). Also `evaluation`, a ModelEvaluation holding the
    same DP values as TFMA's metrics file (executor.write_tfma_metrics). The BlockLedger that grants `grant` checks, before it charges,
    that the module loads and defines what `metric` needs (block_ledger/preflight.py).
    """

    SPEC_CLASS = SLAedValidatorSpec
    SPENDS_GRANT = True  # may read private records (dag_guard)
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.Executor)

    def __init__(self, model: channel.Channel, examples: channel.Channel, grant: channel.Channel,
                 module_file: str, metric: str | Metric, target: float, confidence: float = 0.95,
                 loss_bound: Optional[float] = None, grant_step: str = "validation",
                 transform_graph: Optional[channel.Channel] = None,
                 baseline_margin: Optional[float] = 0.0, baseline_outputs: Sequence[float] = (),
                 baseline_model: Optional[channel.Channel] = None):
        metric = executor.check_parameters(metric, target, confidence, loss_bound,
                                           baseline_margin, baseline_outputs)
        super().__init__(spec=SLAedValidatorSpec(
            module_file=module_file, metric=metric, target=target, confidence=confidence,
            loss_bound=loss_bound, grant_step=grant_step, baseline_margin=baseline_margin,
            baseline_outputs=json.dumps([float(value) for value in baseline_outputs]),
            model=model, examples=examples, grant=grant, transform_graph=transform_graph,
            baseline_model=baseline_model,
            blessing=channel.Channel(type=standard_artifacts.ModelBlessing),
            evaluation=channel.Channel(type=standard_artifacts.ModelEvaluation)))
        check_before_charge(grant, preflight.Check(
            component="SLAedValidator", module_file=module_file, purpose=metric,
            module_needs=(*executor.MODULE_NEEDS[metric],
                          *raw_spec_needs(transform_graph is not None))))
