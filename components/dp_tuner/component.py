"""DPTuner component: TFX's Tuner (a module's `tuner_fn`, TFX's `best_hyperparameters` output) as
a private selection over DP-SGD trials on the grant's tuning share."""
from __future__ import annotations

import json
from typing import Mapping, Optional

from tfx.dsl.components.base import base_component, executor_spec
from tfx.types import channel, component_spec, standard_artifacts

from sage_tfx.components.block_ledger import preflight
from sage_tfx.components.block_ledger.component import (check_before_charge,
                                                        record_step_mechanism,
                                                        refuse_seed_before_charge)
from sage_tfx.components.dp_trainer.component import DPTrainerSpec
from sage_tfx.components.dp_trainer.parameters import TrainerMode, module_needs
from sage_tfx.components.dp_tuner import executor, search_space, tuning

# The parameters the search plan reads (tuning.SearchParameters): public, so the BlockLedger
# plans the search and records its event before the charge.
SEARCH_PARAMETERS = (*tuning.DEFAULTS, "metric", "loss_bound", "max_noise_multiplier")


def _optional(kind: type) -> component_spec.ExecutionParameter:
    return component_spec.ExecutionParameter(type=kind, optional=True)


class DPTunerSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "module_file": component_spec.ExecutionParameter(type=str),
        "grant_step": component_spec.ExecutionParameter(type=str),
        **{name: _optional(str) for name in ("tuner_fn", "model_fn", "custom_config", "metric")},
        **{name: _optional(int) for name in ("epochs", "seed")},
        **{name: _optional(float) for name in (
            "learning_rate", "l2_norm_clip", "gamma", "trials_mean", "trials_shape",
            "holdout_fraction", "count_fraction", "score_fraction", "loss_bound",
            "max_noise_multiplier")},
    }
    # What the Trainer reads, as TFX's Tuner takes the Trainer's inputs.
    INPUTS = {name: parameter for name, parameter in DPTrainerSpec.INPUTS.items()
              if name != "hyperparameters"}
    OUTPUTS = {
        "best_hyperparameters": component_spec.ChannelParameter(
            type=standard_artifacts.HyperParameters),
    }


class DPTuner(base_component.BaseComponent):
    """Tunes DP-SGD's `learning_rate` and `l2_norm_clip` for the model of `module_file` on the
    grant's `grant_step` share (default "tuning"): the module's `tuner_fn` (TFX's name; a
    TunerFnResult with a KerasTuner space, a dict {name: [values]} or a list of candidate
    settings, search_space.py) gives the candidates; `learning_rate` and `l2_norm_clip` here are
    the defaults a candidate leaves out. `examples` are the BlockLedger's granted Examples
    (their train split; a held-out share of it scores the trials).

    The search (tuning.py): K ~ truncated negative binomial (shape `trials_shape`, mean
    `trials_mean`) trials, each a DP-SGD run of `epochs` x 1/`gamma` Poisson steps on a random
    candidate, scored by a DP `metric` (accuracy, or loss clipped to `loss_bound`) on the
    held-out share; only the best candidate and its DP score are released, as TFX's
    `best_hyperparameters` artifact (best_hyperparameters.txt, KerasTuner's config; custom
    properties dp_score, metric, dp_epsilon, dp_delta, noise_multiplier, trials_mean,
    trials_shape). TFX's Tuner also writes `tuner_results` (every trial's score): DPTuner has no
    such output, it would undo the selection's guarantee.

    The grant's step records the search's event: DPTuner adds its `step_mechanism()` to the
    producing BlockLedger's step_mechanisms (a grant from elsewhere must have recorded it); the
    BlockLedger checks before it charges what this
    component would refuse after it: the module imports and its tuner_fn's space (non-empty,
    known names), the model on stand-ins, and the plan's calibration on the share."""

    SPEC_CLASS = DPTunerSpec
    SPENDS_GRANT = True  # reads private records (dag_guard)
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.Executor)

    def __init__(self, examples: channel.Channel, grant: channel.Channel, module_file: str,
                 tuner_fn: Optional[str] = None, model_fn: Optional[str] = None,
                 transform_graph: Optional[channel.Channel] = None,
                 custom_config: Optional[Mapping] = None,
                 grant_step: str = tuning.DEFAULT_GRANT_STEP,
                 learning_rate: Optional[float] = None, l2_norm_clip: Optional[float] = None,
                 seed: Optional[int] = None, **search: Optional[float]):
        unknown = sorted(set(search) - set(SEARCH_PARAMETERS))
        if unknown:
            raise TypeError(f"DPTuner got unknown parameter(s) {unknown}")
        tuning.SearchParameters.of(search)  # a bad value is refused at construction
        super().__init__(spec=DPTunerSpec(
            module_file=module_file, tuner_fn=tuner_fn, model_fn=model_fn,
            custom_config=json.dumps(dict(custom_config or {})), grant_step=grant_step,
            learning_rate=learning_rate, l2_norm_clip=l2_norm_clip, seed=seed,
            examples=examples, grant=grant, transform_graph=transform_graph,
            best_hyperparameters=channel.Channel(type=standard_artifacts.HyperParameters),
            **search))
        if seed is not None:
            refuse_seed_before_charge(grant, f"DPTuner seed {seed}")
        record_step_mechanism(grant, grant_step, self.step_mechanism()[grant_step])
        check_before_charge(grant, preflight.Check(
            component="DPTuner", module_file=module_file, purpose=TrainerMode.DP_SGD,
            module_needs=module_needs(TrainerMode.DP_SGD, transform_graph is not None),
            legacy_keras=True,
            trainer={"mode": TrainerMode.DP_SGD, "model_fn": model_fn, "grant_step": grant_step,
                     "transform_graph": transform_graph is not None},
            tuning={"tuner_fn": tuner_fn or search_space.DEFAULT_TUNER_FN,
                    "custom_config": dict(custom_config or {}),
                    "learning_rate": learning_rate, "l2_norm_clip": l2_norm_clip,
                    "grant_step": grant_step, **search}))

    def step_mechanism(self) -> dict:
        """This search's entry in the BlockLedger's step_mechanisms: {grant_step: mechanism}."""
        properties = self.exec_properties
        mechanism = tuning.SearchParameters.of(properties).as_mechanism()
        return {properties["grant_step"]: json.loads(json.dumps(mechanism))}
