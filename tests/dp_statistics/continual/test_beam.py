"""The Beam engine of the DP-SQLP operator on the DirectRunner, fed by a TestStream that advances
the watermark to each public trigger time."""
import math
from collections import Counter

import apache_beam as beam
import numpy as np
import pytest

from sage_tfx.dp_statistics.continual import local, operator
from sage_tfx.dp_statistics.continual.beam import (
    AggregateContributions, ContinualReleaseTransform, MicroBatches, ReleaseUpdate, StreamRecord,
    histograms)
from sage_tfx.dp_statistics.continual.budget import plan
from sage_tfx.dp_statistics.continual.sources import Window
from sage_tfx.dp_statistics.continual.spec import StreamQuery
from support.continual_beam import collect, conformance_stream, local_batches, replay

NOISE_KEY = bytes(range(32))  # fixed noise in tests only
# two blocks with a gap; triggers at 1010, 1020, 1030
BATCHES = MicroBatches(Window(("w1", "w2"), ((1000.0, 1020.0), (1020.5, 1030.0))), 3)
LIMIT, BOUND = 3, 5.0
QUERY = StreamQuery(key_column="k", unit_column="u", time_column="t", value_column="v",
                    value_bound=BOUND, contribution_limit=LIMIT, micro_batches=3, epsilon=1.0,
                    delta=1e-6)  # tau is in the hundreds: no key is selected here

# (unit, key, value, event time); list order is the input order
RECORDS = [
    ("u1", "a", 1.0, 1001.0), ("u1", "a", 2.0, 1002.0), ("u2", "a", 9.0, 1003.0),  # 9 -> 5
    ("u3", "b", float("nan"), 1004.0), ("u6", "b", float("inf"), 1004.5),  # not finite -> 0
    (None, "a", 1.0, 1005.0), ("u4", None, 1.0, 1005.0), (" ", "a", 1.0, 1005.0),  # dropped
    ("u1", "b", 4.0, 999.0), ("u1", "b", 4.0, 1030.0), ("u7", "c", 1.0, 1020.2),  # in no block
    # batch 2: u1's third record is its last; the same event time is broken by input order
    ("u1", "b", 3.0, 1015.0), ("u1", "a", 7.0, 1015.0), ("u2", "a", -8.0, 1012.0),  # -8 -> -5
    ("u3", "b", 2.0, 1011.0), ("u5", "c", 1.5, 1019.0),
    # batch 3: arrival order differs from event-time order within the batch
    ("u1", "c", 1.0, 1021.0), ("u2", "b", 1.0, 1029.0), ("u2", "b", 0.5, 1022.0),
    ("u3", "a", 1.0, 1025.0), ("u5", "c", 2.5, 1028.0),
]


def _expected(records, batches, limit, bound):
    """Pre-noise aggregates by (key, step) from first principles: each unit's first C valid
    records in (step, event time, input order); a unit is new to a key at its first kept step."""
    per_unit = {}
    for order, (unit, key, value, time) in enumerate(records):
        step = batches.step_of(time)
        if not (unit or "").strip() or not key or step == 0:
            continue
        value = min(max(value, -bound), bound) if math.isfinite(value) else 0.0
        per_unit.setdefault(unit, []).append((step, time, order, key, value))
    aggregates, first_step = {}, {}
    for unit, rows in per_unit.items():
        for step, _, _, key, value in sorted(rows)[:limit]:
            first_step.setdefault((unit, key), step)
            total, users = aggregates.get((key, step), (0.0, 0))
            aggregates[(key, step)] = (total + value, users)
    for (unit, key), step in first_step.items():
        total, users = aggregates[(key, step)]
        aggregates[(key, step)] = (total, users + 1)
    return aggregates


def _beam_key_steps(records, query=QUERY, batches=BATCHES):
    budget = plan(query.epsilon, query.delta, query.micro_batches, query.contribution_limit,
                  query.value_bound)
    out = collect(lambda pipeline: (
        pipeline | replay(records, batches)
        | AggregateContributions(query, budget, batches))[0])
    return _by_key_and_step(out)


def _by_key_and_step(key_steps):
    """{(key, step): (kept total, units new to the key)} of stage 2's sharded KeySteps."""
    out = {}
    for _, batch in key_steps:
        for index, key in enumerate(batch.keys):
            assert (key, batch.step) not in out, "one KeyStep row per key and step"
            first_time = batch.previous.steps[batch.previous.key_index == index] == 0
            out[(key, batch.step)] = (batch.values[index], int(
                batch.previous.units[batch.previous.key_index == index][first_time].sum()))
    return out


def test_stage_one_bounds_units_and_stage_two_counts_new_users_per_key():
    got = _beam_key_steps(RECORDS)
    assert got == _expected(RECORDS, BATCHES, LIMIT, BOUND)
    # spelled out: u1 keeps a@1 (1, 2) and b@2 (3, input order before its a@2 record);
    # u2 keeps a@1 (5), a@2 (-5) and only b@3 0.5 (at 1022, before 1.0 at 1029)
    assert got == {("a", 1): (8.0, 2), ("b", 1): (0.0, 2),
                   ("a", 2): (-5.0, 0), ("b", 2): (5.0, 1), ("c", 2): (1.5, 1),
                   ("b", 3): (0.5, 1), ("a", 3): (1.0, 1), ("c", 3): (2.5, 0)}


def test_a_unit_or_key_with_a_nul_or_over_1024_bytes_drops_its_record_as_in_sources():
    unusable = [("u1\x00", "a", 1.0, 1001.5), ("u9", "k" * 1025, 1.0, 1001.5),
                ("u9", "a\x00", 1.0, 1002.5)]
    assert _beam_key_steps(RECORDS + unusable) == _expected(RECORDS, BATCHES, LIMIT, BOUND)


@pytest.mark.parametrize("start, end, count", [(1.0, 1.0, 2), (0.0, 1.0, 0),
                                               (0.0, float("inf"), 2), (0.0, 0.1, 2)])
def test_a_bad_window_is_refused_by_name(start, end, count):
    with pytest.raises(ValueError, match="window|micro-batch"):
        MicroBatches(Window(("w",), ((start, end),)), count)


@pytest.mark.parametrize("mechanism", ["tree", "factorization"])
def test_the_beam_and_local_engines_release_the_same_bits(tmp_path, monkeypatch, mechanism):
    query = StreamQuery(key_column="k", unit_column="u", time_column="t", value_column="v",
                        value_bound=4.0, contribution_limit=2, micro_batches=4, epsilon=20.0,
                        delta=1e-3, mechanism=mechanism)
    budget = plan(20.0, 1e-3, 4, 2, 4.0, mechanism=mechanism)
    batches = MicroBatches(Window(("w",), ((0.0, 40.0),)), 4)
    records = conformance_stream()
    local_releases = []
    state = local.run_local(query, budget, local_batches(records, batches), str(tmp_path),
                            local_releases.append, noise_key=NOISE_KEY)
    evaluations = []  # the step of each key evaluation Beam's stage 4 makes (same process)
    evaluate = operator.select_and_predict

    def counted(selection, noise, rows, origins, step, counts):
        evaluations.extend([step] * len(rows))
        return evaluate(selection, noise, rows, origins, step, counts)
    monkeypatch.setattr(operator, "select_and_predict", counted)

    def build(pipeline):
        """The releases, and beside them the pre-noise KeySteps of ContinualReleaseTransform's first
        transform on the same records."""
        stream = pipeline | replay(records, batches)
        return (stream | ContinualReleaseTransform(query, budget, batches, NOISE_KEY),
                (stream | AggregateContributions(query, budget, batches))[0]) | beam.Flatten()
    out = collect(build)
    updates = [e for e in out if isinstance(e, ReleaseUpdate)]
    key_steps = [e for e in out if not isinstance(e, ReleaseUpdate)]

    def bits(pairs):
        return sorted((str(key), np.float64(value).tobytes()) for key, value in pairs)
    for release, histogram in zip(local_releases, histograms(updates, 4)):
        updated = zip(release.keys[release.updated], release.values[release.updated])
        assert bits(updated) == bits((u.key, u.value) for u in updates if u.step == release.step)
        assert bits(zip(release.keys, release.values)) == bits(histogram.items())
    # pre-noise: each key's kept total (released or buffered) is the same in both engines
    kept_by_step = _by_key_and_step(key_steps)
    beam_totals = {}
    for (key, _), (value, _) in kept_by_step.items():
        beam_totals[key] = beam_totals.get(key, 0.0) + value
    local_totals = dict(zip(state.keys.values, state.column("buffer")
                            + state.column("released_true")))
    assert beam_totals == local_totals
    # the stream exercises what it is meant to: a release at a step without records of the key
    # (only the due timer wakes it) and a key released in two rounds
    with_records = {(step, key) for step, frame in local_batches(records, batches)
                    for key in frame["key"]}
    assert ("d" in {u.key for u in updates if (u.step, u.key) not in with_records})
    assert max(Counter(u.key for u in updates).values()) >= 2
    # Algorithm 4: a key is evaluated at a step only if it has kept records there or is due
    # there, and a due evaluation releases it; nothing scans the keys without records
    kept = {(step, key) for key, step in kept_by_step}
    woken = {(u.step, u.key) for u in updates} - kept
    assert Counter(evaluations) == Counter(step for step, _ in kept | woken)
    first_seen = {}
    for step, key in sorted(kept):
        first_seen.setdefault(key, step)
    full_scan = sum(4 - step + 1 for step in first_seen.values())
    assert len(evaluations) < full_scan


def test_the_beam_engine_refuses_a_window_budget_or_key_that_does_not_fit():
    budget = plan(1.0, 1e-6, 3, LIMIT, BOUND)
    with pytest.raises(ValueError, match="micro-batches"):
        ContinualReleaseTransform(QUERY, budget, MicroBatches(BATCHES.window, 4), NOISE_KEY)
    with pytest.raises(ValueError, match="32 bytes"):
        ContinualReleaseTransform(QUERY, budget, BATCHES, NOISE_KEY[:16])
    with pytest.raises(Exception, match="budget was planned"):
        ContinualReleaseTransform(QUERY, plan(2.0, 1e-6, 3, LIMIT, BOUND), BATCHES, NOISE_KEY)


def test_a_late_record_of_a_micro_batch_its_unit_has_processed_is_dropped():
    """u1's second step-1 record arrives after step 1 was processed: it must not be counted at
    step 1 (already aggregated) nor move to step 2 (it is not a step-2 record)."""
    from apache_beam.testing.test_stream import TestStream
    from apache_beam.transforms.window import TimestampedValue

    from sage_tfx.dp_statistics.continual.beam import STAGES

    stream = TestStream().add_elements(
        [TimestampedValue(StreamRecord("u1", "a", 1.0, 0), 1001.0)])
    for stage in range(STAGES):
        stream = stream.advance_watermark_to(BATCHES.trigger_timestamp(1, stage))
    stream = stream.add_elements([TimestampedValue(StreamRecord("u1", "a", 2.0, 1), 1002.0),
                                  TimestampedValue(StreamRecord("u1", "a", 4.0, 2), 1012.0)])
    budget = plan(QUERY.epsilon, QUERY.delta, 3, LIMIT, BOUND)
    out = collect(lambda pipeline: (
        pipeline | stream.advance_watermark_to_infinity()
        | AggregateContributions(QUERY, budget, BATCHES))[0])
    assert {k: value for k, (value, _) in _by_key_and_step(out).items()} == {
        ("a", 1): 1.0, ("a", 2): 4.0}


def test_a_bounded_input_is_refused_when_the_pipeline_is_built():
    budget = plan(1.0, 1e-6, 3, LIMIT, BOUND)
    pipeline = beam.Pipeline()
    records = pipeline | beam.Create([StreamRecord("u1", "a", 1.0, 0)])
    with pytest.raises(ValueError, match="unbounded source"):
        _ = records | ContinualReleaseTransform(QUERY, budget, BATCHES, NOISE_KEY)


def _evaluate_keys(late: bool, noise_key=NOISE_KEY):
    """Stage 4 alone: key "a" with 40 new users at step 2 (selected at epsilon 20), and, if
    `late`, step-1 records that reach it only after step 2 was evaluated."""
    from apache_beam.testing.test_stream import TestStream
    from apache_beam.transforms.window import TimestampedValue

    from sage_tfx.dp_statistics.continual.beam import EvaluateKeys, KeyStep, PreviousSteps

    def key_step(step, value):  # key "a": `value` and 40 units new to it
        return KeyStep(step, np.array(["a"], dtype=object), np.array([value]),
                       PreviousSteps(np.array([0]), np.array([0]), np.array([40])))

    budget = plan(20.0, 1e-3, 3, 2, 4.0)
    at = float(BATCHES.trigger_timestamp(2))
    stream = TestStream().add_elements([
        TimestampedValue((0, ("codes", (np.array(["a"], dtype=object), np.array([0])))), at),
        TimestampedValue((0, ("step", key_step(2, 3.0))), at)])
    stream = stream.advance_watermark_to(BATCHES.trigger_timestamp(2, 3))
    if late:
        stream = stream.add_elements([TimestampedValue((0, ("step", key_step(1, 4.0))), at)])
    return sorted(collect(lambda pipeline: (
        pipeline | stream.advance_watermark_to_infinity()
        | beam.WindowInto(BATCHES.beam_window)
        | beam.ParDo(EvaluateKeys(BATCHES, budget, noise_key)))))


def test_records_reaching_a_key_after_it_was_evaluated_at_their_step_are_dropped():
    on_time = _evaluate_keys(late=False)
    # Selected at step 2; released again at step 3, the window's final pane.
    assert [(u.step, u.key) for u in on_time] == [(2, "a"), (3, "a")]
    assert _evaluate_keys(late=True) == on_time


def test_workers_can_read_the_noise_key_from_a_file_instead_of_the_job_graph(tmp_path):
    from sage_tfx.dp_statistics.continual.beam import _read_noise_key

    path = tmp_path / "noise.key"
    path.write_bytes(NOISE_KEY)
    assert _evaluate_keys(late=False, noise_key=str(path)) == _evaluate_keys(late=False)
    path.write_bytes(NOISE_KEY[:31])
    with pytest.raises(ValueError, match="32 bytes"):
        _read_noise_key(str(path))
    with pytest.raises(ValueError, match="cannot be read"):
        _read_noise_key(str(tmp_path / "missing.key"))


def test_the_stages_carry_batches_and_release_the_local_bits(tmp_path):
    """Issue 47: records cross each shuffle as batches: into the unit shuffle at most one per
    (input batch, unit shard), into the key shuffle at most one per (step, unit shard, key
    shard), however many records; and the releases are the local engine's bits, here with 3
    shards (test_the_beam_and_local_engines_release_the_same_bits: with the default 8). A seeded
    stream of 1,200 records in RecordBatches of 100: several bundles per micro-batch."""
    from apache_beam.testing.test_stream import TestStream
    from apache_beam.transforms.window import TimestampedValue

    from sage_tfx.dp_statistics.continual.beam import (STAGES, BatchByUnitShard,
                                                       BoundUnitContributions, RecordBatch)

    rng = np.random.default_rng(47)
    rows, shards, steps = 1200, 3, 4
    query = StreamQuery(key_column="k", unit_column="u", time_column="t", value_column="v",
                        value_bound=4.0, contribution_limit=3, micro_batches=steps,
                        epsilon=20.0, delta=1e-3)
    budget = plan(20.0, 1e-3, steps, 3, 4.0)
    batches = MicroBatches(Window(("w",), ((0.0, 40.0),)), steps)
    times = np.sort(rng.uniform(0, 40, rows))
    records = list(zip((f"u{u}" for u in rng.integers(0, 200, rows)),
                       (f"k{k}" for k in rng.zipf(1.5, rows) % 60),
                       rng.integers(-5, 6, rows).astype(float), times))
    local_releases = []
    local.run_local(query, budget, local_batches(records, batches), str(tmp_path),
                    local_releases.append, noise_key=NOISE_KEY)
    final = local_releases[-1]
    assert final.updated.sum() > 10  # the stream releases keys at the last trigger

    elements = []  # the input's RecordBatches

    def as_batches():
        stream, columns = TestStream(), list(zip(*records))
        for step in range(1, steps + 1):
            inside = np.flatnonzero([batches.step_of(t) == step for t in times])
            for low in range(0, len(inside), 100):
                part = inside[low:low + 100]
                elements.append(part)
                stream = stream.add_elements([TimestampedValue(RecordBatch.of(
                    *(np.asarray(column, dtype=object)[part] for column in columns[:3]),
                    times[part], part), float(times[part[0]]))])
            for stage in range(STAGES):
                stream = stream.advance_watermark_to(batches.trigger_timestamp(step, stage))
        return stream.advance_watermark_to_infinity()

    def shuffled(pipeline):
        """What crosses the unit shuffle and the key shuffle, and the releases."""
        source = pipeline | as_batches()
        unit_batches = source | beam.ParDo(BatchByUnitShard(batches, shards))
        key_batches = (unit_batches | beam.WindowInto(batches.beam_window)
                       | beam.ParDo(BoundUnitContributions(batches, query, budget, shards)))
        releases = source | "Release" >> ContinualReleaseTransform(query, budget, batches,
                                                                   NOISE_KEY, shards)
        return ((unit_batches | "Unit" >> beam.Map(lambda e: ("unit", e)),
                 key_batches | "Key" >> beam.Map(lambda e: ("key", e)),
                 releases | "Out" >> beam.Map(lambda e: ("release", e))) | beam.Flatten())
    out = collect(shuffled)
    unit_batches = [e for kind, e in out if kind == "unit"]
    key_batches = [e for kind, e in out if kind == "key"]
    assert sum(len(records.units) for _, (_, records) in unit_batches) == rows
    assert len(unit_batches) <= len(elements) * shards < rows / 20
    assert {shard for shard, _ in unit_batches} == set(range(shards))
    assert len(key_batches) <= steps * shards * shards
    assert sum(len(batch.keys) for _, batch in key_batches) > len(key_batches)

    def bits(pairs):
        return sorted((str(key), np.float64(value).tobytes()) for key, value in pairs)
    expected = bits(zip(final.keys, final.values))
    assert bits(histograms([e for kind, e in out if kind == "release"], steps)[-1].items()) \
        == expected
