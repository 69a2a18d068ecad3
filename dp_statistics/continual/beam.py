"""The Beam engine of the DP-SQLP operator (issue 19; docs: /work/wt/s19design.md's state machine):
a streaming pipeline for Flink or Dataflow, tested on the DirectRunner with a TestStream.

Input: a PCollection of :class:`StreamRecord` whose Beam timestamps are the records' event times.
The window's event-time range [start, end) is cut into T micro-batches of equal width; micro-batch
i ends at the public trigger time start + i * width (a function of the window only, never of the
data). Each stage acts at a trigger when an event-time timer set to that trigger's timestamp
fires, i.e. once the watermark says every record of the micro-batch has arrived.

Stage 1, keyed by unit (:class:`BoundUnitContributions`): buffers a unit's records; at each
trigger it keeps the first (C - used) of the micro-batch in (event time, input order) and adds
them to ``used``. Its state also holds, for each key the unit has contributed to, the last step
it did (at most C entries, since at most C records are kept). It emits one :class:`PairBatch`
per (unit, key, step): the sum of the kept clamped values and that previous step.

Stage 2, keyed by key (:class:`EvaluateKeys`): buffers a key's pair batches; at the trigger of
their step it adds the values to the key's buffer and counts the unit as a new distinct user of
the key's current round iff its previous step lies before the round began (step <= origin o_k).
This is exactly the design's "a unit counts once per (key, round)" rule without a feedback edge
from stage 2's rounds to stage 1: a unit was already counted in the current round (o_k, t] iff
it contributed to the key at some step in (o_k, t), i.e. iff its last earlier step exceeds o_k.
Stage 2 never sees unit ids, and stage 1's extra state is bounded by C per unit.

Source contract (part of the guarantee): the source's watermark must never pass a trigger time
before every record of the window with an earlier event time has been read (a replay of sealed
ledger blocks, or :func:`replay`'s TestStream, satisfies it). A record that arrives after its
micro-batch was processed for its unit or its key is dropped, but Beam gives a DoFn no view of
the watermark, so a source that breaks the contract can put a late record into a released step;
and a watermark driven by the data would make which records are late depend on other units.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Tuple

import apache_beam as beam
from apache_beam.coders import PickleCoder, VarIntCoder
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms import userstate, window
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.utils.timestamp import Timestamp

# The smallest micro-batch width: trigger timestamps are whole microseconds (Beam's resolution)
# and must be strictly increasing.
MIN_WIDTH_SECONDS = 1e-3


class StreamRecord(NamedTuple):
    """One input record; its event time is the Beam element's timestamp. ``order`` is its
    position in the input (the public tie-break between records with the same event time)."""
    unit: Any
    key: Any
    value: float
    order: int


class PairBatch(NamedTuple):
    """Stage 1 -> stage 2: one unit's kept records of one key in micro-batch ``step``."""
    step: int
    value: float  # sum of the kept, clamped values
    previous_step: int  # the unit's last earlier step with a kept record of this key; 0 if none


class KeyAggregate(NamedTuple):
    """Pre-noise aggregate of one key at one step (what the operator is fed; tests only)."""
    key: Any
    step: int
    value: float
    new_users: int  # distinct units new to the key's current round


@dataclass(frozen=True)
class MicroBatches:
    """The window's event-time range [start, end) in seconds and its T micro-batches."""
    start: float
    end: float
    count: int

    def __post_init__(self):
        if not (math.isfinite(self.start) and math.isfinite(self.end) and self.end > self.start):
            raise ValueError(f"the window's range must be finite with end > start, got "
                             f"[{self.start}, {self.end})")
        if self.count < 1 or int(self.count) != self.count:
            raise ValueError(f"micro-batches must be a positive integer, got {self.count}")
        if self.width < MIN_WIDTH_SECONDS:
            raise ValueError(f"micro-batches of {self.width} s are narrower than "
                             f"{MIN_WIDTH_SECONDS} s (Beam timestamps are microseconds)")

    @property
    def width(self) -> float:
        return (self.end - self.start) / self.count

    def step_of(self, event_time: float) -> int:
        """The micro-batch (1..T) of an event time, 0 outside the window."""
        if not (self.start <= event_time < self.end):
            return 0
        return min(int((event_time - self.start) // self.width) + 1, self.count)

    def trigger_timestamp(self, step: int) -> Timestamp:
        """The last Beam instant of micro-batch ``step``: stage timers fire there."""
        return Timestamp(micros=round((self.start + step * self.width) * 1e6) - 1)

    def step_at(self, timestamp: Timestamp) -> int:
        """The step whose trigger timestamp is ``timestamp`` (a fired timer's)."""
        step = self.step_of(float(timestamp))
        if self.trigger_timestamp(step) != timestamp:
            raise ValueError(f"{timestamp} is not a trigger time of {self}")
        return step


def clean_value(value, value_bound: float) -> float:
    """Not a finite number -> 0 (sources.py's rule), then clamped to [-L, L]: a function of
    the record alone."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return min(max(value, -value_bound), value_bound) if math.isfinite(value) else 0.0


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

    def __init__(self, batches: MicroBatches, state, timer):
        self._batches, self._state, self._timer = batches, state, timer

    def request(self, step: int):
        current = self._state.read()
        if current is None or step < current:
            self._state.write(step)
            self._timer.set(self._batches.trigger_timestamp(step))

    def fired(self, steps: Iterable[int]):
        """After acting: wake next at the earliest of ``steps`` (none: stay asleep)."""
        self._state.clear()
        upcoming = [s for s in steps if s]
        if upcoming:
            self.request(min(upcoming))


@beam.typehints.with_output_types(Tuple[str, PairBatch])
class BoundUnitContributions(beam.DoFn):
    """Stage 1, keyed by unit: contribution bounding (first C records of the window, in
    micro-batch order then (event time, input order) within one) and the (unit, key) last step.

    State per unit: ``used`` (<= C), a dict key -> last step (<= C entries), the buffered records
    of micro-batches not yet processed. A unit at its bound has its records dropped on arrival.
    """
    BUFFER = userstate.BagStateSpec("records", PickleCoder())
    USED = userstate.ReadModifyWriteStateSpec("used", VarIntCoder())
    LAST_STEP = userstate.ReadModifyWriteStateSpec("last_step_by_key", PickleCoder())
    DONE = userstate.ReadModifyWriteStateSpec("processed_through", VarIntCoder())
    WAKE_STEP, WAKE = _Wake.specs()

    def __init__(self, batches: MicroBatches, contribution_limit: int):
        self._batches, self._limit = batches, contribution_limit

    def process(self, element, timestamp=beam.DoFn.TimestampParam,
                buffer=beam.DoFn.StateParam(BUFFER), used=beam.DoFn.StateParam(USED),
                done=beam.DoFn.StateParam(DONE), wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        _, record = element
        step = self._batches.step_of(float(timestamp))
        if (used.read() or 0) >= self._limit or step <= (done.read() or 0):
            return  # at its bound, or late for a micro-batch already processed (see module)
        buffer.add((step, float(timestamp), record.order, record.key, record.value))
        _Wake(self._batches, wake_step, wake).request(step)

    @userstate.on_timer(WAKE)
    def on_wake(self, unit=beam.DoFn.KeyParam, timestamp=beam.DoFn.TimestampParam,
                buffer=beam.DoFn.StateParam(BUFFER), used=beam.DoFn.StateParam(USED),
                last_step=beam.DoFn.StateParam(LAST_STEP), done=beam.DoFn.StateParam(DONE),
                wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        step = self._batches.step_at(timestamp)
        records = list(buffer.read())
        due = sorted(r for r in records if r[0] <= step)
        rest = [r for r in records if r[0] > step]
        count = used.read() or 0
        kept = due[:max(self._limit - count, 0)]
        used.write(count + len(kept))
        done.write(step)
        buffer.clear()
        for record in rest if count + len(kept) < self._limit else ():
            buffer.add(record)
        _Wake(self._batches, wake_step, wake).fired(r[0] for r in buffer.read())

        sums: dict = {}
        for record_step, _, _, key, value in kept:
            sums[key] = sums.get(key, 0.0) + value
        previous = last_step.read() or {}
        for key, value in sums.items():
            yield key, PairBatch(step, value, previous.get(key, 0))
            previous[key] = step
        if sums:
            last_step.write(previous)


class AggregateKeys(beam.DoFn):
    """Stage 2, keyed by key: at each trigger with pair batches of the key, the pre-noise
    aggregate the operator consumes (values summed; units new to the key's current round)."""
    BUFFER = userstate.BagStateSpec("pair_batches", PickleCoder())
    WAKE_STEP, WAKE = _Wake.specs()

    def __init__(self, batches: MicroBatches):
        self._batches = batches

    def process(self, element, buffer=beam.DoFn.StateParam(BUFFER),
                wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        _, batch = element
        buffer.add(batch)
        _Wake(self._batches, wake_step, wake).request(batch.step)

    @userstate.on_timer(WAKE)
    def on_wake(self, key=beam.DoFn.KeyParam, timestamp=beam.DoFn.TimestampParam,
                buffer=beam.DoFn.StateParam(BUFFER),
                wake_step=beam.DoFn.StateParam(WAKE_STEP),
                wake=beam.DoFn.TimerParam(WAKE)):
        step = self._batches.step_at(timestamp)
        batches = list(buffer.read())
        due = [b for b in batches if b.step <= step]
        buffer.clear()
        for batch in batches:
            if batch.step > step:
                buffer.add(batch)
        _Wake(self._batches, wake_step, wake).fired(b.step for b in batches if b.step > step)
        if due:
            # Round 1 begins at origin 0 until the operator moves it (selection).
            yield KeyAggregate(key, step, sum(b.value for b in due),
                               sum(1 for b in due if b.previous_step <= 0))


@beam.typehints.with_output_types(Tuple[str, StreamRecord])
class Prepare(beam.DoFn):
    """Drops records without a unit or key, or outside the window (each a function of the record
    alone), clamps values, and keys the records by unit."""

    def __init__(self, batches: MicroBatches, value_bound: float):
        self._batches, self._bound = batches, value_bound

    def process(self, record: StreamRecord, timestamp=beam.DoFn.TimestampParam):
        unit, key = _text(record.unit), _text(record.key)
        if unit and key and self._batches.step_of(float(timestamp)):
            yield unit, StreamRecord(unit, key, clean_value(record.value, self._bound),
                                     record.order)


class BoundContributions(beam.PTransform):
    """StreamRecords -> (key, PairBatch): preparation and stage 1, in the window's Beam window
    (state lives for the window and is collected after it)."""

    def __init__(self, batches: MicroBatches, contribution_limit: int, value_bound: float):
        super().__init__()
        if contribution_limit < 1 or int(contribution_limit) != contribution_limit:
            raise ValueError(f"the contribution limit C must be a positive integer, got "
                             f"{contribution_limit}")
        if not (value_bound > 0 and math.isfinite(value_bound)):
            raise ValueError(f"the value bound L must be positive and finite, got {value_bound}")
        self._batches, self._limit, self._bound = batches, contribution_limit, value_bound

    def expand(self, records):
        batches = self._batches
        return (records
                | "Prepare" >> beam.ParDo(Prepare(batches, self._bound))
                | "Window" >> beam.WindowInto(window.FixedWindows(
                    batches.end - batches.start, offset=batches.start))
                | "BoundUnits" >> beam.ParDo(BoundUnitContributions(batches, self._limit)))


def replay(records: Iterable[tuple], batches: MicroBatches) -> TestStream:
    """A TestStream of ``(unit, key, value, event_time)`` tuples (input order = list order) that
    honours the source contract: each micro-batch's records in input order, then the watermark
    to its trigger. Records outside the window come first (the pipeline drops them)."""
    by_step: dict = {}
    for order, (unit, key, value, event_time) in enumerate(records):
        element = window.TimestampedValue(StreamRecord(unit, key, value, order), event_time)
        by_step.setdefault(batches.step_of(float(event_time)), []).append(element)
    stream = TestStream()
    if by_step.get(0):
        stream = stream.add_elements(by_step[0])
    for step in range(1, batches.count + 1):
        if by_step.get(step):
            stream = stream.add_elements(by_step[step])
        stream = stream.advance_watermark_to(batches.trigger_timestamp(step) + 1e-6)
    return stream.advance_watermark_to_infinity()


def _collect(build, options) -> list:
    """Run ``build(pipeline)`` -> PCollection in a streaming pipeline of its own; its elements,
    which cross from the workers as one pickle file each in a temporary directory."""
    import os
    import pickle
    import tempfile
    import uuid

    with tempfile.TemporaryDirectory() as directory:
        def save(element):
            with open(os.path.join(directory, uuid.uuid4().hex), "wb") as file:
                pickle.dump(element, file)

        with beam.Pipeline(options=options) as pipeline:
            _ = build(pipeline) | "Save" >> beam.Map(save)
        elements = []
        for name in os.listdir(directory):
            with open(os.path.join(directory, name), "rb") as file:
                elements.append(pickle.load(file))
        return elements
