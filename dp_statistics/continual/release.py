"""A window's charged run, shared by `sage-tfx stream` and the ContinualRelease component: the
grant (grant.py), the in-process engine (local.run_local) over the window's micro-batches, one
release per trigger written as a CSV and a JSON guarantee line, and a progress bar.

Order (charge before release): the caller has read and checked every input; `run_window` checks
a resumed state is this window's (its blocks and its grant), then the engine charges the grant
once (a state that already holds a grant id is never charged again) before the first step,
the run pins every trigger it will compute in the ledger (`pin_triggers`) before computing any,
and the engine writes each trigger's release before committing it.

Pins: which copy of the state computes a trigger. The ContinualRelease component copies the
last successful run's state into each run's own directory; a run that took trigger t and
failed leaves the older state, from which the next run would compute t again, from other
records (the failed run's arrivals are not in it): with the grant's keyed noise the two
releases of t would differ by exactly those records. So each trigger is pinned, once per grant
(BlockLedger.pin: create-once), to a token of the state directory that computes it, and a run
whose directory holds another token for it is refused, nothing computed. What a reader of ML
Metadata sees of a pin must not depend on the data:
* its value is a random token (state.pin_tokens), not a digest of the micro-batch: a digest,
  even keyed, was equal for equal micro-batches (every empty one alike), which told which
  micro-batches were empty;
* its creation time (MLMD's create_time_since_epoch, the wall clock of the write) is the
  run's start: a run pins all its triggers in one go, right after the charge (first run) or
  after loading the state (later runs), before any micro-batch is computed. Pinned per trigger
  before its computation, pin t's time was the run's start plus the compute time of
  micro-batches 1..t-1, which depends on the data. What precedes the pins is the reading of the
  input and the state, which the grant's own record (written after the input is read and
  checked, as every front door's charge) follows too;
* whether a trigger is pinned, and by which copy, follows from which runs reached it (public:
  their `through` triggers), never from the records: a run from an older copy is refused
  whether or not its records differ from the failed run's (refusing only when they differ
  would tell where a late record fell).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import os
from typing import Optional

from sage_tfx import console
from sage_tfx.dp_statistics.continual import grant as window_grants
from sage_tfx.dp_statistics.continual import local
from sage_tfx.dp_statistics.continual.budget import plan
from sage_tfx.dp_statistics.continual.sources import Records, Window
from sage_tfx.dp_statistics.continual.state import StreamStateError, WindowState, pin_tokens
from sage_tfx.release import ReleaseFailed, ReleaseInterrupted, public_reason, write_json
from sage_tfx.sage_access.errors import BadRequest, LedgerError

STATE_DIR = "state"


def budget_of(query):
    """The window's calibration (budget.plan) for `query`."""
    return plan(query.epsilon, query.delta, query.micro_batches, query.contribution_limit,
                query.value_bound, mechanism=query.mechanism)


class ReleaseSink(local.CsvDirectorySink):
    """release-T.csv (key, value, updated: every key released so far in the window with its
    latest noisy value) and release-T.json, one line: the trigger, its public time, the
    guarantee's (epsilon, delta), unit and mechanism (the budget's statement), the grant. Both written atomically; a trigger
    recomputed after a crash rewrites the same bits (keyed noise). `grant` holds the window's
    grant id and blocks (set when the engine charges, or from the resumed state)."""

    def __init__(self, directory: str, query, window: Window, grant: dict, mechanism: str,
                 for_tests: bool):
        super().__init__(directory)
        self.query, self.window, self.grant = query, window, grant
        self.mechanism, self.for_tests = mechanism, for_tests

    def __call__(self, release) -> None:
        super().__call__(release)
        query = self.query
        trigger = self.window.trigger_times(query.micro_batches)[release.step - 1]
        guarantee = query.guarantee(self.grant["blocks"], self.grant["id"], self.mechanism,
                                    self.for_tests)
        line = {"trigger": int(release.step), "micro_batches": query.micro_batches,
                "trigger_time": dt.datetime.fromtimestamp(trigger, dt.timezone.utc).isoformat(),
                **guarantee.to_json(), "csv": os.path.basename(self.path(release.step))}
        write_json(self.path(release.step)[:-len(".csv")] + ".json", line)


def resumable_state(ledger, state_dir: str, window: Window, budget) -> Optional[WindowState]:
    """The state saved in `state_dir` (None if there is none), refused (BadRequest) unless its
    blocks and grant are this window's: a restart never charges again, and never under a grant
    that does not pay for what it releases."""
    try:
        state = WindowState.load(state_dir)
    except StreamStateError as error:
        raise BadRequest(str(error)) from None
    if state is None or state.grant_id is None:
        return state
    if tuple(state.blocks) != tuple(window.block_ids):
        raise BadRequest(f"{state_dir} holds the window of blocks {', '.join(state.blocks)}, "
                         f"not {', '.join(window.block_ids)}; use a new directory")
    window_grants.window_grant(ledger, state.grant_id, window.block_ids, budget)
    return state


def run_window(ledger, query, window: Window, records: Records, state_dir: str,
               release_dir: str, *, consumer: str, through_step: Optional[int] = None,
               pipeline: Optional[str] = None, run_id: Optional[str] = None) -> WindowState:
    """Run the window's micro-batches up to `through_step` (default: all T) on `records`,
    charging the window's grant first unless `state_dir` already holds it. Without
    `through_step` every micro-batch 1..T is given to the engine, which keeps the ones a
    previous run took (records of `records` for them are late, dropped: local.py); with it (a
    live stream that goes on) only the ones after the saved state's step, and the state is
    saved at the end. The noise key is always fresh (drawn when the grant is charged): a
    fixed one is for the engine's own tests (local.run_local), never through a ledger."""
    budget = budget_of(query)
    total = query.micro_batches
    last = total if through_step is None else through_step
    previous = resumable_state(ledger, state_dir, window, budget)
    done = previous.step if previous is not None else 0
    first = 1 if through_step is None else done + 1
    batches = ((step, batch.frame()) for step, batch in records.micro_batches(total)
               if first <= step <= last)

    grant = {"id": previous.grant_id, "blocks": previous.blocks} if previous is not None \
        else {}

    def pin_triggers(grant_id: str) -> None:
        # This run's triggers, all at once before any is computed (module docstring).
        for step, token in pin_tokens(state_dir, range(done + 1, last + 1)).items():
            ledger.pin(grant_id, f"{window_grants.STEP}/trigger-{step}",
                       _bound_to_directory(token, state_dir))

    def charge():
        # A refusal is all-or-nothing; run_local clears its "charge started" mark on it, so the
        # same directory may try again.
        granted = window_grants.request_window_grant(
            ledger, window.block_ids,
            window_grants.window_plan(query, budget, consumer, pipeline, run_id))
        grant.update(id=granted.grant_id, blocks=granted.blocks)
        return granted.grant_id, granted.blocks

    sink = ReleaseSink(release_dir, query, window, grant, budget.statement, ledger.for_tests)
    try:
        with console.progress("continual release", total, unit="trigger", start=done) as bar:
            state = local.run_local(
                query, budget, batches, state_dir, sink, charge=charge, progress=bar.update,
                complete_window=last == total, granted=pin_triggers,
                # A live stream stops between triggers: every step is saved, so the next run
                # needs none of this run's records. A whole window is a replay of records in
                # hand: its micro-batches are taken REPLAY_TAKE_AHEAD at a time (one sync).
                snapshot_every=None if through_step is None else 1,
                take_ahead=local.REPLAY_TAKE_AHEAD if through_step is None else 1)
    except StreamStateError as error:
        raise BadRequest(str(error)) from None
    except KeyboardInterrupt:
        if grant.get("id"):
            raise ReleaseInterrupted(grant["id"], _RESUME) from None
        raise
    except Exception as error:
        # After the charge a failure says the budget is spent, in public words (the phase),
        # and how to go on; the grant stays incomplete, since the window can resume.
        if grant.get("id") and not isinstance(error, LedgerError):
            raise ReleaseFailed(grant["id"], public_reason(error, "computing the window")
                                + _RESUME) from None
        raise
    return state


def _bound_to_directory(token: str, state_dir: str) -> str:
    """The pin of a trigger: its token bound to this very state directory (its device and
    inode). A copy of the directory carries the tokens but not the inode, so it cannot pin
    the same value and is refused a trigger another copy took (two copies computing trigger t
    from different records under the same keyed noise would publish their difference).
    Resuming in the same directory, or after moving it within its file system, pins the same
    value; a restored backup is another directory and starts a new window. Still a function
    of random bits only: a reader of the ledger learns nothing about the data from it."""
    status = os.stat(state_dir)
    return hashlib.sha256(f"{token}:{status.st_dev}:{status.st_ino}".encode()).hexdigest()


_RESUME = ("; run again with the same state directory to resume the window (nothing more is "
           "charged)")


def record_released(ledger, query, state: WindowState, front_door: str,
                    release_dir: str) -> None:
    """Once the window's last trigger is out and written (the caller's last step), record its
    grant released with the release directory and the guarantee."""
    if state.step == query.micro_batches and state.grant_id is not None:
        window_grants.record_window_released(
            ledger, state.grant_id, front_door, os.path.abspath(release_dir),
            state.guarantee(ledger.for_tests))
