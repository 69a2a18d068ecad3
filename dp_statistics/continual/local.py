"""The in-process engine: replays a window's micro-batches through operator.step, durably.

``run_local(query, budget, batches, state_dir, sink)`` runs every trigger 1..T of one window,
writes one release per trigger through ``sink`` and commits after each step, so a crash or a
restart resumes with no micro-batch counted twice, no release repeated with fresh noise and no
second charge (the design's "Durability" section):

- the first run draws the noise key, saves the state (step 0), marks the charge as started,
  charges the grant (``charge()``) and saves its id: a restart never charges again (and refuses,
  rather than charge twice, if it died between marking and saving the grant);
- before step t: ``pending`` = {t, sha256 of micro-batch t}; compute; ``sink(release t)``;
  commit t; clear pending. A restart whose micro-batch t differs from a pending t is refused:
  with keyed noise the same data gives the same release bits, different data would publish a
  second release of step t that differs by exactly the changed records;
- a commit appends the step's digest to ``commit.json`` (atomic rename); the whole state is
  saved (``state.npz``, atomic rename) when replaying since the last save would cost more than
  writing it (records since the save >= rows of state) and at the last step, so the total I/O
  stays linear in the stream. A restart loads the saved state (step s0), verifies and skips
  micro-batches <= s0, recomputes the committed ones after s0 from the input without releasing
  them again (keyed noise: the same state bit for bit) and goes on from the first uncommitted.

Trigger times are public: a step the stream has no records for still runs (empty micro-batch),
so keys predicted to cross there are released.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from sage_tfx.dp_statistics.aggregation.spec import QueryError
from sage_tfx.dp_statistics.continual import operator
from sage_tfx.dp_statistics.continual._standin import KeyedGaussian, StreamBudget
from sage_tfx.dp_statistics.continual.spec import StreamQuery
from sage_tfx.dp_statistics.continual.state import (StreamStateError, WindowState, batch_digest,
                                                    check_budget, clear_pending, read_pending,
                                                    write_json, write_pending)

COMMIT_FILE = "commit.json"
Sink = Callable[[operator.TriggerRelease], None]
Charge = Callable[[], tuple[str, Sequence[str]]]  # -> (grant id, block ids)


def empty_batch() -> pd.DataFrame:
    return pd.DataFrame({"unit": pd.Series([], dtype=object), "key": pd.Series([], dtype=object),
                         "value": pd.Series([], dtype=np.float64)})


class _Journal:
    """Which steps are committed: the saved state's step plus the digests committed after it."""

    def __init__(self, directory: str, state: WindowState):
        self.path = os.path.join(directory, COMMIT_FILE)
        self.snapshot = state.step
        self.digests: list[str] = []
        if os.path.exists(self.path):
            with open(self.path) as source:
                recorded = json.load(source)
            # A journal older than the saved state (it died between the two renames) is moot.
            if recorded["snapshot"] == state.step:
                self.digests = list(recorded["digests"])
            elif recorded["snapshot"] > state.step:
                raise StreamStateError(f"{self.path} continues a state saved at step "
                                       f"{recorded['snapshot']}, but the saved state is at step "
                                       f"{state.step}: the state directory was tampered with")

    @property
    def committed(self) -> int:
        return self.snapshot + len(self.digests)

    def digest(self, step: int) -> str:
        return self.digests[step - self.snapshot - 1]

    def commit(self, digest: str) -> None:
        self.digests.append(digest)
        self._write()

    def saved(self, step: int) -> None:
        self.digests = self.digests[step - self.snapshot:]
        self.snapshot = step
        self._write()

    def _write(self) -> None:
        write_json(self.path, {"snapshot": self.snapshot, "digests": self.digests})


def _open_state(query: StreamQuery, budget: StreamBudget, state_dir: str,
                noise_key: Optional[bytes]) -> WindowState:
    state = WindowState.load(state_dir)
    if state is None:
        key = noise_key if noise_key is not None else KeyedGaussian.fresh().key
        state = WindowState.fresh(query, budget, key)
        state.save(state_dir)
        return state
    if state.query != query or state.budget != budget:
        raise StreamStateError(f"{state_dir} holds the state of another window query "
                               f"({state.query}); use a new state directory for this one")
    return state


def _charge_once(state: WindowState, state_dir: str, charge: Optional[Charge]) -> None:
    if state.grant_id is not None or charge is None:
        return
    if state.charge_started:
        raise StreamStateError(
            f"{state_dir}: a previous run started charging this window's grant and stopped "
            "before recording it; it may be charged. Look it up in the ledger (sage-tfx ledger) "
            "rather than charge again; this state directory cannot resume")
    state.charge_started = True
    state.save(state_dir)
    grant_id, blocks = charge()
    state.grant_id, state.blocks = str(grant_id), tuple(str(b) for b in blocks)
    state.save(state_dir)


def _state_rows(state: WindowState) -> int:
    return len(state.units) + len(state.pairs) + state.n_keys + state.selection.size


def run_local(query: StreamQuery, budget: StreamBudget,
              batches: Iterable[tuple[int, pd.DataFrame]], state_dir: str, sink: Sink, *,
              charge: Optional[Charge] = None, progress: Optional[Callable[[int], None]] = None,
              noise_key: Optional[bytes] = None, snapshot_every: Optional[int] = None,
              complete_window: bool = True) -> WindowState:
    """Run (or resume) the window in `state_dir` over `batches`, (step, micro-batch) pairs in
    increasing step order (steps without records may be left out). `charge()` charges the
    window's grant once and returns (grant id, block ids); None runs without a ledger (tests,
    benchmarks). `progress(step)` after each step. `noise_key`: tests only (fixed noise).
    `snapshot_every`: save the whole state every k steps instead of the default rule.
    `complete_window`: after the last batch, run the remaining steps up to T (a replayed
    window's end is known); False stops at the last batch given (a live stream that goes on).
    Returns the state after the last step run."""
    query.check()
    check_budget(query, budget)
    state = _open_state(query, budget, state_dir, noise_key)
    _charge_once(state, state_dir, charge)
    journal = _Journal(state_dir, state)
    replayed_since_save = 0
    last_step = 0

    def run(step: int, batch: pd.DataFrame) -> None:
        nonlocal replayed_since_save
        digest = batch_digest(batch)
        if step <= state.step:
            if digest != state.digests[step - 1]:
                raise StreamStateError(_changed(step, "was released"))
            return
        if step <= journal.committed:
            if digest != journal.digest(step):
                raise StreamStateError(_changed(step, "was released"))
            operator.step(state, budget, batch, digest)
            replayed_since_save += len(batch)
            return
        pending = read_pending(state_dir)
        if pending is not None and pending["step"] == step and pending["digest"] != digest:
            raise StreamStateError(_changed(step, "may have been released"))
        write_pending(state_dir, step, digest)
        sink(operator.step(state, budget, batch, digest))
        journal.commit(digest)
        replayed_since_save += len(batch)
        if step == query.micro_batches or (
                step % snapshot_every == 0 if snapshot_every else
                replayed_since_save >= _state_rows(state)):
            state.save(state_dir)
            journal.saved(step)
            replayed_since_save = 0
        clear_pending(state_dir)
        if progress is not None:
            progress(step)

    for step, batch in batches:
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or not (
                last_step < step <= query.micro_batches):
            raise QueryError(f"micro-batch steps must increase within 1..{query.micro_batches}; "
                             f"got {step!r} after {last_step}")
        for gap in range(last_step + 1, int(step)):
            run(gap, empty_batch())
        run(int(step), batch)
        last_step = int(step)
    if complete_window:
        for gap in range(last_step + 1, query.micro_batches + 1):
            run(gap, empty_batch())
    return state


def _changed(step: int, fate: str) -> str:
    return (f"micro-batch {step} changed after it {fate}: its records differ from the ones "
            "recorded; a second release of that step would differ by exactly the changed "
            "records. Replay the original input, or start a new window (new state directory "
            "and grant)")


class CsvDirectorySink:
    """One CSV per trigger (release-000001.csv: key, value, updated), written atomically, and
    the guarantee every release states in guarantee.txt."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"release-{step:06d}.csv")

    def __call__(self, release: operator.TriggerRelease) -> None:
        path = self.path(release.step)
        temporary = f"{path}.tmp-{os.getpid()}"
        release.to_frame().to_csv(temporary, index=False)
        os.replace(temporary, path)
        guarantee = os.path.join(self.directory, "guarantee.txt")
        if not os.path.exists(guarantee):
            with open(f"{guarantee}.tmp-{os.getpid()}", "w") as out:
                out.write(release.guarantee + "\n")
            os.replace(f"{guarantee}.tmp-{os.getpid()}", guarantee)
