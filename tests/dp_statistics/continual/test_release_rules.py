"""Each release rule of the DP-SQLP operator, checked on what both engines release (the local
engine, and Beam on the DirectRunner): issue 45 item 8. The pinned digests of
test_release_bits.py catch any change of a released bit but not which rule broke, and a change
that re-pinning would hide; the conformance test compares the two engines with each other, so a
break in the per-key math they share passes it. Here each rule is asserted on its own, and the
reference (``full_scan``) is the rules as docs/streaming.md states them, computed the slow way:
every key appeared so far evaluated at every trigger, from the thresholds and the trees' keyed
noise, with no prediction, no vectorised state and no code of operator.py.

The breaks each test was seen to catch are listed in mutation/breaks.py (`make breaks` applies
each one to a copy of the tree and checks that its tests fail)."""
import math
from collections import Counter

import numpy as np
import pytest

from sage_tfx.dp_statistics.continual import local
from sage_tfx.dp_statistics.continual.beam import (ContinualReleaseTransform, MicroBatches,
                                                   histograms)
from sage_tfx.dp_statistics.continual.budget import plan
from sage_tfx.dp_statistics.continual.sources import Window
from sage_tfx.dp_statistics.continual.spec import StreamQuery
from sage_tfx.dp_statistics.continual.tree import round_to_grid
from sage_tfx.mechanisms.keyed import KeyedGaussian
from support.continual_beam import collect, conformance_stream, local_batches, replay

NOISE_KEY = bytes(range(32))  # fixed noise in tests only
MICRO_BATCHES = 4
BATCHES = MicroBatches(Window(("w",), ((0.0, 40.0),)), MICRO_BATCHES)  # triggers 10, 20, 30, 40
ENGINES = ["local", "beam"]


def window(mechanism="tree", value_column="v", value_bound=4.0, limit=2):
    query = StreamQuery(key_column="k", unit_column="u", time_column="t",
                        value_column=value_column, value_bound=value_bound,
                        contribution_limit=limit, micro_batches=MICRO_BATCHES, epsilon=20.0,
                        delta=1e-3, mechanism=mechanism)
    return query, plan(20.0, 1e-3, MICRO_BATCHES, limit, value_bound, mechanism=mechanism)


def releases(engine, query, budget, records, tmp_path) -> list[dict]:
    """What `engine` releases at each trigger t (index t - 1): {key: (value, updated)}, every
    key released so far with its latest value, `updated` if released anew at t. Beam emits the
    updates; its histograms() is the per-trigger release."""
    if engine == "local":
        out = []
        local.run_local(query, budget, local_batches(records, BATCHES), str(tmp_path),
                        out.append, noise_key=NOISE_KEY)
        return [{key: (value, updated) for key, value, updated in
                 zip(r.keys.tolist(), r.values.tolist(), r.updated.tolist())} for r in out]
    updates = collect(lambda pipeline: pipeline | replay(records, BATCHES)
                      | ContinualReleaseTransform(query, budget, BATCHES, NOISE_KEY))
    anew = {(u.step, u.key) for u in updates}
    return [{key: (value, (step, key) in anew) for key, value in histogram.items()}
            for step, histogram in enumerate(histograms(updates, MICRO_BATCHES), 1)]


def full_scan(query, budget, records) -> list[dict]:
    """The releases the rules define (docs/streaming.md, paper Algorithms 2-3), as `releases`:
    - a unit's first C records of the window in arrival order (step, event time, input order)
      are kept; a value that is not finite counts 0, is clamped to [-L, L] and rounded to the
      release grid; only kept records make a key appear (its code: order of first appearance);
    - at every trigger every appeared key is evaluated: selected iff the distinct units of its
      round exceed R(l) = tau_l - Z(l), Z its round's selection noise at leaf l = t - origin;
      a selected key starts a new round after t, in which its units count again;
    - a selected key is released with its true prefix (every kept value so far) plus its value
      stream's noise at t rounded to the grid; at the last trigger every key released before
      is released again so; no other key is ever released, and a key not released anew keeps
      its number."""
    total_steps, limit = query.micro_batches, query.contribution_limit
    noise = KeyedGaussian(NOISE_KEY)
    grid, bound = budget.record_grid

    def clean(value):
        if query.value_column is None:
            return 1.0
        value = min(max(value, -query.value_bound), query.value_bound) \
            if math.isfinite(value) else 0.0
        return min(max(float(round_to_grid(value, grid)), -bound), bound)

    def z(selection, stream, length, leaf):
        index = budget.index(selection=selection)
        row = index.add(noise, np.array([stream], np.uint64), np.array([length]))
        return float(index.noise_at(noise, row, np.array([leaf]))[0])

    def stream_id(code, round_):  # operator.tree_ids: the public naming of a key's streams
        return code * (total_steps + 1) + round_

    arriving = sorted((BATCHES.step_of(time), time, order, unit, key, value)
                      for order, (unit, key, value, time) in enumerate(records)
                      if unit and key and BATCHES.step_of(time))
    used, kept, codes = Counter(), [], {}
    for step, _, _, unit, key, value in arriving:
        if used[unit] < limit:
            used[unit] += 1
            kept.append((step, unit, key, clean(value)))
            codes.setdefault(key, len(codes))
    total, units, round_, origin = Counter(), {}, {}, {}
    released, out = {}, []
    for t in range(1, total_steps + 1):
        for step, unit, key, value in kept:
            if step == t:
                total[key] += value
                units.setdefault(key, set()).add(unit)
        updated = set()
        for key in units:
            r, o = round_.get(key, 1), origin.get(key, 0)
            required = budget.thresholds[t - o - 1] - z(True, stream_id(codes[key], r),
                                                        total_steps - o, t - o)
            selected = len(units[key]) > required
            if selected or (t == total_steps and key in released):
                released[key] = total[key] + float(round_to_grid(
                    z(False, stream_id(codes[key], 0), total_steps, t), grid))
                updated.add(key)
            if selected:
                round_[key], origin[key], units[key] = r + 1, t, set()
        out.append({key: (value, key in updated) for key, value in released.items()})
    return out


def rules_stream():
    """The conformance stream (a key released without records by prediction, one released in
    two rounds), with values off the release grid (+1/3), a key "ghost" only in a record its
    unit has no contribution left for, and a key "late" of two units at the last trigger only."""
    records = [(unit, key, value + 1 / 3, time)
               for unit, key, value, time in conformance_stream()]
    return records + [("u70", "a", 1.0, 1.0), ("u70", "b", 1.0, 2.0), ("u70", "ghost", 1.0, 3.0),
                      ("u93", "late", 1.0, 35.0), ("u94", "late", 1.0, 36.0)]


@pytest.fixture(scope="module", params=[(engine, mechanism) for engine in ENGINES
                                        for mechanism in ("tree", "factorization")],
                ids="-".join)
def released(request, tmp_path_factory):
    """(mechanism, what the engine released of rules_stream()): one run per engine and
    mechanism, shared by the tests below (a DirectRunner run costs seconds)."""
    engine, mechanism = request.param
    query, budget = window(mechanism)
    return mechanism, releases(engine, query, budget, rules_stream(),
                               tmp_path_factory.mktemp(f"{engine}-{mechanism}"))


def test_every_trigger_releases_what_a_full_scan_of_the_rules_releases(released):
    """Thresholding per trigger, distinct units per (key, round), new rounds, prediction of a
    key without records, contribution bounding, clamping, rounding to the grid, the value, the
    final pane, persistence: every released bit against `full_scan`."""
    mechanism, out = released
    query, budget = window(mechanism)
    records = rules_stream()
    expected = full_scan(query, budget, records)
    assert out == expected
    # The stream exercises the rules it is meant to (with this noise key): a key released in
    # a second round before the last trigger, every released key released again at the last,
    # and (tree) a key released at a trigger where it has no records and that is not the final
    # pane's: only prediction (Algorithm 4) finds it.
    with_records = {(BATCHES.step_of(time), key) for _, key, _, time in records}
    anew = [(t, key) for t, release in enumerate(expected, 1)
            for key, (_, updated) in release.items() if updated]
    assert max(Counter(key for t, key in anew if t < MICRO_BATCHES).values()) >= 2
    assert expected[-1] and all(updated for _, updated in expected[-1].values())
    predicted = [(t, key) for t, key in anew if (t, key) not in with_records
                 and (t < MICRO_BATCHES or key not in expected[-2])]
    assert predicted or mechanism == "factorization"


def test_a_key_never_selected_is_in_no_release_not_even_the_final_pane(released):
    """Key "late": two units at the last trigger only, below its threshold; "e": two units at
    step 1 only; "ghost": only in a record past its unit's C. None is in any release, though
    the last trigger releases every key released before (the final pane)."""
    _, out = released
    assert not {"late", "e", "ghost"} & set().union(*out)
    assert out[-1] and all(updated for _, updated in out[-1].values())


def test_a_released_key_stays_released_with_its_number_until_it_is_released_anew(released):
    _, out = released
    assert all(updated for _, updated in out[0].values())
    kept_number = 0
    for before, now in zip(out, out[1:]):
        assert set(before) <= set(now)
        for key in set(now) - set(before):
            assert now[key][1], f"{key} appeared without being released anew"
        for key, (value, updated) in now.items():
            if key in before and not updated:
                assert value == before[key][0]
                kept_number += 1
    assert kept_number >= 2  # the stream has keys that keep their number (fixed noise key)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_count_is_one_per_record_and_values_are_bounded_per_unit(tmp_path, engine):
    """COUNT(*): each kept record adds 1 whatever its value column; SUM: a unit adds at most C
    records of at most L each. One key, 40 units with 3 records each of value 100 at step 1
    (C = 2, L = 4): the released value is within the noise of 80 (COUNT) and 320 (SUM), and
    is exactly full_scan's."""
    records = [(f"u{unit}", "a", 100.0, 1.0 + 0.1 * i) for unit in range(40) for i in range(3)]
    for value_column, bound, true_total in ((None, 1.0, 80.0), ("v", 4.0, 320.0)):
        query, budget = window(value_column=value_column, value_bound=bound)
        out = releases(engine, query, budget, records, tmp_path / str(value_column))
        assert out == full_scan(query, budget, records)
        # |noise| < 6 sigma of the largest prefix variance: false failure < 1e-8 (and fixed)
        assert abs(out[0]["a"][0] - true_total) < 6 * budget.value_sigma * math.sqrt(3)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_new_round_is_released_without_records_at_its_predicted_crossing(tmp_path, engine):
    """Algorithm 4 for a round begun by a selection: with no records its count is 0, and it is
    released where 0 > R(l), i.e. where its noise alone crosses the threshold (probability
    <= beta per round). At (1, 0.9), beta = 0.08: 40 keys selected at step 1 (10 units each)
    start 40 rounds, of which a few cross with no data before the last trigger (fixed noise
    key). Keys "twice-i": 3 units each with a record at steps 1 and 2, which count once in
    the round (3 units, not 6 records). Every bit against full_scan."""
    query = StreamQuery(key_column="k", unit_column="u", time_column="t", epsilon=1.0,
                        delta=0.9, contribution_limit=2, micro_batches=MICRO_BATCHES,
                        mechanism="tree")
    budget = plan(1.0, 0.9, MICRO_BATCHES, 2, 1.0, mechanism="tree")
    records = [(f"u{key}-{unit}", f"k{key}", 1.0, 1.0 + unit / 10)
               for key in range(40) for unit in range(10)]
    records += [(f"w{key}-{unit}", f"twice-{key}", 1.0, 10.0 * step + unit / 10)
                for key in range(10) for step in (0, 1) for unit in range(3)]
    out = releases(engine, query, budget, records, tmp_path)
    expected = full_scan(query, budget, records)
    assert out == expected
    with_records = {(BATCHES.step_of(time), key) for _, key, _, time in records}
    predicted = [(t, key) for t in range(2, MICRO_BATCHES)
                 for key, (_, updated) in expected[t - 1].items()
                 if updated and (t, key) not in with_records]
    assert predicted  # the stream exercised it (fixed noise key)
