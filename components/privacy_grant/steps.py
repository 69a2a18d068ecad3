"""What each DP step of a grant runs (issue 17 §1): the BlockLedger component records these
events in the grant, and each component checks that what it ran is what was recorded
(GrantInfo.check_event)."""
from __future__ import annotations

from typing import Any, Mapping

from sage_tfx.choices import Choice
from sage_tfx.sage_access.accounting import accounting_for, pure_dp_event, split_share
from sage_tfx.sage_access.errors import BadRequest



class Mechanism(Choice):
    """What a DP step runs (planned_event). The trainer's step is named by its TrainerMode value
    (a dp_trainer import here would be circular: DPTrainer checks its grant with this package)."""
    ADASSP = "adassp"
    LAPLACE = "laplace"
    DP_SGD = "dp_sgd"
    DP_TRANSFORM = "dp_transform"
    DP_TUNING = "dp_tuning"


MECHANISMS = Mechanism.values()


def planned_event(mechanism: Mapping[str, Any], epsilon: float, delta: float):
    """The dp-accounting event a step of this mechanism runs on an (epsilon, delta) share, or
    None when it cannot be known before the step runs.

    * adassp: three self-composed Gaussians at the calibrated noise multiplier (adassp.py);
    * laplace: any epsilon-DP step made of Laplace releases whose epsilons sum to its share
      (SLAedValidator, DPTransform's analyzers), recorded as its zCDP bound;
    * dp_transform ({"mechanism": "dp_transform", "module_file": ...}): the composition of the
      events of the DP analyzers of the module's preprocessing_fn, each on its share (traced,
      no data: dp_transform.executor.plan_transform); their delta spent outside events
      (vocabularies' partition selection) is `planned_additional_delta`'s;
    * dp_tuning (DPTuner.step_mechanism(): its public search parameters): the search's event,
      Compose(count, RepeatAndSelect(one trial's event, E[K], eta)) at the calibrated noise
      (dp_tuner/tuning.py: no delta outside it, so an rdp ledger charges its curve);
    * dp_sgd: None. Its steps depend on the sampling: SWO and shuffling on the data's size,
      Poisson on a truncation probability that adds a delta an RDP curve cannot carry, so an
      rdp ledger refuses it (a basic ledger charges its (epsilon, delta) share).
    """
    try:
        name = Mechanism.parse(mechanism.get("mechanism"), "DP mechanism")
    except ValueError as error:
        raise BadRequest(str(error)) from None
    if name == Mechanism.ADASSP:
        from sage_tfx.components.dp_trainer import adassp
        return adassp.planned_event(epsilon, delta)
    if name == Mechanism.LAPLACE:
        return pure_dp_event(epsilon)
    if name == Mechanism.DP_TRANSFORM:
        return _transform_plan(mechanism, epsilon, delta).event
    if name == Mechanism.DP_TUNING:
        from sage_tfx.components.dp_tuner import tuning
        return tuning.plan_search(tuning.SearchParameters.of(mechanism), epsilon, delta).event
    return None  # Mechanism.DP_SGD


def _transform_plan(mechanism: Mapping[str, Any], epsilon: float, delta: float):
    """The plan of a dp_transform step (a refusal of the module is a BadRequest: before any
    charge)."""
    from sage_tfx.components.dp_transform.executor import load_module, plan_transform

    if not mechanism.get("module_file"):
        raise BadRequest("a dp_transform step names its module: {'mechanism': 'dp_transform', "
                         "'module_file': ...}")
    try:
        return plan_transform(*load_module(mechanism["module_file"],
                                           mechanism.get("schema_file")), epsilon, delta)
    except ValueError as error:
        raise BadRequest(f"DPTransform's module {mechanism['module_file']!r}: {error}") from None


def planned_additional_delta(mechanisms: dict, split: dict[str, str], epsilon: float,
                             delta: float) -> float:
    """The delta the steps spend outside their events (mechanisms.Release.additional_delta):
    a dp_transform step's vocabularies. The ReleasePlan carries it, so that a ledger that
    cannot charge it (rdp) refuses the grant instead of undercharging."""
    return sum(_transform_plan(mechanism, *split_share(epsilon, delta, split, step))
               .additional_delta
               for step, mechanism in mechanisms.items()
               if mechanism.get("mechanism") == Mechanism.DP_TRANSFORM)


def step_events(mechanisms: dict, split: dict[str, str], epsilon: float, delta: float,
                accounting: str) -> dict:
    """{step: the DpEvent it will run on its share of (epsilon, delta)}, for the steps whose
    mechanism is named; a ledger whose accounting (its mode's name) charges the steps' events
    (rdp) refuses a step without an event."""
    unknown = sorted(set(mechanisms) - set(split))
    if unknown:
        raise BadRequest(f"step_mechanisms names step(s) {unknown} that the split {split} lacks")
    requires_events = accounting_for(accounting).requires_step_events
    events = {}
    for step, mechanism in mechanisms.items():
        event = planned_event(mechanism, *split_share(epsilon, delta, split, step))
        if event is None and requires_events:
            raise BadRequest(f"step {step!r} ({mechanism['mechanism']}) has no DP event before "
                             f"it runs, so an {accounting} ledger cannot charge it (see "
                             "privacy_grant.planned_event); use a basic ledger")
        if event is not None:
            events[step] = event
    return events
