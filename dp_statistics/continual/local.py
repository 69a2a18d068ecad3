"""The in-process engine: replays a window's micro-batches through operator.step, durably.

``run_local(query, budget, batches, state_dir, sink)`` runs every trigger 1..T of one window,
writes one release per trigger through ``sink`` and commits after each step, so a crash or a
restart resumes with no micro-batch counted twice, no release repeated with fresh noise and no
second charge (the design's "Durability" section):

- the first run draws the noise key, saves the state (step 0), marks the charge as started,
  charges the grant (``charge()``) and saves its id: a restart never charges again (and refuses,
  rather than charge twice, if it died between marking and saving the grant; a ledger refusal,
  a sage_access LedgerError, charged nothing and clears the mark);
- step t first *takes* its micro-batch: writes it to the state directory (state.Journal,
  synced), then computes it, ``sink(release t)``, and appends {commit: t} to the journal.
  With ``take_ahead`` k > 1 (an input that already holds its micro-batches: a replay) the next
  k steps are taken together, one write and one sync, and then computed one by one: the sync
  is the durability guarantee (no release is written before its micro-batch is on the disk)
  and costs 0.4-4 ms on this machine's disk, as much as computing a small micro-batch, so a
  replay pays it once per k steps. Which steps are taken together is a function of the step
  numbers alone (the groups of k from the first step a run computes), never of the data;
- the whole state is saved (``state.npz``, atomic rename; the journal and the taken
  micro-batches then start afresh) on a public schedule, every ceil(T / 16) steps and at the
  last (``save_steps``): at most 17 saves, and a restart recomputes at most T / 16 steps and
  those run while a save was being written (a thread writes it: ``_OverlappedSaves`` says why
  a crash at any point still resumes exactly). The
  schedule must not depend on the data: the saved step is where a resumed run's progress bar
  starts (an earlier rule, "records since the save >= rows of state", showed a data-dependent
  number).

Lateness (what a restart does with its input): a step this state has taken is never computed
from anything but the micro-batch it took. Steps up to the saved state's are skipped; a taken
step after it (committed, or taken and maybe released when the last run stopped) is recomputed
from its taken micro-batch, without releasing it again if it was committed (keyed noise: the
same state and release bit for bit); only the steps after those are read from the input. So
records the input brings for a step already taken are late data and are dropped, as a
streaming system drops data past its allowed lateness (here: a micro-batch closes when its
step is taken), and the published releases stay the ones already published. A restart never
compares its input with what was taken: an earlier version refused "micro-batch 3 changed after
it was released", and that refusal told where a late record fell (a data-dependent exit).

Trigger times are public: a step the stream has no records for still runs (empty micro-batch),
so keys predicted to cross there are released.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import os
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import pandas as pd

from sage_tfx.dp_statistics.aggregation.spec import QueryError
from sage_tfx.dp_statistics.continual import operator
from sage_tfx.dp_statistics.continual.budget import StreamBudget
from sage_tfx.dp_statistics.continual.spec import StreamQuery
from sage_tfx.dp_statistics.continual.state import (Journal, StreamStateError, WindowState,
                                                    check_budget, write_state)
from sage_tfx.mechanisms.keyed import KeyedGaussian
from sage_tfx.sage_access.errors import LedgerError

Sink = Callable[[operator.TriggerRelease], None]
Charge = Callable[[], tuple[str, Sequence[str]]]  # -> (grant id, block ids)


def empty_batch() -> pd.DataFrame:
    return pd.DataFrame({"unit": pd.Series([], dtype=object), "key": pd.Series([], dtype=object),
                         "value": pd.Series([], dtype=np.float64)})


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
    try:
        grant_id, blocks = charge()
    except LedgerError:
        # The ledger's errors are all-or-nothing (sage_access.errors): nothing was charged, so
        # the same window may try again.
        state.charge_started = False
        state.save(state_dir)
        raise
    state.grant_id, state.blocks = str(grant_id), tuple(str(b) for b in blocks)
    state.save(state_dir)


SAVES_PER_WINDOW = 16
# take_ahead for a replay (an input that holds all its micro-batches): one sync per 32 steps
# instead of per step, and at most 32 micro-batches held at once.
REPLAY_TAKE_AHEAD = 32


def save_steps(micro_batches: int) -> int:
    """The public save schedule: every this many steps (and at the last)."""
    return -(-micro_batches // SAVES_PER_WINDOW)


class _OverlappedSaves:
    """The scheduled saves, written by a thread while the next steps run.

    A save at step s copies the state (WindowState.snapshot: 22 MB, a few ms, at 20,000 keys
    and T = 1,000) and a thread writes it atomically (state.write_state: write, fsync, rename,
    directory fsync: 20-40 ms, mostly waiting for the disk, as long as several steps). The
    journal is started from s (Journal.saved: it drops the taken micro-batches <= s) on this
    thread once the write is done: seen before a later step, at the next save, or when the run
    stops, whichever comes first. What a crash leaves is one of the states the synchronous
    save left, or one more:
    - before the rename: the previous state.npz and a journal from it with every entry since:
      the restart resumes from the previous save (as if the crash came before step s);
    - after the rename, before `saved`: state.npz at s and the journal of the previous save,
      whose commit lines (steps released, possibly after s) and taken entries (every step after
      the previous save) Journal reads: the restart recomputes the steps after s from what
      they took and releases none of the committed ones again.
    Which steps are saved is the public schedule, as before; only when the journal catches up
    depends on the disk's speed, like every other duration of a run. The last step's save is
    waited for: the run returns its state on the disk."""

    def __init__(self, state_dir: str, journal: Journal):
        self.state_dir, self.journal = state_dir, journal
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="state-save")
        self._pending: Optional[tuple[int, concurrent.futures.Future]] = None

    def start(self, state: WindowState) -> None:
        """Save `state` (at its step) in the background, after the pending save."""
        self.finish()
        self._pending = (state.step, self._pool.submit(write_state, self.state_dir,
                                                       state.snapshot()))

    def catch_up(self) -> None:
        """Start the journal from the pending save if it is written (never waits)."""
        if self._pending is not None and self._pending[1].done():
            self.finish()

    def finish(self) -> None:
        """Wait for the pending save (its error, if any, is raised here) and start the journal
        from it."""
        if self._pending is not None:
            step, written = self._pending
            self._pending = None
            written.result()
            self.journal.saved(step)

    def close(self) -> None:
        try:
            self.finish()
        finally:
            self._pool.shutdown()


def run_local(query: StreamQuery, budget: StreamBudget,
              batches: Iterable[tuple[int, pd.DataFrame]], state_dir: str, sink: Sink, *,
              charge: Optional[Charge] = None, progress: Optional[Callable[[int], None]] = None,
              noise_key: Optional[bytes] = None, snapshot_every: Optional[int] = None,
              complete_window: bool = True, fsync: bool = True, take_ahead: int = 1,
              granted: Optional[Callable[[str], None]] = None) -> WindowState:
    """Run (or resume) the window in `state_dir` over `batches`, (step, micro-batch) pairs in
    increasing step order (steps without records may be left out). `charge()` charges the
    window's grant once and returns (grant id, block ids); None runs without a ledger (tests,
    benchmarks). `progress(step)` after each step. `noise_key`: tests only (fixed noise).
    `snapshot_every`: save the whole state every k steps instead of every save_steps(T).
    `complete_window`: after the last batch, run the remaining steps up to T (a replayed
    window's end is known); False stops at the last batch given (a live stream that goes on).
    `fsync`: each step's taken micro-batch reaches the disk before its release is written
    (False survives a crash of the process, not a power cut; state.Journal).
    `take_ahead`: how many micro-batches to read from `batches` and take (with one sync)
    before computing the first of them; more than 1 only when the input already holds them (a
    replay: reading ahead of a live source would hold back each release until the next
    micro-batches arrive). A batch given for a step this state already took is late data,
    dropped (module docstring).
    `granted(grant id)` once the window's grant is recorded in the state (charged now or
    before), before the first step (release.py pins the run's triggers there).
    Returns the state after the last step run."""
    query.check()
    check_budget(query, budget)
    if isinstance(take_ahead, bool) or not isinstance(take_ahead, int) or take_ahead < 1:
        raise QueryError(f"take_ahead must be a positive integer, got {take_ahead!r}")
    state = _open_state(query, budget, state_dir, noise_key)
    _charge_once(state, state_dir, charge)
    if granted is not None and state.grant_id is not None:
        granted(state.grant_id)
    journal = Journal(state_dir, state, fsync)
    saves = _OverlappedSaves(state_dir, journal)
    every = snapshot_every or save_steps(query.micro_batches)

    def every_step() -> Iterator[tuple[int, pd.DataFrame]]:
        """(step, micro-batch) for each step from the first given (or after the saved state)
        on, the steps the input leaves out as empty micro-batches."""
        last_step = 0
        for step, batch in batches:
            if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or (
                    not last_step < step <= query.micro_batches):
                raise QueryError(f"micro-batch steps must increase within "
                                 f"1..{query.micro_batches}; got {step!r} after {last_step}")
            # Steps up to the saved state's are done: a live stream's next run (the
            # ContinualRelease component) gives only the micro-batches after it.
            for gap in range(max(last_step, state.step) + 1, int(step)):
                yield gap, empty_batch()
            yield int(step), batch
            last_step = int(step)
        if complete_window:
            for gap in range(last_step + 1, query.micro_batches + 1):
                yield gap, empty_batch()

    def run(step: int, batch: pd.DataFrame) -> None:
        if state.step != step - 1:  # an invariant: the operator computes state.step + 1
            raise StreamStateError(f"step {step} after a state at step {state.step}")
        saves.catch_up()
        release = operator.step(state, budget, batch)
        if step <= journal.committed:
            return  # released before, and recomputed here bit for bit: not written again
        sink(release)
        journal.commit(step)
        if step == query.micro_batches or step % every == 0:
            saves.start(state)
            if step == query.micro_batches:
                saves.finish()
        if progress is not None:
            progress(step)

    steps = every_step()
    try:
        while True:
            # The next `take_ahead` steps (a public schedule: a function of the steps alone).
            # An input error after some of them is raised once those have run, as it would
            # have been without reading ahead.
            group, read, error = [], 0, None
            try:
                for step, batch in itertools.islice(steps, take_ahead):
                    read += 1
                    if step > state.step:  # else in the saved state: the records are late
                        group.append((step, batch))
            except Exception as raised:  # noqa: BLE001 - re-raised below
                error = raised
            # A step this state took is computed from what it took (the given records are
            # late, dropped); the others are taken, all with one sync, before any is computed.
            taken = {step: journal.taken(step) for step, _ in group}
            journal.take([(step, batch) for step, batch in group if taken[step] is None])
            for step, batch in group:
                run(step, batch if taken[step] is None else taken[step])
            if error is not None:
                raise error
            if read < take_ahead:
                break
    finally:
        try:
            saves.close()
        finally:
            journal.close()
    return state


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
