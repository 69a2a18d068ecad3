"""What the components a grant pays for check before the BlockLedger charges it.

A component that consumes a BlockLedger's grant (DPTrainer, SLAedValidator) registers, when it is
constructed, the checks it can make without the grant (component.check_before_charge): its user
module loads and defines what it needs, Keras 2 is in effect when DP-SGD needs it, DP-SGD's
model and loss pass DP-SGD's checks and one DP-SGD step on public stand-in batches
(dp_trainer/stand_in.py), DP-SGD's compiled step kernels load, and DP-SGD's calibration fits its
share where public values decide it (dp_trainer.preflight, the check the privacy-adaptive
driver makes too), and DPStatisticsGen's features read as one value with public clamping bounds
and its grant (the events its steps record, its ledger's accounting) pays for its statistics.
The BlockLedger executor runs them all before
`ledger.request`: a pipeline that would fail after the charge for one of these reasons fails
before it, with nothing charged. The checks read the pipeline's parameters and this process's
environment only, never a record, so whether they pass tells nothing about the data.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from sage_tfx.sage_access.errors import BadRequest

PROPERTY = "preflight"  # the BlockLedger's execution parameter: a JSON list of Check


@dataclass(frozen=True)
class Check:
    """One downstream component's checks. `purpose` and `module_needs` are what it passes to
    UserModule.load; `trainer` and `sampling` are DPTrainer's and ObliviousSampleGen's
    parameters, for dp_trainer.preflight."""
    component: str
    module_file: str
    purpose: str
    module_needs: Sequence[str] = ()
    legacy_keras: bool = False
    trainer: Optional[Mapping] = None
    sampling: Optional[Mapping] = None
    # DPTransform's: the grant step whose share its preprocessing_fn spends (audited, no data).
    transform_step: Optional[str] = None
    # DPTransform's schema file (its schema channel's source), else the module's feature_spec.
    schema_file: Optional[str] = None
    # DPStatisticsGen's parameters: its features' bounds and options (dp_statistics_gen).
    statistics: Optional[Mapping] = None
    # DPTuner's parameters: its tuner_fn's space and its search plan (dp_tuner.executor).
    tuning: Optional[Mapping] = None

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "module_needs": list(self.module_needs)}


def parse(text: Optional[str]) -> list[Check]:
    return [Check(**check) for check in json.loads(text or "[]")]


def run(checks: Sequence[Check], epsilon: float, delta: float,
        split: Mapping[str, float], events: Optional[Mapping] = None,
        accounting=None) -> None:
    """BadRequest naming the component and the fix for the first check that fails. The grant
    about to be requested: (epsilon, delta), its `split`, the `events` its steps record
    (privacy_grant.step_events) and the `accounting` of the ledger that will charge it (the
    BlockLedger gives both; DPStatisticsGen's check needs the accounting)."""
    # Imported here: dp_trainer's package imports this one's component (a cycle at import).
    from sage_tfx.components.dp_trainer.parameters import preflight as trainer_preflight
    from sage_tfx.components.dp_trainer.parameters import trains_with_dp_sgd
    from sage_tfx.components.util.legacy_keras import require_legacy_keras
    from sage_tfx.components.util.user_module import UserModule

    for check in checks:
        refusal = f"refused before the charge (nothing was charged): {check.component}"
        try:
            if check.legacy_keras:
                require_legacy_keras()
            if check.transform_step is not None:
                _transform_audit(check, epsilon, delta, split, events or {})
                continue
            if check.statistics is not None:
                _statistics_plan(check, epsilon, delta, split, events or {}, accounting)
                continue
            module = UserModule.load(check.module_file, check.purpose, check.module_needs,
                                     model_fn=(check.trainer or {}).get("model_fn"))
            if check.tuning is not None:
                from sage_tfx.components.dp_tuner.executor import preflight as tuner_preflight

                tuner_preflight(check.module_file, {**check.tuning, **check.trainer},
                                epsilon, delta, split, events or {})
            if check.trainer is not None:
                trainer_preflight(check.trainer, check.sampling, epsilon, delta, split)
                if trains_with_dp_sgd(check.trainer):
                    _refuse_unclippable_model(module, check.module_file, check.trainer)
        except (ValueError, RuntimeError, TypeError) as error:
            raise BadRequest(f"{refusal}: {error}") from error
        except Exception as error:  # the user's module raised while it was imported
            raise BadRequest(f"{refusal}: module file {check.module_file!r} does not import: "
                             f"{type(error).__name__}: {error}") from error


def _refuse_unclippable_model(module, module_file: str, trainer: Mapping) -> None:
    """DP-SGD's checks on the module's model and loss, on public stand-in batches built from
    its feature_spec (dp_trainer.stand_in.check_module: no batch normalisation, no state a
    step keeps, no example depending on another, a loss taken per example, and one whole
    DP-SGD step on the check's own copy of the model), so that the model's or loss's own
    failure is named before the charge. With a transform graph (not made yet) the stand-ins
    are the model's declared inputs (its named Inputs: names, dtypes, shapes). Also
    DP-SGD's step kernels load (step_ops: compiled on first use, so a machine without a C++
    compiler is named here, not after the charge). The stand-in check runs once per process
    and module (util/stand_in_cache.py); DPTrainer's own, without a transform graph, is the
    same check."""
    from sage_tfx.components.dp_trainer import stand_in, step_ops  # DP-SGD only
    from sage_tfx.components.util.stand_in_cache import check_once

    step_ops.library()
    transform_pending = bool(trainer.get("transform_graph"))
    # The check reads the module (its bytes, and model_fn naming its builder) and whether the
    # transform graph is pending: all in the key.
    check_once("DP-SGD stand-in check", module_file, (transform_pending, trainer.get("model_fn")),
               lambda: stand_in.check_module(module, transform_pending=transform_pending))


def _statistics_plan(check: Check, epsilon: float, delta: float, split: Mapping[str, float],
                     events: Mapping[str, object], accounting) -> None:
    """DPStatisticsGen's plan on its step's share, without data: every numeric feature has
    public clamping bounds, string features have delta, and the grant (its step's event, its
    ledger's accounting) pays for what runs (dp_statistics_gen.executor.preflight)."""
    from sage_tfx.components.dp_statistics_gen.executor import preflight as statistics_preflight

    if accounting is None:
        raise ValueError("its check needs the accounting of the ledger that will charge the "
                         "grant")
    given = dict(check.statistics)
    statistics_preflight(given, given.pop("grant_step"), epsilon, delta, split, events,
                         accounting)


def _transform_audit(check: Check, epsilon: float, delta: float, split: Mapping[str, float],
                     events: Mapping) -> None:
    """DPTransform's own audit, without data: the module loads, its preprocessing_fn uses
    only DP analyzers whose shares fit the step's (epsilon, delta), each analyzer has the
    public bounds it needs, the step's planned event covers what they run
    (dp_transform.executor.plan_transform, check_planned_event), and one whole preprocessing
    pass runs on public stand-in records (stand_in_pass)."""
    from sage_tfx.components.dp_transform.executor import (check_planned_event, load_module,
                                                           plan_transform, stand_in_pass)
    from sage_tfx.components.util.stand_in_cache import check_once
    from sage_tfx.sage_access.accounting import split_share

    if check.transform_step not in split:
        raise ValueError(f"the grant's split has no {check.transform_step!r} step for "
                         "DPTransform")
    preprocessing_fn, feature_spec = load_module(check.module_file, check.schema_file)
    plan = plan_transform(preprocessing_fn, feature_spec,
                          *split_share(epsilon, delta, split, check.transform_step))
    check_planned_event(events.get(check.transform_step), plan,
                        f"step {check.transform_step!r}")
    # Once per process, module, raw feature spec and plan (util/stand_in_cache.py): the spec
    # may come from a schema file, outside the module's bytes. The pass reads the plan's shares
    # and deltas; its planned releases' values are draws on stand-ins it never reads.
    check_once("DPTransform stand-in pass", check.module_file,
               (repr(sorted(feature_spec.items())), dataclasses.replace(plan, releases=())),
               lambda: stand_in_pass(preprocessing_fn, feature_spec, plan))
