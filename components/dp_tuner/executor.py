"""DPTuner executor: check the grant, plan the search on the tuning share, run the private
selection over DP-SGD trials (tuning.py) in a process of its own (search_process.py: nothing
that depends on the number of trials stays in this one) and write TFX's best_hyperparameters
with the best setting only."""
from __future__ import annotations

import json
from typing import Any, Mapping

from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils

from sage_tfx import console
from sage_tfx.components.dp_trainer import stand_in
from sage_tfx.components.dp_trainer.parameters import TrainerMode, module_needs
from sage_tfx.components.dp_tuner import search_process, search_space, tuning
from sage_tfx.components.privacy_grant import require_grant
from sage_tfx.components.util.user_module import UserModule
from sage_tfx.release import GuaranteeUnit
from sage_tfx.sage_access.exact import set_exact_property

# Custom properties of the released HyperParameters artifact (all public or DP).
DP_SCORE = "dp_score"  # the best trial's DP metric on the held-out share
METRIC = "metric"
DP_EPSILON, DP_DELTA = "dp_epsilon", "dp_delta"
NOISE_MULTIPLIER = "noise_multiplier"
TRIALS_MEAN, TRIALS_SHAPE = "trials_mean", "trials_shape"


def load(module_file: str, given: Mapping[str, Any], transform_graph: bool):
    """The module, its candidates (completed with the defaults given for what a candidate
    leaves out) and the search parameters, from DPTuner's parameters `given` (custom_config a dict), checked: BadRequest
    or ValueError naming the cause. The BlockLedger's preflight makes these checks before the
    charge (`preflight`); the executor makes them again."""
    candidates = search_space.load_candidates(
        module_file, given.get("tuner_fn") or search_space.DEFAULT_TUNER_FN,
        given.get("custom_config"))
    defaults = {name: float(given[name]) for name in search_space.TUNABLE
                if given.get(name) is not None}
    missing = [name for name in search_space.TUNABLE
               if name not in defaults and any(name not in c for c in candidates)]
    if missing:
        raise ValueError(f"DPTuner needs a default {missing}: a candidate leaves it out")
    module = UserModule.load(module_file, "DPTuner",
                             module_needs(TrainerMode.DP_SGD, transform_graph),
                             model_fn=given.get("model_fn"))
    # Every candidate complete: the released setting is everything its trial trained with.
    return (module, [{**defaults, **candidate} for candidate in candidates],
            tuning.SearchParameters.of(given))


def preflight(module_file: str, given: Mapping[str, Any], epsilon: float, delta: float,
              split: Mapping[str, float], events: Mapping[str, object]) -> None:
    """Before the charge: `load`'s checks, the search's calibration on its step's share of
    (epsilon, delta) with `split`, and the event the grant will record for the step is the
    plan's (a step without its dp_tuning mechanism would be charged nothing for the search)."""
    from sage_tfx.sage_access.accounting import split_share

    step = given.get("grant_step") or tuning.DEFAULT_GRANT_STEP
    if step not in split:
        raise ValueError(f"the grant's split has no {step!r} step for DPTuner")
    _, _, parameters = load(module_file, given, bool(given.get("transform_graph")))
    plan = tuning.plan_search(parameters, *split_share(epsilon, delta, split, step))
    if events.get(step) != plan.event:
        raise ValueError(f"the grant records {events.get(step)} for step {step!r}, not the "
                         "search's event: give the BlockLedger step_mechanisms "
                         "DPTuner.step_mechanism()")


class Executor(base_executor.BaseExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        examples = artifact_utils.get_single_instance(input_dict["examples"])
        grant = require_grant(input_dict["grant"], [examples])
        seed = exec_properties.get("seed")
        grant.refuse_fixed_seed("DPTuner", seed)
        step = exec_properties.get("grant_step") or tuning.DEFAULT_GRANT_STEP
        has_transform = bool(input_dict.get("transform_graph"))
        with grant.releasing(step, "DPTuner component") as charged:
            epsilon, delta = grant.share(step)
            given = {**exec_properties,
                     "custom_config": json.loads(exec_properties.get("custom_config") or "{}")}
            module, candidates, parameters = load(exec_properties["module_file"], given,
                                                  has_transform)
            plan = tuning.plan_search(parameters, epsilon, delta)
            # The ledger charged the event it recorded for this step (privacy_grant.planned_event).
            grant.check_event(step, plan.event)
            transform_output = transform_graph_uri = None
            if has_transform:
                import tensorflow_transform as tft
                transform_graph_uri = artifact_utils.get_single_instance(
                    input_dict["transform_graph"]).uri
                transform_output = tft.TFTransformOutput(transform_graph_uri)
            # As DPTrainer: the module's code on public stand-ins before any record is read.
            stand_in.check_module(module, transform_output)
            # Public facts only: no trial, no count, no score but the released one.
            console.report("DPTuner: private selection among %d candidate(s), E[K] = %g trials "
                           "of %d DP-SGD step(s) at noise multiplier %.4g; epsilon %.4g of %.4g",
                           len(candidates), parameters.trials_mean, parameters.steps,
                           plan.noise_multiplier, plan.epsilon, epsilon)
            # The records are read and the trials run in the search's process only.
            best = search_process.run_search(search_process.SearchTask(
                exec_properties["module_file"], given, examples.uri, transform_graph_uri, plan,
                seed))
            output = artifact_utils.get_single_instance(output_dict["best_hyperparameters"])
            search_space.write_best_hyperparameters(output.uri, candidates, best.settings)
            set_exact_property(output, DP_SCORE, best.score)
            set_exact_property(output, DP_EPSILON, plan.epsilon)
            set_exact_property(output, DP_DELTA, delta)
            set_exact_property(output, NOISE_MULTIPLIER, plan.noise_multiplier)
            set_exact_property(output, TRIALS_MEAN, parameters.trials_mean)
            set_exact_property(output, TRIALS_SHAPE, parameters.trials_shape)
            output.set_string_custom_property(METRIC, parameters.metric)
            charged.released([output.uri], charged.guarantee(GuaranteeUnit.RECORD))
