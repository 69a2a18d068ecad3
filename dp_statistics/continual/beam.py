"""The Beam engine of the DP-SQLP operator: the design's steps 1-7 (operator.py) as a streaming
pipeline for Flink or Dataflow, tested on the DirectRunner with a TestStream.

Input: a PCollection of :class:`StreamRecord` (one record each) or :class:`RecordBatch` (many
records as columns, each with its event time) whose Beam timestamps are event times. The
window's event-time range [start, end) is cut into T micro-batches of equal width; micro-batch
i ends at the public trigger time start + i * width (a function of the window only, never of the
data). Every stage acts at a trigger when an event-time timer set to that trigger's timestamp
fires, i.e. once the watermark says every record of the micro-batch has arrived.

Batches and shards. Records travel as numpy columns, never one element per record: stage 0
turns each bundle (and each RecordBatch) into one batch per (unit shard, micro-batch), and every
keyed stage is keyed by a *shard* (a public function of the unit's or key's text alone, ``shard_of``:
SipHash of its UTF-8 bytes modulo ``shards``) and holds the tables of all its units or keys, so
the unit shuffle carries at most one batch per (input bundle or RecordBatch, unit shard, step),
the key shuffle one per (step, unit shard, key shard), and each stage runs the local engine's
vectorised kernels over a shard's arrays (operator.py: ``clean_batch``,
``bound_contributions``, ``first_rounds``, ``evaluate_keys``, ``tree_ids``), the same calls
``operator.step`` makes over the whole window. Rows are independent in those kernels (a unit's
bound reads only its own count, a key's trees only its own noise streams, tree_ids(code, round)),
so how units and keys are split into shards changes no bit: both engines release the same bits
for the same noise key (the conformance tests), whatever ``shards``. The shuffles stay Beam
shuffles keyed by unit shard, then key shard: nothing is gathered to one worker but stage 3's
new keys.

0. :class:`BatchByUnitShard`: drops records without a usable unit or key or outside the window
   (each a function of the record alone) and groups the rest by (unit shard, step).
1. :class:`BoundUnitContributions`, keyed by unit shard: buffers its batches; at the trigger of
   a micro-batch it sorts them in (event time, input order), keeps each unit's first (C - used)
   records (``bound_contributions``) and emits, per key shard, one :class:`KeyContributions`:
   per key the sum of the kept values, the (event time, input order) of its first kept record
   and, per previous step, how many units kept a record of it (below). Its state also holds, per
   (unit, key) with a kept record, the last step the unit kept one (at most C per unit).
2. :class:`AggregateKeys`, keyed by key shard: sums a step's KeyContributions into one
   :class:`KeyStep` and announces the keys seen for the first time with their first kept record.
3. :class:`AssignKeyCodes`, one global key: gives new keys dense codes in order of first
   appearance (step, event time, input order), as ``state.keys.encode`` does in operator.step.
   A key's noise streams are ``tree_ids(code, round)``, so the code must be injective; a hash
   of the key would let two keys share noise (a 56-bit stream id collides with probability
   ~ n^2 / 2^57 among n keys, not negligible against delta). This stage is the pipeline's one
   serial point; it sees each key once per window (one batch per step), not its records.
4. :class:`EvaluateKeys`, keyed by key shard: the per-key columns and trees of its keys
   (state.KEY_COLUMNS, each key's global code beside). At a trigger with data, or at the
   earliest predicted step ``due`` of its keys (Algorithm 4: an event-time timer set to that
   trigger, so a shard whose keys have no new records and none due is never woken), it
   evaluates the keys with records or due there (``evaluate_keys``) and emits a
   :class:`ReleaseUpdate` per key released.

Distinct users per (key, round) without a feedback edge: a unit counts once per (key, round);
the round lives in stage 4, the unit's history in stage 1. A unit was already counted in the
key's current round, which began after step ``origin``, iff it kept a record of the key at some
step in (origin, t), i.e. iff its previous step with the key (``previous_steps``) is > origin.
Stage 4 therefore counts the units with previous step <= origin: the same number as
operator.step's PairTable (which stores the last counted round instead), no unit ids past stage
1, and stage 1's extra state bounded by C per unit.

The output, ``ReleaseUpdate``s timestamped at their trigger, is the DP release: trigger t's
histogram is every key updated at or before t with its latest value (:func:`histograms`); an
unchanged key keeps its number (no fresh noise). Nothing else leaves the pipeline. The window's
grant must be charged before the pipeline starts (the caller's job, as for local.run_local).

Staggered stages: each stage acts on micro-batch t when the watermark reaches its own instant,
trigger + k ms for stage k (``MicroBatches.trigger_timestamp``). In Beam's model a timer holds
its DoFn's output watermark at the timer's output timestamp, so on runners that implement it
the stages run in order whatever the watermark does. Python's DirectRunner does not hold it: a
shard's due timer (stage 4) could fire before the same trigger's records reach it from stage 1.
With staggering, the stages run in order there when the source's watermark steps through the 4
instants one at a time, as the tests' TestStream does (tests/support/continual_beam.py).

Source contract (part of the guarantee): the watermark must never pass a trigger time before
every record of the window with an earlier event time has been read (a replay of sealed ledger
blocks satisfies it), and a RecordBatch's timestamp is at most its earliest event time. Stage 1
drops a record of a micro-batch its shard has already processed, but Beam gives a DoFn no view
of the watermark, so a source that breaks the contract can put a late record into a step already
released; and a watermark driven by the data would make which records are late depend on other
units. ``order`` (a record's position in the input) must be distinct across the input: it is
the public tie-break between records with the same event time.

Retries: every stage is a deterministic function of its state and its inputs (records sorted by
(step, event time, input order), sums of grid multiples exact in any order, keyed noise), so a
runner that retries a bundle from its last checkpoint recomputes the same releases bit for bit:
a duplicate release repeats the same numbers and never draws fresh noise (the Beam analogue of
local.py's durability; the state lives in the runner's checkpoints, not in a state directory).

State cost: a shard's tables are one state value, read and written (encoded, on a runner that
encodes state) each time the shard acts: O(units or keys of the shard) per step it has data, on
top of O(records). ``shards`` trades that against elements and timers per step (at most
``shards`` per stage and step): a few per worker keep every worker busy; more make each shard's
state smaller.

Trust boundary: the runner sees the private data, as the local engine's process does; its
monitoring (element counts per stage, state sizes, per-shard timings on Dataflow's or Flink's
UI) is not DP and must stay with the data's operators. The pipeline itself logs and counts
nothing.

The noise key: given as bytes, it travels in the serialised pipeline (on Dataflow, the job graph
the service stores), so whoever can read the job can recompute the noise; given as a path, each
worker reads it in ``setup`` (a secret mounted on the workers, readable by the data's operators
only), and the job graph holds only the path. Either way every worker must use the same key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, NamedTuple, Tuple, Union

import apache_beam as beam
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from apache_beam.coders import PickleCoder, VarIntCoder
from apache_beam.transforms import userstate, window
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from sage_tfx.dp_statistics.continual import operator, sources
from sage_tfx.dp_statistics.identifiers import usable_ids
from sage_tfx.dp_statistics.continual.budget import StreamBudget
from sage_tfx.dp_statistics.continual.spec import StreamQuery
from sage_tfx.dp_statistics.continual.state import (CodeTable, PairTable, check_budget,
                                                    grown_key_columns, key_columns, sorted_unique)
from sage_tfx.dp_statistics.continual.tree import NEVER, TreeIndex
from sage_tfx.mechanisms.keyed import KeyedGaussian

# The narrowest micro-batch: the stages act within a few milliseconds after each trigger, before
# the next one.
MIN_WIDTH_SECONDS = 0.1
_NEW_KEYS = "new_keys"  # stage 2's tagged output to stage 3
STAGES = 4  # keyed stages, acting one after another at each trigger
DEFAULT_SHARDS = 8  # unit and key shards (module docstring: "State cost")
Sharded = Tuple[int, Any]  # (shard, batch): the shard is VarInt-coded, deterministic


class StreamRecord(NamedTuple):
    """One input record; its event time is the Beam element's timestamp. ``order`` is its
    position in the input (the public tie-break between records with the same event time)."""
    unit: Any
    key: Any
    value: Any  # cleaned by operator.clean_batch (ignored for COUNT)
    order: int


class RecordBatch(NamedTuple):
    """Records as columns of equal length (one element for many records; a source that reads
    blocks emits these): unit, key, value (numbers, or text read cell by cell; ignored
    for COUNT), event time in seconds, and input order (distinct across the input). Its Beam
    timestamp must not be later than its earliest event time."""
    units: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    times: np.ndarray
    orders: np.ndarray

    @classmethod
    def of(cls, units, keys, values, times, orders) -> "RecordBatch":
        return cls(np.asarray(units, dtype=object), np.asarray(keys, dtype=object),
                   np.asarray(values), np.asarray(times, dtype=np.float64),
                   np.asarray(orders, dtype=np.int64))

    def take(self, index: np.ndarray) -> "RecordBatch":
        return RecordBatch(*(column[index] for column in self))

    @classmethod
    def concat(cls, batches: list["RecordBatch"]) -> "RecordBatch":
        return cls(*(np.concatenate(columns) for columns in zip(*batches)))


class KeyContributions(NamedTuple):
    """Stage 1 -> 2: one unit shard's kept records of one step for the keys of one key shard."""
    step: int
    keys: np.ndarray  # distinct key texts
    values: np.ndarray  # per key, the sum of the kept, cleaned values
    first_times: np.ndarray  # per key, (event time, input order) of its first kept record
    first_orders: np.ndarray
    previous: "PreviousSteps"


class PreviousSteps(NamedTuple):
    """How many units had their previous step with a key at each step (0: none): rows of
    (index into the batch's keys, previous step, units); at most T rows per key however many
    units contributed."""
    key_index: np.ndarray
    steps: np.ndarray
    units: np.ndarray


class KeyStep(NamedTuple):
    """Stage 2 -> 4: one key shard's kept records of one step (pre-noise), per key."""
    step: int
    keys: np.ndarray
    values: np.ndarray
    previous: PreviousSteps


class NewKeys(NamedTuple):
    """Stage 2 -> 3: keys first seen at ``step``, with their first kept record and shard."""
    step: int
    keys: np.ndarray
    first_times: np.ndarray
    first_orders: np.ndarray
    shard: int


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


# Text that str.strip() changes: it begins or ends with a character str.isspace() accepts (the
# whole set, listed: Arrow's own trimming uses another definition of whitespace).
_SPACE = "".join(chr(c) for c in range(0x110000) if chr(c).isspace())
_PADDED = "^[{0}]|[{0}]$".format("".join(f"\\x{{{ord(c):x}}}" for c in _SPACE))


def _texts(values: np.ndarray) -> np.ndarray:
    """``_text`` of each entry (an integer column converted in one call: the same strings)."""
    values = np.asarray(values)
    if values.dtype.kind in "iu":
        return values.astype(str).astype(object)
    if pd.api.types.infer_dtype(values, skipna=False) == "string":
        # Only the strings that begin or end with what str.strip removes go through Python.
        padded = np.flatnonzero(np.asarray(pc.match_substring_regex(
            pa.array(values, pa.large_string()), _PADDED), dtype=bool))
        values = values.astype(object)
        values[padded] = [text.strip() for text in values[padded].tolist()]
        return values
    return np.array([_text(value) for value in values.tolist()], dtype=object)


def shard_of(texts: np.ndarray, shards: int) -> np.ndarray:
    """The shard of each unit or key text: SipHash-2-4 of its UTF-8 bytes (pandas' hash_array
    with its fixed key, the same on every worker and CPU; Python's hash() is salted per process)
    modulo ``shards``. A function of the text alone, and no bit of a release depends on it
    (module docstring)."""
    if len(texts) == 0:
        return np.zeros(0, np.int64)
    hashes = pd.util.hash_array(np.asarray(texts, dtype=object), categorize=True)
    return (hashes % np.uint64(shards)).astype(np.int64)


def _groups(labels: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(label, indices in input order) for each distinct label, labels ascending."""
    if len(labels) == 0:
        return
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    starts = np.flatnonzero(np.r_[True, sorted_labels[1:] != sorted_labels[:-1]])
    for start, end in zip(starts, np.r_[starts[1:], len(order)]):
        yield int(sorted_labels[start]), order[start:end]


def _first_of_each(codes: np.ndarray, times: np.ndarray,
                   orders: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct codes, and the earliest (time, order) of each)."""
    by_arrival = np.lexsort((orders, times))
    distinct, first = np.unique(codes[by_arrival], return_index=True)
    return distinct, times[by_arrival][first], orders[by_arrival][first]


def _previous_by_key(key_codes: np.ndarray, steps: np.ndarray, units: np.ndarray,
                     micro_batches: int) -> tuple[np.ndarray, PreviousSteps]:
    """Sums `units` per (key code, previous step): (distinct key codes, rows indexing them)."""
    combined, totals = operator.sum_by_code(
        key_codes.astype(np.int64) * (micro_batches + 1) + steps, units)
    keys = combined // (micro_batches + 1)
    distinct, key_index = np.unique(keys, return_inverse=True)
    return distinct, PreviousSteps(key_index, combined % (micro_batches + 1),
                                   totals.astype(np.int64))


@beam.typehints.with_output_types(Sharded)
class BatchByUnitShard(beam.DoFn):
    """Stage 0: drops records without a usable unit or key (identifiers.usable_ids: not empty,
    no NUL, at most 1024 bytes) or outside the window (each a function of the record alone), and
    emits the rest as one (step, RecordBatch) per (unit shard, step): a RecordBatch's at once, a
    bundle's single StreamRecords when the bundle ends."""

    def __init__(self, batches: MicroBatches, shards: int):
        self._batches, self._shards = batches, shards

    def start_bundle(self):
        self._records: list = []

    def process(self, element, timestamp=beam.DoFn.TimestampParam):
        if isinstance(element, RecordBatch):
            yield from (window.TimestampedValue(out, at) for out, at in self._split(element))
        else:
            self._records.append((element, float(timestamp)))

    def finish_bundle(self):
        if not self._records:
            return
        records, times = zip(*self._records)
        self._records = []
        batch = RecordBatch.of([r.unit for r in records], [r.key for r in records],
                               np.array([r.value for r in records], dtype=object), times,
                               [r.order for r in records])
        for out, at in self._split(batch):
            # (Before WindowInto: the global window. Timestamped at the earliest record, within
            # the window, never earlier than the bundle's elements.)
            yield WindowedValue(out, at, [window.GlobalWindow()])

    def _split(self, batch: RecordBatch) -> Iterator[tuple[tuple, float]]:
        units, keys = _texts(batch.units), _texts(batch.keys)
        steps = self._batches.window.micro_batch_of(batch.times, self._batches.count)
        kept = np.flatnonzero(usable_ids(units) & usable_ids(keys) & (steps > 0))
        batch = RecordBatch(units[kept], keys[kept], np.asarray(batch.values)[kept],
                            batch.times[kept], batch.orders[kept])
        steps = steps[kept]
        shards = shard_of(batch.units, self._shards)
        for label, rows in _groups(steps * self._shards + shards):
            part = batch.take(rows)
            yield (label % self._shards, (label // self._shards, part)), float(part.times.min())


@dataclass
class _UnitShard:
    """Stage 1's tables of one unit shard: operator.step's unit table and ``used``, the shard's
    keys, and per (unit, key) the last step the unit kept a record of the key."""
    units: CodeTable
    used: np.ndarray
    keys: CodeTable
    last_step: PairTable

    @classmethod
    def fresh(cls) -> "_UnitShard":
        return cls(CodeTable(), np.zeros(0, np.int32), CodeTable(), PairTable())


@beam.typehints.with_output_types(Sharded)
class BoundUnitContributions(beam.DoFn):
    """Stage 1, keyed by unit shard: contribution bounding over the window (module docstring)."""
    BUFFER = userstate.BagStateSpec("records", PickleCoder())
    TABLES = userstate.ReadModifyWriteStateSpec("tables", PickleCoder())
    DONE = userstate.ReadModifyWriteStateSpec("processed_through", VarIntCoder())
    WAKE_STEP, WAKE = _Wake.specs()
    STAGE = 0

    def __init__(self, batches: MicroBatches, query: StreamQuery, budget: StreamBudget,
                 shards: int):
        self._batches, self._query, self._budget = batches, query, budget
        self._shards = shards

    def process(self, element, buffer=beam.DoFn.StateParam(BUFFER),
                done=beam.DoFn.StateParam(DONE), wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        _, (step, records) = element
        if step <= (done.read() or 0):
            return  # late for a micro-batch already processed (see module docstring)
        buffer.add((step, records))
        _Wake(self._batches, self.STAGE, wake_step, wake).request(step)

    @userstate.on_timer(WAKE)
    def on_wake(self, buffer=beam.DoFn.StateParam(BUFFER), tables=beam.DoFn.StateParam(TABLES),
                done=beam.DoFn.StateParam(DONE), wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        alarm = _Wake(self._batches, self.STAGE, wake_step, wake)
        step = alarm.step()
        due = _take_due(buffer, step, lambda b: b[0])
        done.write(step)
        alarm.fired(b[0] for b in buffer.read())
        if not due:
            return
        records = RecordBatch.concat([b[1] for b in due])
        steps = np.concatenate([np.full(len(b[1].units), b[0]) for b in due])
        records = records.take(np.lexsort((records.orders, records.times, steps)))
        shard = tables.read() or _UnitShard.fresh()
        grid, bound = self._budget.record_grid
        units, keys, values = operator.clean_batch(
            pd.DataFrame({"unit": records.units, "key": records.keys, "value": records.values}),
            self._query.statistic, grid, bound)
        unit_codes, keep, shard.used = operator.bound_contributions(
            shard.units, shard.used, units, self._query.contribution_limit)
        if not keep.any():
            tables.write(shard)
            return
        key_codes = shard.keys.encode(keys[keep])
        pairs = sorted_unique(PairTable.pair_codes(unit_codes[keep], key_codes))
        previous = np.maximum(shard.last_step.replace(pairs, np.full(len(pairs), step)), 0)
        tables.write(shard)

        codes, sums = operator.sum_by_code(key_codes, values[keep])
        _, first_times, first_orders = _first_of_each(key_codes, records.times[keep],
                                                      records.orders[keep])
        _, previous = _previous_by_key(pairs & 0xFFFFFFFF, previous,
                                       np.ones(len(pairs), np.int64), self._batches.count)
        texts = shard.keys.values[codes]
        for key_shard, rows in _groups(shard_of(texts, self._shards)):
            rows_of = np.full(len(codes), -1)
            rows_of[rows] = np.arange(len(rows))
            mine = rows_of[previous.key_index] >= 0
            yield key_shard, KeyContributions(
                step, texts[rows], sums[rows], first_times[rows], first_orders[rows],
                PreviousSteps(rows_of[previous.key_index[mine]], previous.steps[mine],
                              previous.units[mine]))


@beam.typehints.with_output_types(Sharded)
class AggregateKeys(beam.DoFn):
    """Stage 2, keyed by key shard: a step's KeyContributions as one KeyStep; the keys first
    seen (with their first kept record) to the ``new_keys`` output."""
    BUFFER = userstate.BagStateSpec("contributions", PickleCoder())
    SEEN = userstate.ReadModifyWriteStateSpec("seen", PickleCoder())
    WAKE_STEP, WAKE = _Wake.specs()
    STAGE = 1

    def __init__(self, batches: MicroBatches):
        self._batches = batches

    def process(self, element, buffer=beam.DoFn.StateParam(BUFFER),
                wake_step=beam.DoFn.StateParam(WAKE_STEP), wake=beam.DoFn.TimerParam(WAKE)):
        _, contributions = element
        buffer.add(contributions)
        _Wake(self._batches, self.STAGE, wake_step, wake).request(contributions.step)

    @userstate.on_timer(WAKE)
    def on_wake(self, shard=beam.DoFn.KeyParam,
                buffer=beam.DoFn.StateParam(BUFFER), seen=beam.DoFn.StateParam(SEEN),
                wake_step=beam.DoFn.StateParam(WAKE_STEP), wake=beam.DoFn.TimerParam(WAKE)):
        alarm = _Wake(self._batches, self.STAGE, wake_step, wake)
        step = alarm.step()
        due = _take_due(buffer, step, lambda c: c.step)
        alarm.fired(c.step for c in buffer.read())
        if not due:
            return
        table = seen.read() or CodeTable()
        known = len(table)
        codes = table.encode(np.concatenate([c.keys for c in due]))
        seen.write(table)
        distinct, sums = operator.sum_by_code(codes, np.concatenate([c.values for c in due]))
        _, first_times, first_orders = _first_of_each(
            codes, np.concatenate([c.first_times for c in due]),
            np.concatenate([c.first_orders for c in due]))
        new = distinct >= known
        if new.any():
            yield beam.pvalue.TaggedOutput(_NEW_KEYS, ("", NewKeys(
                step, table.values[distinct[new]], first_times[new], first_orders[new], shard)))
        offsets = np.cumsum([0] + [len(c.keys) for c in due])
        previous_keys, previous = _previous_by_key(
            np.concatenate([codes[o + c.previous.key_index] for o, c in zip(offsets, due)]),
            np.concatenate([c.previous.steps for c in due]),
            np.concatenate([c.previous.units for c in due]), self._batches.count)
        yield shard, KeyStep(step, table.values[distinct], sums, previous._replace(
            key_index=np.searchsorted(distinct, previous_keys)[previous.key_index]))


@beam.typehints.with_output_types(Sharded)
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
        _Wake(self._batches, self.STAGE, wake_step, wake).request(announced.step)

    @userstate.on_timer(WAKE)
    def on_wake(self, buffer=beam.DoFn.StateParam(BUFFER),
                next_code=beam.DoFn.StateParam(NEXT), wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        alarm = _Wake(self._batches, self.STAGE, wake_step, wake)
        step = alarm.step()
        due = _take_due(buffer, step, lambda a: a.step)
        alarm.fired(a.step for a in buffer.read())
        if not due:
            return
        keys = np.concatenate([a.keys for a in due])
        shards = np.concatenate([np.full(len(a.keys), a.shard) for a in due])
        # (step, event time, input order) of each key's first kept record: distinct records
        order = np.lexsort((np.concatenate([a.first_orders for a in due]),
                            np.concatenate([a.first_times for a in due]),
                            np.concatenate([np.full(len(a.keys), a.step) for a in due])))
        first = next_code.read() or 0
        codes = np.empty(len(keys), np.int64)
        codes[order] = np.arange(first, first + len(keys))
        next_code.write(first + len(keys))
        for shard, rows in _groups(shards):
            yield shard, (keys[rows], codes[rows])


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
class _KeyShard:
    """Stage 4's tables of one key shard: operator.step's per-key columns and trees for the
    shard's keys (rows), each row's global key code (its noise streams' name), and the last
    step evaluated."""
    keys: CodeTable
    codes: np.ndarray
    columns: dict
    selection: TreeIndex
    values: TreeIndex
    evaluated: int = 0

    @classmethod
    def fresh(cls, budget: StreamBudget) -> "_KeyShard":
        return cls(CodeTable(), np.zeros(0, np.int64), key_columns(0), budget.index(True),
                   budget.index(False))


@beam.typehints.with_output_types(ReleaseUpdate)
class EvaluateKeys(beam.DoFn):
    """Stage 4, keyed by key shard: design steps 2-7 for its keys (module docstring)."""
    STEPS = userstate.BagStateSpec("key_steps", PickleCoder())
    TABLES = userstate.ReadModifyWriteStateSpec("tables", PickleCoder())
    WAKE_STEP, WAKE = _Wake.specs()
    STAGE = 3

    def __init__(self, batches: MicroBatches, budget: StreamBudget, noise_key: NoiseKey):
        self._batches, self._budget, self._noise_key = batches, budget, noise_key

    def setup(self):
        self._noise = KeyedGaussian(_read_noise_key(self._noise_key))

    def process(self, element, steps=beam.DoFn.StateParam(STEPS),
                tables=beam.DoFn.StateParam(TABLES), wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        _, (kind, payload) = element
        if kind == "codes":
            # New keys: their rows, and their round-1 selection trees (over the whole window,
            # from step 0, as operator.step starts them).
            keys, codes = payload
            shard = tables.read() or _KeyShard.fresh(self._budget)
            known = len(shard.keys)
            rows = shard.keys.encode(keys)
            shard.columns = grown_key_columns(shard.columns, known, len(shard.keys))
            shard.codes = np.concatenate([shard.codes, np.zeros(len(shard.keys) - known,
                                                                np.int64)])
            shard.codes[rows] = codes
            new = rows[rows >= known]
            shard.columns["selection_row"][new] = operator.first_rounds(
                shard.selection, self._noise, shard.codes[new], self._batches.count)
            tables.write(shard)
            return
        steps.add(payload)
        _Wake(self._batches, self.STAGE, wake_step, wake).request(payload.step)

    @userstate.on_timer(WAKE)
    def on_wake(self, steps=beam.DoFn.StateParam(STEPS), tables=beam.DoFn.StateParam(TABLES),
                wake_step=beam.DoFn.StateParam(WAKE_STEP), wake=beam.DoFn.TimerParam(WAKE)):
        alarm = _Wake(self._batches, self.STAGE, wake_step, wake)
        t = alarm.step()
        due = _take_due(steps, t, lambda s: s.step)
        shard = tables.read()
        if shard is None:
            raise RuntimeError(f"key codes missing at step {t}: the runner ran stage 4 before "
                               "stage 3 at the same trigger (see Staggered stages)")
        if t <= shard.evaluated:
            # Records that reached the shard after it was evaluated at their step or later (a
            # source or runner that broke the order the module docstring describes): dropped,
            # so that no tree leaf is ever evaluated twice or out of order.
            alarm.fired(list(self._upcoming(shard)) + [s.step for s in steps.read()])
            return
        columns, known = shard.columns, len(shard.keys)
        touched = []
        for data in due:
            rows = shard.keys.encode(data.keys)
            if len(shard.keys) != known:
                raise RuntimeError(f"a key without a code at step {t}: the runner ran stage 4 "
                                   "before stage 3 at the same trigger (see Staggered stages)")
            np.add.at(columns["buffer"], rows, data.values)  # grid multiples: exact
            rows_of = rows[data.previous.key_index]
            # A unit counts in the key's round iff its previous step with the key is not
            # after the round's origin (module docstring).
            fresh = data.previous.steps <= columns["origin"][rows_of]
            np.add.at(columns["count"], rows_of[fresh], data.previous.units[fresh])
            touched.append(rows)
        predicted = np.flatnonzero(columns["due"][:known] == t)
        evaluated = sorted_unique(np.concatenate(touched + [predicted]))
        grid, _ = self._budget.record_grid
        releasing, _ = operator.evaluate_keys(columns, shard.selection, shard.values,
                                              self._noise, evaluated, t,
                                              self._batches.count, grid, shard.codes)
        shard.evaluated = t
        tables.write(shard)
        for key, value in zip(shard.keys.values[releasing],
                              columns["released_value"][releasing]):
            yield ReleaseUpdate(t, key, float(value))
        alarm.fired(list(self._upcoming(shard)) + [s.step for s in steps.read()])

    @staticmethod
    def _upcoming(shard: _KeyShard) -> Iterator[int]:
        """The earliest predicted release among the shard's keys, if any."""
        due = shard.columns["due"][:len(shard.keys)]
        due = due[due != NEVER]
        if len(due):
            yield int(due.min())


class AggregateContributions(beam.PTransform):
    """StreamRecords or RecordBatches (event-time timestamps) -> (KeySteps keyed by key shard,
    new keys): stages 0-2, the pre-noise aggregates. Private data: its only consumer is
    :class:`ReleaseKeys`."""

    def __init__(self, query: StreamQuery, budget: StreamBudget, batches: MicroBatches,
                 shards: int = DEFAULT_SHARDS):
        super().__init__()
        query.check()
        check_budget(query, budget)
        if batches.count != query.micro_batches:
            raise ValueError(f"the window has {batches.count} micro-batches, the query "
                             f"{query.micro_batches}")
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards must be a positive integer, got {shards!r}")
        self._query, self._budget, self._batches = query, budget, batches
        self._shards = shards

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
            | "Batch" >> beam.ParDo(BatchByUnitShard(batches, self._shards))
            | "Window" >> beam.WindowInto(batches.beam_window)
            | "BoundUnits" >> beam.ParDo(BoundUnitContributions(batches, self._query,
                                                                self._budget, self._shards))
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
                 | "OneKey" >> beam.Map(lambda a: a).with_output_types(Tuple[str, Any])
                 | "AssignKeyCodes" >> beam.ParDo(AssignKeyCodes(batches)))
        tagged = Tuple[int, Tuple[str, Any]]
        return (
            (key_steps | "TagSteps" >> beam.Map(
                lambda e: (e[0], ("step", e[1]))).with_output_types(tagged),
             codes | "TagCodes" >> beam.Map(
                 lambda e: (e[0], ("codes", e[1]))).with_output_types(tagged))
            | "Join" >> beam.Flatten()
            | "EvaluateKeys" >> beam.ParDo(EvaluateKeys(batches, self._budget,
                                                        self._noise_key)))


class ContinualReleaseTransform(beam.PTransform):
    """StreamRecords or RecordBatches (event-time timestamps) -> ReleaseUpdates: one window of
    ``query`` at ``budget`` (its grant charged by the caller before the pipeline runs), with the
    secret ``noise_key``, its units and keys split into ``shards`` (no bit depends on it)."""

    def __init__(self, query: StreamQuery, budget: StreamBudget, batches: MicroBatches,
                 noise_key: NoiseKey, shards: int = DEFAULT_SHARDS):
        super().__init__()
        self._aggregate = AggregateContributions(query, budget, batches, shards)
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
