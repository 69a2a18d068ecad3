"""The Beam engine of the DP-SQLP operator: the design's steps 1-7 (operator.py) as a streaming
pipeline for Flink or Dataflow, tested on the DirectRunner with a TestStream.

Input: a PCollection of :class:`StreamRecord` whose Beam timestamps are the records' event times.
The window's event-time range [start, end) is cut into T micro-batches of equal width; micro-batch
i ends at the public trigger time start + i * width (a function of the window only, never of the
data). Every stage acts at a trigger when an event-time timer set to that trigger's timestamp
fires, i.e. once the watermark says every record of the micro-batch has arrived. The per-key and
per-unit math is operator.py's (``clean_batch``, ``kept_mask``, ``select_and_predict``,
``released_values``, ``start_rounds``, ``tree_ids``), called with one unit's or one key's arrays,
so both engines release the same bits for the same noise key (the conformance test).

1. :class:`BoundUnitContributions`, keyed by unit: buffers the unit's records; at the trigger of
   a micro-batch it keeps the first (C - used) of them in (event time, input order), adds them to
   ``used`` and emits one :class:`PairBatch` per (unit, key, step). Its state also holds, for each
   key the unit has kept records of, the last step it did (at most C entries).
2. :class:`AggregateKeys`, keyed by key: sums the key's pair batches of a step into one
   :class:`KeyStep`, and announces a key seen for the first time with its first kept record.
3. :class:`AssignKeyCodes`, one global key: gives new keys dense codes in order of first
   appearance (step, event time, input order), as ``state.keys.encode`` does in operator.step.
   A key's noise streams are ``tree_ids(code, round)``, so the code must be injective; a hash
   of the key would let two keys share noise (a 56-bit stream id collides with probability
   ~ n^2 / 2^57 among n keys, not negligible against delta). This stage is the pipeline's one
   serial point; it sees each key once per window, not its records.
4. :class:`EvaluateKeys`, keyed by key: the key's round, origin, count, buffer, value tree and
   live selection tree. At a trigger with data, or at its predicted step ``due`` (Algorithm 4:
   an event-time timer set to that trigger, so a key without new records is never scanned),
   it runs selection, release and prediction, and emits a :class:`ReleaseUpdate` when selected.

Distinct users per (key, round) without a feedback edge: a unit counts once per (key, round);
the round lives in stage 4, the unit's history in stage 1. A unit was already counted in the
key's current round, which began after step ``origin``, iff it kept a record of the key at some
step in (origin, t), i.e. iff its previous step with the key (``PairBatch.previous_step``) is
> origin. Stage 4 therefore counts the pair batches with previous_step <= origin: the same
number as operator.step's PairTable (which stores the last counted round instead), no unit ids
past stage 1, and stage 1's extra state bounded by C per unit.

The output, ``ReleaseUpdate``s timestamped at their trigger, is the DP release: trigger t's
histogram is every key updated at or before t with its latest value (:func:`histograms`); an
unchanged key keeps its number (no fresh noise). Nothing else leaves the pipeline. The window's
grant must be charged before the pipeline starts (the caller's job, as for local.run_local).

Staggered stages: each stage acts on micro-batch t when the watermark reaches its own instant,
trigger + k ms for stage k (``MicroBatches.trigger_timestamp``). In Beam's model a timer holds
its DoFn's output watermark at the timer's output timestamp, so on runners that implement it
the stages run in order whatever the watermark does. Python's DirectRunner does not hold it: a
key's due timer (stage 4) could fire before the same trigger's records reach it from stage 1.
With staggering, the stages run in order there when the source's watermark steps through the 4
instants one at a time, as the tests' TestStream does (tests/support/continual_beam.py).

Source contract (part of the guarantee): the watermark must never pass a trigger time before
every record of the window with an earlier event time has been read (a replay of sealed ledger
blocks satisfies it). Stage 1 drops a record of a micro-batch it has already processed for that
unit, but Beam gives a DoFn no view of the watermark, so a source that breaks the contract can
put a late record into a step already released; and a watermark driven by the data would make
which records are late depend on other units.

Retries: every stage is a deterministic function of its state and its inputs (records sorted by
(step, event time, input order), sums of grid multiples exact in any order, keyed noise), so a
runner that retries a bundle from its last checkpoint recomputes the same releases bit for bit:
a duplicate release repeats the same numbers and never draws fresh noise (the Beam analogue of
local.py's durability; the state lives in the runner's checkpoints, not in a state directory).

Trust boundary: the runner sees the private data, as the local engine's process does; its
monitoring (element counts per stage, state sizes, per-key timings on Dataflow's or Flink's UI)
is not DP and must stay with the data's operators. The pipeline itself logs and counts nothing.

The noise key: given as bytes, it travels in the serialised pipeline (on Dataflow, the job graph
the service stores), so whoever can read the job can recompute the noise; given as a path, each
worker reads it in ``setup`` (a secret mounted on the workers, readable by the data's operators
only), and the job graph holds only the path. Either way every worker must use the same key.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Optional, Tuple, Union

import apache_beam as beam
import numpy as np
import pandas as pd
from apache_beam.coders import PickleCoder, VarIntCoder
from apache_beam.transforms import userstate, window
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.utils.timestamp import Timestamp

from sage_tfx.dp_statistics.continual import operator, sources
from sage_tfx.dp_statistics.identifiers import usable_ids
from sage_tfx.dp_statistics.continual.budget import StreamBudget
from sage_tfx.dp_statistics.continual.spec import StreamQuery
from sage_tfx.dp_statistics.continual.state import check_budget
from sage_tfx.dp_statistics.continual.tree import NEVER, TreeIndex
from sage_tfx.mechanisms.keyed import KeyedGaussian

# The narrowest micro-batch: the stages act within a few milliseconds after each trigger, before
# the next one.
MIN_WIDTH_SECONDS = 0.1
_NEW_KEYS = "new_keys"  # stage 2's tagged output to stage 3
STAGES = 4  # keyed stages, acting one after another at each trigger


class StreamRecord(NamedTuple):
    """One input record; its event time is the Beam element's timestamp. ``order`` is its
    position in the input (the public tie-break between records with the same event time)."""
    unit: Any
    key: Any
    value: Any  # cleaned by operator.clean_batch (ignored for COUNT)
    order: int


class PairBatch(NamedTuple):
    """Stage 1 -> 2: one unit's kept records of one key in micro-batch ``step``."""
    step: int
    value: float  # sum of the kept, cleaned values
    previous_step: int  # the unit's last earlier step with a kept record of the key; 0: none
    first: tuple  # (event time, input order) of the first of these records


class KeyStep(NamedTuple):
    """Stage 2 -> 4: a key's kept records of one step (pre-noise)."""
    step: int
    value: float
    previous_steps: tuple  # sorted (previous step, units) pairs: how many units had their
    # previous step with the key there (PairBatch.previous_step): at most T pairs however many
    # units contributed


class ReleaseUpdate(NamedTuple):
    """A key released at trigger ``step`` with its noisy ``value`` (DP output)."""
    step: int
    key: str
    value: float


@dataclass(frozen=True)
class MicroBatches:
    """A window (its blocks' event-time ranges, sources.Window) cut into T micro-batches: the
    micro-batch of an event time is sources.py's, the one local.py's input is cut by."""
    window: sources.Window
    count: int

    def __post_init__(self):
        start, end = self.window.start, self.window.end
        if not (math.isfinite(start) and math.isfinite(end) and end > start):
            raise ValueError(f"the window's range must be finite with end > start, got "
                             f"[{start}, {end})")
        if self.count < 1 or int(self.count) != self.count:
            raise ValueError(f"micro-batches must be a positive integer, got {self.count}")
        if self.width < MIN_WIDTH_SECONDS:
            raise ValueError(f"micro-batches of {self.width} s are narrower than "
                             f"{MIN_WIDTH_SECONDS} s (the stages act in the {STAGES} ms after "
                             "each trigger)")

    @property
    def start(self) -> float:
        return self.window.start

    @property
    def end(self) -> float:
        return self.window.end

    @property
    def width(self) -> float:
        return (self.end - self.start) / self.count

    def step_of(self, event_time: float) -> int:
        """The micro-batch (1..T) of an event time, 0 in no block of the window."""
        return int(self.window.micro_batch_of(np.array([event_time]), self.count)[0])

    def trigger_timestamp(self, step: int, stage: int = 0) -> Timestamp:
        """When ``stage`` (0..STAGES-1) acts on micro-batch ``step``: ``stage`` milliseconds
        after the trigger time rounded up to a millisecond (TestStream's resolution), so no
        record of the micro-batch is later (see "Staggered stages" in the module docstring)."""
        return Timestamp(micros=(math.ceil((self.start + step * self.width) * 1e3) + stage)
                         * 1000)

    @property
    def beam_window(self) -> window.FixedWindows:
        """One Beam window holding the whole range and every stage's last action (state lives
        for the window and is collected after it)."""
        return window.FixedWindows(self.end - self.start + 1.0, offset=self.start)


def _text(value) -> str:
    """Unit or key as stripped text ("" when missing), as sources.py reads them."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value).strip()


class _Wake:
    """The one event-time timer of a keyed stage, kept at the earliest step it must act on (a
    Beam timer holds one time per key; the state remembers which, since a timer cannot be read)."""

    @staticmethod
    def specs():
        """The (state, timer) specs; each DoFn class needs its own."""
        return (userstate.ReadModifyWriteStateSpec("wake_step", VarIntCoder()),
                userstate.TimerSpec("wake", TimeDomain.WATERMARK))

    def __init__(self, batches: MicroBatches, stage: int, state, timer):
        self._batches, self._stage, self._state, self._timer = batches, stage, state, timer

    def step(self) -> int:
        """The step the timer was set for (read from the state: a runner may report a fired
        timer's output timestamp rather than its firing time)."""
        return self._state.read()

    def request(self, step: int):
        current = self._state.read()
        if current is None or step < current:
            self._state.write(step)
            self._timer.set(self._batches.trigger_timestamp(step, self._stage))

    def fired(self, steps: Iterable[int]):
        """After acting: wake next at the earliest of ``steps`` (NEVER ones ignored)."""
        self._state.clear()
        upcoming = [s for s in steps if s != NEVER]
        if upcoming:
            self.request(min(upcoming))


def _take_due(bag, step: int, step_of) -> list:
    """The bag's elements of steps <= ``step`` (the rest stay in the bag)."""
    elements = list(bag.read())
    due = [e for e in elements if step_of(e) <= step]
    if due:
        bag.clear()
        for element in elements:
            if step_of(element) > step:
                bag.add(element)
    return due


@beam.typehints.with_output_types(Tuple[str, PairBatch])
class BoundUnitContributions(beam.DoFn):
    """Stage 1, keyed by unit: contribution bounding over the window (module docstring)."""
    BUFFER = userstate.BagStateSpec("records", PickleCoder())
    USED = userstate.ReadModifyWriteStateSpec("used", VarIntCoder())
    LAST_STEP = userstate.ReadModifyWriteStateSpec("last_step_by_key", PickleCoder())
    DONE = userstate.ReadModifyWriteStateSpec("processed_through", VarIntCoder())
    WAKE_STEP, WAKE = _Wake.specs()
    STAGE = 0

    def __init__(self, batches: MicroBatches, query: StreamQuery, budget: StreamBudget):
        self._batches, self._query, self._budget = batches, query, budget

    def process(self, element, timestamp=beam.DoFn.TimestampParam,
                buffer=beam.DoFn.StateParam(BUFFER), used=beam.DoFn.StateParam(USED),
                done=beam.DoFn.StateParam(DONE), wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        _, record = element
        step = self._batches.step_of(float(timestamp))
        if (used.read() or 0) >= self._query.contribution_limit or step <= (done.read() or 0):
            return  # at its bound, or late for a micro-batch already processed (see module)
        buffer.add((step, float(timestamp), record.order, record.key, record.value))
        _Wake(self._batches, self.STAGE, wake_step, wake).request(step)

    @userstate.on_timer(WAKE)
    def on_wake(self, unit=beam.DoFn.KeyParam,
                buffer=beam.DoFn.StateParam(BUFFER), used=beam.DoFn.StateParam(USED),
                last_step=beam.DoFn.StateParam(LAST_STEP), done=beam.DoFn.StateParam(DONE),
                wake_step=beam.DoFn.StateParam(WAKE_STEP), wake=beam.DoFn.TimerParam(WAKE)):
        alarm = _Wake(self._batches, self.STAGE, wake_step, wake)
        step = alarm.step()
        due = sorted(_take_due(buffer, step, lambda r: r[0]))  # (step, event time, order)
        done.write(step)
        count = used.read() or 0
        grid, bound = self._budget.record_grid
        _, keys, values = operator.clean_batch(
            pd.DataFrame({"unit": [unit] * len(due), "key": [r[3] for r in due],
                          "value": [r[4] for r in due]}), self._query.statistic, grid, bound)
        keep = operator.kept_mask(np.zeros(len(due), np.int64), np.array([count]),
                                  self._query.contribution_limit)
        count += int(keep.sum())
        used.write(count)
        if count >= self._query.contribution_limit:
            buffer.clear()  # nothing later can be kept
        alarm.fired(r[0] for r in buffer.read())

        previous = last_step.read() or {}
        batches: dict = {}
        for record, key, value, kept in zip(due, keys, values, keep):
            if not kept:
                continue
            total, first = batches.get(key, (0.0, (record[1], record[2])))
            batches[key] = (total + value, first)
        for key, (total, first) in batches.items():
            yield key, PairBatch(step, float(total), previous.get(key, 0), first)
            previous[key] = step
        if batches:
            last_step.write(previous)


@beam.typehints.with_output_types(Tuple[str, KeyStep])
class AggregateKeys(beam.DoFn):
    """Stage 2, keyed by key: a step's pair batches as one KeyStep; a key's first appearance
    (step, event time, input order of its first kept record) to the ``new_keys`` output."""
    BUFFER = userstate.BagStateSpec("pair_batches", PickleCoder())
    SEEN = userstate.ReadModifyWriteStateSpec("seen", VarIntCoder())
    WAKE_STEP, WAKE = _Wake.specs()
    STAGE = 1

    def __init__(self, batches: MicroBatches):
        self._batches = batches

    def process(self, element, buffer=beam.DoFn.StateParam(BUFFER),
                wake_step=beam.DoFn.StateParam(WAKE_STEP), wake=beam.DoFn.TimerParam(WAKE)):
        _, batch = element
        buffer.add(batch)
        _Wake(self._batches, self.STAGE, wake_step, wake).request(batch.step)

    @userstate.on_timer(WAKE)
    def on_wake(self, key=beam.DoFn.KeyParam,
                buffer=beam.DoFn.StateParam(BUFFER), seen=beam.DoFn.StateParam(SEEN),
                wake_step=beam.DoFn.StateParam(WAKE_STEP), wake=beam.DoFn.TimerParam(WAKE)):
        alarm = _Wake(self._batches, self.STAGE, wake_step, wake)
        step = alarm.step()
        due = _take_due(buffer, step, lambda b: b.step)
        alarm.fired(b.step for b in buffer.read())
        if not due:
            return
        if not seen.read():
            seen.write(1)
            yield beam.pvalue.TaggedOutput(_NEW_KEYS, (step, min(b.first for b in due), key))
        yield key, KeyStep(step, float(sum(b.value for b in due)),
                           tuple(sorted(Counter(b.previous_step for b in due).items())))


@beam.typehints.with_output_types(Tuple[str, int])
class AssignKeyCodes(beam.DoFn):
    """Stage 3, one global key: dense key codes in order of first appearance (module
    docstring); it holds the next code and the keys announced for steps not yet triggered."""
    BUFFER = userstate.BagStateSpec("new_keys", PickleCoder())
    NEXT = userstate.ReadModifyWriteStateSpec("next_code", VarIntCoder())
    WAKE_STEP, WAKE = _Wake.specs()
    STAGE = 2

    def __init__(self, batches: MicroBatches):
        self._batches = batches

    def process(self, element, buffer=beam.DoFn.StateParam(BUFFER),
                wake_step=beam.DoFn.StateParam(WAKE_STEP), wake=beam.DoFn.TimerParam(WAKE)):
        _, announced = element
        buffer.add(announced)
        _Wake(self._batches, self.STAGE, wake_step, wake).request(announced[0])

    @userstate.on_timer(WAKE)
    def on_wake(self, buffer=beam.DoFn.StateParam(BUFFER),
                next_code=beam.DoFn.StateParam(NEXT), wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        alarm = _Wake(self._batches, self.STAGE, wake_step, wake)
        step = alarm.step()
        due = sorted(_take_due(buffer, step, lambda a: a[0]))
        alarm.fired(a[0] for a in buffer.read())
        code = next_code.read() or 0
        for _, _, key in due:
            yield key, code
            code += 1
        next_code.write(code)


NoiseKey = Union[bytes, str]  # the 32-byte noise key, or a path the workers read it from


def _read_noise_key(noise_key: NoiseKey) -> bytes:
    """The key's bytes; a path is read on the worker (setup), so the key need not travel in the
    job graph (module docstring)."""
    if isinstance(noise_key, bytes):
        return noise_key
    try:
        with open(noise_key, "rb") as file:
            key = file.read()
    except OSError as error:
        raise ValueError(f"the noise key file {noise_key} cannot be read: {error}") from None
    KeyedGaussian(key)  # refuses a file that is not 32 bytes
    return key


@dataclass
class _KeyState:
    """Stage 4's state of one key: operator.step's per-key columns, with its live selection
    tree and its value tree as one-row TreeIndex arrays (to_arrays: a growable TreeIndex
    reserves 1024 rows, too much to store per key)."""
    code: int
    selection: dict
    round: int = 1
    origin: int = 0
    count: int = 0
    buffer: float = 0.0
    released_true: float = 0.0
    values: Optional[dict] = None
    evaluated: int = 0  # the last step the key was evaluated at
    due: int = NEVER  # its predicted next release without new data


@beam.typehints.with_output_types(ReleaseUpdate)
class EvaluateKeys(beam.DoFn):
    """Stage 4, keyed by key: design steps 2-7 for one key (module docstring)."""
    STEPS = userstate.BagStateSpec("key_steps", PickleCoder())
    CODE = userstate.ReadModifyWriteStateSpec("code", VarIntCoder())
    KEY = userstate.ReadModifyWriteStateSpec("key_state", PickleCoder())
    WAKE_STEP, WAKE = _Wake.specs()
    STAGE = 3

    def __init__(self, batches: MicroBatches, budget: StreamBudget, noise_key: NoiseKey):
        self._batches, self._budget, self._noise_key = batches, budget, noise_key

    def setup(self):
        self._noise = KeyedGaussian(_read_noise_key(self._noise_key))

    def process(self, element, steps=beam.DoFn.StateParam(STEPS),
                code=beam.DoFn.StateParam(CODE), wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        _, (kind, payload) = element
        if kind == "code":
            code.write(payload)
            return
        steps.add(payload)
        _Wake(self._batches, self.STAGE, wake_step, wake).request(payload.step)

    def _tree(self, arrays: Optional[dict], selection: bool) -> TreeIndex:
        """A key's one-row tree index from its stored arrays (None: an empty index)."""
        return self._budget.index(selection, arrays)

    def _new_round(self, code: int, round_: int, step: int) -> tuple[dict, int]:
        """The tree arrays of the key's selection round ``round_`` begun after ``step`` and its
        predicted release step with no data (round 1: origin 0, predicted by the caller)."""
        selection = self._tree(None, selection=True)
        if step == 0:
            selection.add(self._noise, operator.tree_ids([code], [round_], self._batches.count),
                          [self._batches.count])
            return selection.to_arrays(), NEVER
        _, due = operator.start_rounds(selection, self._noise, [code], [round_], step,
                                       self._batches.count)
        return selection.to_arrays(), int(due[0])

    @userstate.on_timer(WAKE)
    def on_wake(self, key=beam.DoFn.KeyParam,
                steps=beam.DoFn.StateParam(STEPS), code=beam.DoFn.StateParam(CODE),
                key_state=beam.DoFn.StateParam(KEY),
                wake_step=beam.DoFn.StateParam(WAKE_STEP), wake=beam.DoFn.TimerParam(WAKE)):
        alarm = _Wake(self._batches, self.STAGE, wake_step, wake)
        t = alarm.step()
        due = _take_due(steps, t, lambda s: s.step)
        state = key_state.read()
        if state is not None and t <= state.evaluated:
            # Records that reached the key after it was evaluated at their step or later (a
            # source or runner that broke the order the module docstring describes): dropped,
            # so that no tree leaf is ever evaluated twice or out of order.
            alarm.fired([state.due] + [s.step for s in steps.read()])
            return
        if state is None:
            if code.read() is None:
                raise RuntimeError(f"key code missing at step {t}: the runner ran stage 4 "
                                   "before stage 3 at the same trigger (see Staggered stages)")
            state = _KeyState(code.read(), self._new_round(code.read(), 1, 0)[0])
        for data in due:
            state.buffer += data.value
            state.count += sum(units for previous, units in data.previous_steps
                               if previous <= state.origin)
        noise, budget, length = self._noise, self._budget, self._batches.count
        selected, predicted = operator.select_and_predict(
            self._tree(state.selection, selection=True), noise, np.array([0]),
            np.array([state.origin]), t, np.array([state.count]))
        next_due = int(predicted[0])
        final_pane = state.values is not None and t == length
        if selected[0] or final_pane:
            values = self._tree(state.values, selection=False)
            if state.values is None:
                values.add(noise, operator.tree_ids([state.code], [0], length), [length])
            state.released_true += state.buffer
            state.buffer = 0.0
            grid, _ = budget.record_grid
            released = operator.released_values(values, noise, np.array([0]), t,
                                                np.array([state.released_true]), grid)
            # After the release: a factorization stream's cursor moved to t (the next release
            # continues from it rather than replaying the noise from step 0).
            state.values = values.to_arrays()
            yield ReleaseUpdate(t, key, float(released[0]))
        if selected[0]:
            state.count, state.origin = 0, t
            state.round += 1
            state.selection, next_due = self._new_round(state.code, state.round, t)
        next_due = int(operator.next_evaluation(
            np.array([next_due]), np.array([state.values is not None]), t, length)[0])
        state.evaluated, state.due = t, next_due
        key_state.write(state)
        alarm.fired([next_due] + [s.step for s in steps.read()])


@beam.typehints.with_output_types(Tuple[str, StreamRecord])
class Prepare(beam.DoFn):
    """Drops records without a usable unit or key (identifiers.usable_ids: not empty, no NUL, at
    most 1024 bytes), or outside the window (each a function of the record alone), and keys the
    rest by unit."""

    def __init__(self, batches: MicroBatches):
        self._batches = batches

    def process(self, record: StreamRecord, timestamp=beam.DoFn.TimestampParam):
        unit, key = _text(record.unit), _text(record.key)
        if self._batches.step_of(float(timestamp)) and usable_ids(
                np.array([unit, key], dtype=object)).all():
            yield unit, record._replace(unit=unit, key=key)


class AggregateContributions(beam.PTransform):
    """StreamRecords (event-time timestamps) -> (KeySteps keyed by key, new keys): stages 1-2,
    the pre-noise aggregates. Private data: its only consumer is :class:`ReleaseKeys`."""

    def __init__(self, query: StreamQuery, budget: StreamBudget, batches: MicroBatches):
        super().__init__()
        query.check()
        check_budget(query, budget)
        if batches.count != query.micro_batches:
            raise ValueError(f"the window has {batches.count} micro-batches, the query "
                             f"{query.micro_batches}")
        self._query, self._budget, self._batches = query, budget, batches

    def expand(self, records):
        if records.is_bounded:
            # Batch runners fire timers with other window and state semantics (on the
            # FnApiRunner this pipeline released nothing): refused at construction, before a
            # caller runs it (and charges for it).
            raise ValueError("the continual-release pipeline runs in streaming mode on an "
                             "unbounded source (a TestStream on the DirectRunner); got a "
                             "bounded PCollection")
        batches = self._batches
        outputs = (
            records
            | "Prepare" >> beam.ParDo(Prepare(batches))
            | "Window" >> beam.WindowInto(batches.beam_window)
            | "BoundUnits" >> beam.ParDo(BoundUnitContributions(batches, self._query,
                                                                self._budget))
            | "AggregateKeys" >> beam.ParDo(AggregateKeys(batches)).with_outputs(
                _NEW_KEYS, main="steps"))
        return outputs.steps, outputs[_NEW_KEYS]


class ReleaseKeys(beam.PTransform):
    """AggregateContributions' output -> ReleaseUpdates: stages 3-4, with the secret noise key
    (``NoiseKey``: its 32 bytes, KeyedGaussian.fresh().key, or a path to them)."""

    def __init__(self, budget: StreamBudget, batches: MicroBatches, noise_key: NoiseKey):
        super().__init__()
        if isinstance(noise_key, (bytes, bytearray)):
            KeyedGaussian(noise_key)  # refuses a key that is not 32 bytes
            noise_key = bytes(noise_key)
        elif not isinstance(noise_key, str):
            raise TypeError(f"the noise key is 32 bytes or a path to them, got "
                            f"{type(noise_key).__name__}")
        self._budget, self._batches, self._noise_key = budget, batches, noise_key

    def expand(self, aggregated):
        key_steps, new_keys = aggregated
        batches = self._batches
        codes = (new_keys
                 | "OneKey" >> beam.Map(lambda a: ("", a)).with_output_types(Tuple[str, Any])
                 | "AssignKeyCodes" >> beam.ParDo(AssignKeyCodes(batches)))
        tagged = Tuple[str, Tuple[str, Any]]
        return (
            (key_steps | "TagSteps" >> beam.Map(
                lambda e: (e[0], ("step", e[1]))).with_output_types(tagged),
             codes | "TagCodes" >> beam.Map(
                 lambda e: (e[0], ("code", e[1]))).with_output_types(tagged))
            | "Join" >> beam.Flatten()
            | "EvaluateKeys" >> beam.ParDo(EvaluateKeys(batches, self._budget,
                                                        self._noise_key)))


class ContinualReleaseTransform(beam.PTransform):
    """StreamRecords (event-time timestamps) -> ReleaseUpdates: one window of ``query`` at
    ``budget`` (its grant charged by the caller before the pipeline runs), with the secret
    ``noise_key``."""

    def __init__(self, query: StreamQuery, budget: StreamBudget, batches: MicroBatches,
                 noise_key: NoiseKey):
        super().__init__()
        self._aggregate = AggregateContributions(query, budget, batches)
        self._release = ReleaseKeys(budget, batches, noise_key)

    def expand(self, records):
        return records | "Aggregate" >> self._aggregate | "Release" >> self._release


def histograms(updates: Iterable[ReleaseUpdate], micro_batches: int) -> list[dict]:
    """Trigger t's release (index t - 1): every key updated at or before t, latest value."""
    by_step: dict = {}
    for update in updates:
        by_step.setdefault(update.step, []).append(update)
    released: dict = {}
    out = []
    for step in range(1, micro_batches + 1):
        released.update({u.key: u.value for u in by_step.get(step, [])})
        out.append(dict(released))
    return out
