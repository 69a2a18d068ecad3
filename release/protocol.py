"""The release protocol: the one way any front door pays for a release.

    plan      the front door turns its request into a ReleasePlan, once (plan.py)
    preflight the front door runs every check that needs no grant (parse, schema, bounds,
              overflow, user module, files); a refusal charges nothing
    charge    `charge(ledger, plan, selector)`: one ledger grant, recording the front door and
              the request's text; a denial for lack of budget is recorded too (who, how much,
              what was free), then re-raised
    compute   inside `with charged:`; shares are consumed through `charged.share(step)`
    record    `charged.released(artifacts, guarantee)`; leaving the block by an exception
              records `failed` (with a public reason and the phase) or, on Ctrl-C,
              `interrupted`; so no grant looks complete when nothing was released
    guarantee `charged.guarantee(unit, ...)`: the one Guarantee value every output states

Components that consume steps of a grant another component charged (the training DAG: the
BlockLedger component charges, DPTransform, ObliviousSampleGen, DPTrainer and SLAedValidator
spend its steps) record their own steps' outcomes with `consume(ledger, grant, steps, ...)`.

What is recorded is public: the request and budgets are the user's, the outcome and phase are
the front door's control flow, and a failure's message is kept only for the ledger's own
errors (BadRequest and the like, whose messages name public inputs); any other error is
recorded by its type alone, since its message may quote data.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from sage_tfx.choices import Choice
from sage_tfx.release.guarantee import Guarantee, GuaranteeUnit
from sage_tfx.release.plan import ReleasePlan
from sage_tfx.sage_access.errors import BadRequest, BudgetExhausted, LedgerError


class Outcome(Choice):
    """What became of a grant's step (recorded once, in ML Metadata)."""
    RELEASED = "released"
    ISSUED = "issued"  # a bare grant handed to its caller (`sage-tfx ledger request`)
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class ReleaseFailed(Exception):
    """A release failed after its grant was charged: the budget is spent and nothing was
    released. The message says so, names the grant and the phase, and quotes no data."""

    def __init__(self, grant_id: str, reason: str):
        super().__init__(f"grant {grant_id} was charged (that budget is spent) but nothing was "
                         f"released: {reason}")
        self.grant_id, self.reason = grant_id, reason


class ReleaseInterrupted(KeyboardInterrupt):
    """Ctrl-C after the charge: the budget is spent and nothing was released (the message says
    so). A KeyboardInterrupt, so whatever stops on Ctrl-C still stops."""

    def __init__(self, grant_id: str, detail: str = ""):
        super().__init__(f"interrupted after grant {grant_id} was charged: that budget is spent "
                         f"and nothing was released{detail}")
        self.grant_id = grant_id


def public_reason(error: BaseException, phase: str) -> str:
    """Why a phase failed, in words that depend on no data: the phase, and the message of the
    ledger's own errors (about public inputs). Not another error's type or message: two
    neighbouring inputs failing in the same phase for different reasons read the same."""
    if isinstance(error, KeyboardInterrupt):
        return f"interrupted while {phase}"
    if isinstance(error, LedgerError):
        return f"failed while {phase}: {error}"
    return f"failed while {phase}"


def _chain(error: BaseException) -> Optional[BaseException]:
    """The cause to chain a ReleaseFailed to: none (its traceback and message would quote what
    failed, e.g. a tensor's shape, in every log that prints it) unless SAGE_TFX_DEBUG is set."""
    return error if os.environ.get("SAGE_TFX_DEBUG") else None


class Charged:
    """A grant whose release is under way; use it as a context manager (see the module
    docstring). `grant`: the ledger's Grant; `steps`: the steps whose outcome this front door
    records; `spent`: those of them this run charged or consumed (only those get a `failed`
    or `interrupted` record: a run that spent nothing of a step says nothing about it)."""

    def __init__(self, ledger, grant, front_door: str, steps: Sequence[str],
                 spent: Sequence[str] = (), consumed: Sequence[str] = (),
                 charged_here: bool = False):
        self.ledger, self.grant, self.front_door = ledger, grant, front_door
        self.charged_here = charged_here
        self.steps = tuple(steps)
        self.spent = set(spent) | set(consumed)
        self.phase = "computing"
        self._consumed = set(consumed)
        self._recorded = False
        self._handed_on = False

    def share(self, step: str) -> tuple[float, float]:
        """Consume `step`'s share of the grant, once (BlockLedger.use_share); asked again, the
        same share without consuming anything."""
        if step in self._consumed:
            return self.grant.share(step)
        share = self.ledger.use_share(self.grant, step, consumer=self.front_door)
        self.spent.add(step)
        self._consumed.add(step)
        return share

    def guarantee(self, unit: GuaranteeUnit, unit_column: Optional[str] = None,
                  mechanism: Optional[str] = None, epsilon: Optional[float] = None,
                  delta: Optional[float] = None, other_units=()) -> Guarantee:
        """The guarantee of this release: the grant's (epsilon, delta) unless the front door
        states the part it spends."""
        grant = self.grant
        return Guarantee(grant.epsilon if epsilon is None else epsilon,
                         (grant.delta or 0.0) if delta is None else delta, unit, unit_column,
                         grant.grant_id, grant.blocks, mechanism, other_units,
                         for_tests=self.ledger.for_tests)

    def released(self, artifacts: Sequence[str] = (),
                 guarantee: Optional[Guarantee] = None) -> None:
        """Record that the steps released `artifacts` (paths or URIs) under `guarantee`."""
        self._record(Outcome.RELEASED, None, artifacts,
                     guarantee.sentence() if guarantee else None)

    def issued(self) -> None:
        """Record that the grant itself was handed to the caller, who spends it outside the
        platform's front doors (what it releases is the caller's to account for)."""
        self._record(Outcome.ISSUED, None)

    def handed_on(self) -> None:
        """The grant goes on to the components that spend its steps (the BlockLedger
        component's case): they record the outcomes; a failure before this point is recorded
        here."""
        self._handed_on = True

    def _record(self, outcome: Outcome, reason: Optional[str], artifacts: Sequence[str] = (),
                guarantee: Optional[str] = None, steps: Optional[Sequence[str]] = None) -> None:
        self.ledger.record_outcome(self.grant, self.steps if steps is None else steps,
                                   outcome.value, self.front_door, reason, artifacts, guarantee)
        self._recorded = True

    def __enter__(self) -> "Charged":
        # Only a consumer that has spent nothing yet can meet an outcome that stands (one that
        # charged the grant, or consumed its share, owns the step): read the ledger only then.
        if self.spent or not self.steps:
            return self
        recorded = self.ledger.grant_outcomes(self.grant.grant_id)
        stands = sorted(set(self.steps) & set(recorded))
        if stands:
            raise BadRequest(f"step(s) {', '.join(stands)} of grant {self.grant.grant_id} have "
                             f"an outcome already ({recorded[stands[0]]['outcome']} by "
                             f"{recorded[stands[0]]['front_door']}); a grant pays for one "
                             "release: request a new grant")
        return self

    def __exit__(self, error_type, error, traceback) -> bool:
        if error is None:
            if not (self._recorded or self._handed_on):
                self._record(Outcome.FAILED, f"{self.front_door} recorded no release")
                raise ReleaseFailed(self.grant.grant_id, "the front door recorded no release")
            return False
        if self._recorded or isinstance(error, (ReleaseFailed, ReleaseInterrupted)):
            return False  # released before the error (it stands), or already said
        interrupted = isinstance(error, KeyboardInterrupt)
        reason = public_reason(error, self.phase)
        spent = [step for step in self.steps if step in self.spent] if self.steps else []
        if self.steps and not spent:
            # This run spent none of its steps (a share another consumer used, a failure
            # before consuming): nothing to record, and a retry may still spend them. The
            # ledger's own errors are public; any other is said without its message.
            if isinstance(error, LedgerError) or interrupted:
                return False
            raise ReleaseFailed(self.grant.grant_id, reason) from _chain(error)
        detail = ""
        try:
            self._record(Outcome.INTERRUPTED if interrupted else Outcome.FAILED, reason,
                         steps=spent)
            detail = f" (recorded as {'interrupted' if interrupted else 'failed'} in the ledger)"
        except Exception:  # the store is gone too: the grant stays `incomplete`, still spent
            pass
        if interrupted:
            raise ReleaseInterrupted(self.grant.grant_id, detail) from _chain(error)
        if isinstance(error, LedgerError) and not self.charged_here:
            # A component spending a grant charged elsewhere: the ledger's own (public) error
            # goes on as it is, now recorded on the step.
            return False
        raise ReleaseFailed(self.grant.grant_id, reason + detail) from _chain(error)


def record_denial(ledger, plan: ReleasePlan, denied: BudgetExhausted) -> None:
    """Record a request `plan` that the blocks could not pay (nothing was charged)."""
    ledger.record_denial(plan.front_door, plan.request, plan.pipeline, plan.epsilon,
                         plan.delta, denied.remaining, str(denied))


def charge(ledger, plan: ReleasePlan, selector) -> Charged:
    """Charge `plan` on the blocks `selector` picks (BlockIds or RecentWindow): all or nothing.
    BudgetExhausted (recorded as a denial first) or BadRequest leave the ledger uncharged; so
    does a plan `seeded_by` a fixed seed on a ledger not created for tests."""
    ledger.refuse_fixed_seed(plan.seeded_by)
    try:
        grant = ledger.request(selector, epsilon=plan.epsilon, delta=plan.delta,
                               rdp_curve=plan.rdp_curve,
                               pipeline=plan.pipeline, run_id=plan.run_id,
                               split=plan.split or None,
                               events=plan.events, data_uri=plan.data_uri,
                               require_data=plan.require_data,
                               additional_delta=plan.additional_delta,
                               front_door=plan.front_door, request_text=plan.request)
    except BudgetExhausted as denied:
        record_denial(ledger, plan, denied)
        raise
    # This run charged the whole grant: a failure is recorded on every step.
    return Charged(ledger, grant, plan.front_door, plan.steps, spent=plan.steps,
                   charged_here=True)


def consume(ledger, grant, steps: Sequence[str], front_door: str,
            consumed: Sequence[str] = (), seeded_by: Sequence[str] = ()) -> Charged:
    """The part of a grant charged elsewhere that `front_door` spends: its `steps` (their
    outcome is recorded by this front door), of which `consumed` were consumed already
    (GrantInfo.share); entering refuses a step whose outcome stands (nothing consumed).
    `seeded_by` (what fixes a seed for its noise or sampling) is refused first, with nothing
    consumed, unless the ledger was created for tests (a grant charged elsewhere, e.g. by an
    Importer's DAG, never passed the BlockLedger component's check)."""
    ledger.refuse_fixed_seed(seeded_by)
    return Charged(ledger, grant, front_door, steps, consumed=consumed)
