"""Contribution bounding (aggregators.py steps 1-3): what one unit can touch and add."""
import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregateKind, AggregationQuery,
                                                BoundsScope,
                                                SelectionRule, aggregate, aggregators, plan)
from sage_tfx.randomness import secret_rng


def _heavy_unit_rows():
    """Unit 0 has 3 rows in each of 100 partitions; units 1..100 one row in partition i - 1."""
    units = np.r_[np.zeros(300, dtype=np.int64), np.arange(1, 101)]
    partitions = np.r_[np.repeat(np.arange(100), 3), np.arange(100)]
    return units, partitions


def test_a_unit_with_rows_in_100_partitions_keeps_at_most_c_u_chosen_uniformly():
    units, partitions = _heavy_unit_rows()
    chosen = np.zeros(100)
    runs = 2000
    for seed in range(runs):
        pairs = aggregators.bound_contributions(units, partitions, 100, 4, secret_rng(seed))
        heavy = pairs.pair_kept & (pairs.pair_unit == 0)
        assert heavy.sum() == 4
        # every other unit has one partition: all kept
        assert pairs.pair_kept[pairs.pair_unit != 0].all()
        chosen[pairs.pair_partition[heavy]] += 1
    # Uniform: each partition chosen with probability 4/100. Chi-square goodness of fit at
    # p > 1e-4 (false-failure rate 1e-4 with these fixed seeds, i.e. checked once).
    assert stats.chisquare(chosen).pvalue > 1e-4
    # A deliberately broken sampler (always the first 4 partitions) fails the same check.
    assert stats.chisquare(np.r_[np.full(4, runs), np.zeros(96)]).pvalue < 1e-4


def test_the_operator_counts_the_heavy_unit_in_at_most_c_u_public_partitions(monkeypatch):
    """End to end: with the noise removed (stubbed to zero), COUNT(DISTINCT) over the 100
    public partitions sums to 100 light units + at most 4 for the heavy one."""
    units, partitions = _heavy_unit_rows()
    frame = pd.DataFrame({"uid": units, "key": partitions})
    query = AggregationQuery(("key",), "uid", (Aggregate.count_distinct(), Aggregate.count()),
                             selection=SelectionRule.PUBLIC,
                             public_partitions=tuple((k,) for k in range(100)),
                             max_contributions_per_partition=2)
    monkeypatch.setattr(aggregators, "_noisy", _noiseless)
    release = aggregate(frame, query, plan(query, 1.0, 0.0), seed=3)
    assert release.table["count_distinct"].sum() == 104
    # rows: heavy unit's 3 rows per partition capped at m = 2 in its 4 partitions
    assert release.table["count"].sum() == 100 + 4 * 2
    assert (release.table["count_distinct"] <= 2).all()


@pytest.mark.parametrize("rule", [SelectionRule.LAPLACE_THRESHOLD,
                                  SelectionRule.GAUSSIAN_THRESHOLD,
                                  SelectionRule.TRUNCATED_GEOMETRIC,
                                  SelectionRule.WEIGHTED_GAUSSIAN])
def test_a_partition_whose_pairs_were_all_dropped_is_not_a_selection_candidate(monkeypatch,
                                                                              rule):
    """One unit with rows in 100 partitions, C_u = 4: the selection sees the 4 partitions of
    its kept pairs only. The 96 whose pairs step 2 dropped were candidates of count 0 in the
    local engine: each released with the threshold's tail probability, so one unit made 100
    candidates where the selection's delta is calibrated for 4."""
    frame = pd.DataFrame({"uid": np.zeros(300, dtype=np.int64),
                          "key": np.repeat(np.arange(100), 3)})
    query = AggregationQuery(("key",), "uid", (Aggregate.count(),), selection=rule,
                             max_partitions_contributed=4)
    seen = []

    def recording(query, step, statistic):
        seen.append(np.asarray(statistic))
        return run_selection(query, step, statistic)
    run_selection = aggregators.run_selection
    monkeypatch.setattr(aggregators, "run_selection", recording)
    aggregate(frame, query, plan(query, 1.0, 1e-6), seed=3)
    assert len(seen) == 1 and len(seen[0]) == 4 and (seen[0] > 0).all()


def test_count_and_row_sum_derived_from_avg_are_its_row_count_and_clamped_sum(monkeypatch):
    frame = pd.DataFrame({"uid": [1, 1, 1, 2, 3], "key": [0, 0, 0, 0, 1],
                          "x": [4.0, 30.0, -3.0, 5.0, 2.0]})
    query = AggregationQuery(("key",), "uid", (
        Aggregate.count(), Aggregate(AggregateKind.SUM, "x", 0, 10, scope=BoundsScope.ROW),
        Aggregate(AggregateKind.AVG, "x", 0, 10)), selection=SelectionRule.PUBLIC,
        public_partitions=((0,), (1,)), max_contributions_per_partition=3)
    monkeypatch.setattr(aggregators, "_noisy", _noiseless)
    table = aggregate(frame, query, plan(query, 1.0, 0.0)).table
    assert table["count"].tolist() == [4.0, 1.0]
    assert table["sum_x"].tolist() == [4.0 + 10.0 + 0.0 + 5.0, 2.0]
    assert table["avg_x"].tolist() == [19.0 / 4, 2.0]


def test_a_stray_non_number_in_an_untyped_column_is_null_and_skipped(monkeypatch):
    """Refusing the query because of one row's value would reveal the row: the value is NULL,
    which the SUM skips (not its clamp's midpoint, as before issue 33)."""
    frame = pd.DataFrame({"uid": [1, 2], "key": [0, 0], "x": pd.Series([4.0, "n/a"],
                                                                      dtype=object)})
    query = AggregationQuery(("key",), "uid", (Aggregate(AggregateKind.SUM, "x", 0, 10),),
                             selection=SelectionRule.PUBLIC, public_partitions=((0,),))
    monkeypatch.setattr(aggregators, "_noisy", _noiseless)
    assert aggregate(frame, query, plan(query, 1.0, 0.0)).table["sum_x"].tolist() == [4.0]


def _noiseless(query, values, sensitivity, epsilon, delta, l2_sensitivity=None):
    from dp_accounting import dp_event
    from sage_tfx.mechanisms import Release
    return Release(np.asarray(values, dtype=np.float64), dp_event.NoOpDpEvent())


def test_a_units_sum_is_clamped_into_its_bounds_and_rows_are_capped_at_m():
    query = AggregationQuery(("k",), "u", (Aggregate(AggregateKind.SUM, "x", -5.0, 20.0),
                                           Aggregate(AggregateKind.AVG, "x", 0.0, 10.0)),
                             max_contributions_per_partition=3)
    # pair 0: 6 rows summing to 600; pair 1: 2 rows summing to -1000; pair 2: a NaN row
    pair_of_row = np.array([0, 0, 0, 0, 0, 0, 1, 1, 2])
    rank = np.array([0, 1, 2, 3, 4, 5, 0, 1, 0])
    x = np.array([100.0] * 6 + [-500.0, -500.0, np.nan])
    out = aggregators.pair_contributions(query, {"sum_x": (-5.0, 20.0), "avg_x": (0.0, 10.0)},
                                         pair_of_row, rank, 3, {"x": x}, np.array([1, 4, 2]))
    spec = aggregators.layout(query)
    sums = out[:, spec.blocks["sum_x"].start]
    assert sums.tolist() == [20.0, -5.0, 0.0]  # a pair whose values are all NULL adds nothing
    assert out[:, aggregators.Layout.ROWS].tolist() == [3, 2, 1]
    # each pair's selection weight: 1 / sqrt(the number of pairs its unit kept)
    assert out[:, aggregators.Layout.WEIGHT].tolist() == [1.0, 0.5, 1 / np.sqrt(2)]
    # the AVG's own count of non-NULL rows, then the centred sums of at most m rows, each
    # clamped into [0, 10] (mid 5, so in [-15, 15]); the NULL row adds to neither
    avg = spec.blocks["avg_x"].start
    assert out[:, avg].tolist() == [3, 2, 0]
    assert out[:, avg + 1].tolist() == [15.0, -10.0, 0.0]


def test_a_row_scoped_sum_without_noise_is_the_sum_of_clamped_rows(monkeypatch):
    """Before issue 33 a row-scoped SUM's block was overwritten by its centred sum: the release
    was off by mid * rows (hidden by the noise in the KS tests)."""
    frame = pd.DataFrame({"uid": [1, 1, 2], "key": 0, "x": [1.0, 9.0, 4.0]})
    query = AggregationQuery(("key",), "uid", (
        Aggregate(AggregateKind.SUM, "x", 2.0, 6.0, scope=BoundsScope.ROW),),
        selection=SelectionRule.PUBLIC, public_partitions=((0,),))
    monkeypatch.setattr(aggregators, "_noisy", _noiseless)
    assert aggregate(frame, query, plan(query, 1.0, 0.0)).table["sum_x"].tolist() == [12.0]


def test_without_noise_the_moments_and_quantiles_are_the_clamped_rows_statistics(monkeypatch):
    """The post-processing of AVG / VAR / STDDEV / quantiles, noise removed: the statistics of
    the rows clamped into [0, 10] (m large enough to keep every row)."""
    frame = pd.DataFrame({"uid": [1, 1, 2, 2, 3, 3, 3], "key": 0,
                          "x": [1.0, 3.0, 12.0, 2.0, -4.0, 6.0, 7.0]})
    clamped = np.clip(frame["x"].to_numpy(), 0, 10)
    query = AggregationQuery(("key",), "uid", (
        Aggregate(AggregateKind.AVG, "x", 0, 10), Aggregate(AggregateKind.VAR, "x", 0, 10),
        Aggregate(AggregateKind.STDDEV, "x", 0, 10), Aggregate.median("x", 0, 10),
        Aggregate.minimum("x", 0, 10), Aggregate.maximum("x", 0, 10)),
        selection=SelectionRule.PUBLIC, public_partitions=((0,),))
    monkeypatch.setattr(aggregators, "_noisy", _noiseless)
    row = aggregate(frame, query, plan(query, 1.0, 0.0)).table.iloc[0]
    assert row["avg_x"] == pytest.approx(clamped.mean())
    assert row["var_x"] == pytest.approx(clamped.var())
    assert row["stddev_x"] == pytest.approx(clamped.std())
    width = 10 / aggregators.QUANTILE_BRANCHING ** aggregators.QUANTILE_LEVELS  # to a leaf
    assert abs(row["median_x"] - np.median(clamped)) <= width
    assert row["min_x"] == pytest.approx(0.0) and row["max_x"] == pytest.approx(10.0)


def _tree(*leaf_counts):
    """Tree blocks (one row per argument) from {leaf: count}: each leaf's count added to its
    bucket at every level."""
    leaves = aggregators.QUANTILE_BRANCHING ** aggregators.QUANTILE_LEVELS
    nodes = np.zeros((len(leaf_counts), aggregators.QUANTILE_TREE_NODES))
    for row, counts in enumerate(leaf_counts):
        for leaf, count in counts.items():
            nodes[row, aggregators.tree_nodes(np.array([leaf + 0.5]), 0.0, leaves)[0]] += count
    return nodes, 0.0, float(leaves)


def test_quantiles_descend_the_tree_and_interpolate_within_the_leaf():
    # row 0: all mass in the first leaf [0, 1); row 1: half in [2, 3), half in [37, 38);
    # row 2: no positive count (all noise below zero is clipped): a uniform descent
    nodes, low, high = _tree({0: 10.0}, {2: 4.0, 37: 4.0}, {})
    nodes[2] = -1.0
    # a median between the two halves: the lower edge of the mass past half the total
    np.testing.assert_allclose(aggregators.quantile_from_tree(nodes, 0.5, low, high),
                               [0.5, 37.0, 32.0])
    np.testing.assert_allclose(aggregators.quantile_from_tree(nodes, 0.25, low, high),
                               [0.25, 2.5, 16.0])
    np.testing.assert_allclose(aggregators.quantile_from_tree(nodes, 0.0, low, high),
                               [0.0, 2.0, 0.0])
    np.testing.assert_allclose(aggregators.quantile_from_tree(nodes, 1.0, low, high),
                               [1.0, 38.0, 64.0])


def test_each_row_is_counted_once_per_level():
    nodes, _, _ = _tree({0: 1.0, 63: 2.0})
    assert nodes.sum() == 3.0 * aggregators.QUANTILE_LEVELS


def test_dp_bounds_keep_the_buckets_whose_noisy_count_passes_b_ln_of_b_over_2_beta(
        monkeypatch):
    """With the noise stubbed to zero, the threshold is the closed form t = b ln(B / (2 beta)),
    b = values per unit / epsilon, B = 121 buckets, beta = 1e-4: a bucket at t + 1 is kept, one
    at t - 1 is not."""
    from sage_tfx import mechanisms
    monkeypatch.setattr(mechanisms, "laplace", lambda values, **_: mechanisms.Release(
        np.asarray(values, dtype=np.float64), None))
    b = 32 / 0.5
    t = b * np.log(121 / (2 * 1e-4))
    counts = aggregators.log_histogram(np.array([10.0, 1000.0, -3.0]))
    counts[counts > 0] = [t + 1, t + 1, t - 1]  # buckets of -3, 10 and 1000, in index order
    bounds, _ = aggregators.bounds_from_histogram(counts, 32, 0.5)
    assert bounds == (-4.0, 16.0)


@pytest.mark.parametrize("values, expected", [((-60.0, -10.0), (-64.0, 0.0)),
                                              ((-3.0, 5.0), (-4.0, 8.0))])
def test_inferred_bounds_of_negative_and_mixed_values(values, expected):
    rng = np.random.default_rng(1)
    frame = pd.DataFrame({"u": np.arange(20_000), "k": 0, "x": rng.uniform(*values, 20_000)})
    query = AggregationQuery(("k",), "u", (Aggregate(AggregateKind.AVG, "x"),),
                             selection=SelectionRule.PUBLIC, public_partitions=((0,),))
    # false failure: an empty bucket passes with probability < 1e-4 (the threshold's design)
    assert aggregate(frame, query, plan(query, 2.0, 0.0)).bounds["avg_x"] == expected


@pytest.mark.parametrize("kind", [AggregateKind.SUM, AggregateKind.AVG])
def test_inferred_bounds_cover_the_bulk_of_the_data(kind):
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"u": np.arange(20_000), "k": rng.integers(0, 4, 20_000),
                          "x": rng.uniform(10.0, 60.0, 20_000)})
    query = AggregationQuery(("k",), "u", (Aggregate(kind, "x"),),
                             selection=SelectionRule.PUBLIC,
                             public_partitions=tuple((k,) for k in range(4)))
    budget = plan(query, 2.0, 0.0)
    assert [s.name for s in budget.steps] == [f"bounds:{kind.value}_x", f"{kind.value}_x"]
    release = aggregate(frame, query, budget, seed=0)
    # With 20,000 values, bucket [32, 64) passes and no bucket above 64 does, except with
    # probability < 1e-4 (the threshold's design, the false-failure rate): the bounds are [0, 64].
    assert release.bounds == {f"{kind.value}_x": (0.0, 64.0)}
    true = frame.groupby("k")["x"].agg("sum" if kind is AggregateKind.SUM else "mean")
    # Laplace errors: SUM's scale is C * 64 / 1 = 256 on sums near 175,000 (3% is 20 scales);
    # AVG's noisy sum has scale 4 * 8 * 32 / 0.5 = 2048 over ~5,000 rows, 0.41 on the mean
    # (20% of 35 is 17 scales): false failure < 1e-6 over the 4 partitions.
    assert np.allclose(release.table[f"{kind.value}_x"], true.to_numpy(),
                       rtol=0.2 if kind is AggregateKind.AVG else 0.03)


class _IdentityShuffle:
    """An rng whose shuffle is the identity: the grouping must then be the stable sort."""

    def permutation(self, size):
        return np.arange(size)


def test_equal_keys_keep_their_shuffled_order_on_both_sorting_paths():
    # Any other rule for equal keys (an unstable sort) would order a key's rows by where the
    # other keys' rows sit (other units' data). Keys 0-2: packed with the position and sorted;
    # with 2^60 among them: too wide to pack, a stable argsort.
    from sage_tfx.dp_statistics.aggregation.aggregators import _random_grouping

    keys = np.random.default_rng(0).integers(0, 3, 200)
    for keys in (keys, np.where(keys == 2, 2 ** 60, keys)):
        order, ordered = _random_grouping(keys, _IdentityShuffle())
        assert np.array_equal(order, np.argsort(keys, kind="stable"))
        assert np.array_equal(ordered, keys[order]) and ordered.dtype == keys.dtype


def test_stable_argsort_is_numpys_stable_argsort():
    """Contribution bounding ranks rows through stable_argsort (the streaming operator's
    kept_mask ranks a unit's records in arrival order): the stable argsort's permutation,
    repeated and negative values included, and where a packed value would not fit in 64 bits."""
    from sage_tfx.dp_statistics.aggregation.aggregators import stable_argsort, stable_sort

    rng = np.random.default_rng(3)
    for values in (rng.integers(0, 40, 3000), rng.integers(-6, 6, 50), np.zeros(0, np.int64),
                   np.array([2 ** 62, 1, 2 ** 62, 0]), np.array([-2 ** 62, 2 ** 62, 0, -2 ** 62]),
                   rng.integers(0, 3, 9).astype(np.int32), np.array([5])):
        assert np.array_equal(stable_argsort(values), np.argsort(values, kind="stable"))
        order, ordered = stable_sort(values)
        assert np.array_equal(ordered, values[order]) and ordered.dtype == values.dtype


# --- issue 29: sums cannot become infinite ---------------------------------------------------

@pytest.mark.parametrize("aggregate, bound", [
    (Aggregate(AggregateKind.SUM, "x", 0, 1e308), "[0, 1e+308]"),
    (Aggregate(AggregateKind.SUM, "x", -2e300, 2e300, scope=BoundsScope.ROW),
     "[-2e+300, 2e+300]"),
    (Aggregate(AggregateKind.VAR, "x", 0, 1e160), "[0, 1e+160]"),
    (Aggregate(AggregateKind.AVG, "x", -1.7e308, 1.7e308), "[-1.7e+308, 1.7e+308]")])
def test_bounds_whose_worst_case_is_not_finite_are_refused_when_the_query_is_built(
        aggregate, bound):
    from sage_tfx.dp_statistics.aggregation import QueryError

    with pytest.raises(QueryError, match=rf"aggregate '{aggregate.output_name}': bounds "
                                         rf"{re.escape(bound)} let one unit move"):
        AggregationQuery(("k",), "uid", (aggregate,), max_partitions_contributed=1).check()


def test_a_noise_scale_beyond_the_largest_sum_is_refused_by_the_plan():
    from sage_tfx.dp_statistics.aggregation import QueryError

    query = AggregationQuery(("k",), "uid", (Aggregate(AggregateKind.SUM, "x", 0, 1e300),),
                             max_partitions_contributed=1, selection=SelectionRule.PUBLIC,
                             public_partitions=(("a",),))
    plan(query, 1.0, 0.0)  # scale 1e300: accepted
    with pytest.raises(QueryError, match=r"aggregate 'sum_x': bounds \[0, 1e\+300\] at this "
                                         r"step's epsilon need noise of scale 1e\+302"):
        plan(query, 0.01, 0.0)


def test_partition_sums_saturate_and_move_by_at_most_one_contribution():
    """Sums of huge contributions used to overflow to inf (the noise then refused to run: a
    charged query failing or not on the data). Saturated sums stay in [-2^1000, 2^1000] and
    removing any one contribution moves them by at most its size (the sensitivity argument
    of aggregators.saturated)."""
    limit = 2.0 ** 1000
    rng = np.random.default_rng(3)
    contributions = rng.choice([-1.0, 1.0], size=(200, 1)) * rng.uniform(0, 1.7e308, (200, 1))
    partitions = rng.integers(0, 3, 200)
    sums = aggregators.sum_by_partition(partitions, contributions, 3, signed=(0,))
    assert np.isfinite(sums).all() and (np.abs(sums) <= limit).all()
    for removed in range(200):
        keep = np.arange(200) != removed
        neighbour = aggregators.sum_by_partition(partitions[keep], contributions[keep], 3,
                                                 signed=(0,))
        change = np.abs(sums - neighbour).sum()
        assert change <= abs(contributions[removed, 0]) * (1 + 1e-12)
    # two units each at the bound 2^999 in one partition: saturated at 2^1000, not 2^1000 + ...
    for signed in ((0,), ()):  # a column of counts (never negative) saturates alike
        assert aggregators.sum_by_partition(np.zeros(3, np.int64), np.full((3, 1), 2.0 ** 999),
                                            1, signed)[0, 0] == limit


def test_factorize_labels_the_same_groups_as_pandas_and_integers_by_value():
    """local.factorize (issue 48, item 3): numpy integers over a span of at most 4x the rows
    get codes by value (one pass, no hashing); anything else is pandas' factorize. Either way
    two rows share a code iff they share a value."""
    from sage_tfx.dp_statistics.aggregation.local import factorize

    rng = np.random.default_rng(4)
    for values in (rng.integers(-50, 50, 1000), rng.integers(0, 2 ** 40, 1000),
                   pd.Series(rng.integers(0, 9, 100)).astype("Int64").mask(
                       rng.random(100) < 0.2), np.array(["b", "a", "b", None], dtype=object)):
        codes, distinct = factorize(values)
        expected, uniques = pd.factorize(values, use_na_sentinel=False)
        assert distinct == len(uniques)
        # the same partition of the rows: code -> expected code is a bijection
        assert len(set(zip(codes.tolist(), expected.tolist()))) == distinct
    assert factorize(np.array([3, 1, 2, 1]))[0].tolist() == [2, 0, 1, 0]  # by value
    assert factorize(np.array([30, 10, 20, 10]))[0].tolist() == [0, 1, 2, 1]  # span 20 > 16


@pytest.mark.parametrize("scope", [BoundsScope.ROW, BoundsScope.UNIT])
def test_the_rows_the_local_engine_reads_give_the_contributions_of_every_kept_row(scope):
    """local.read_rows leaves out the rows step 3 skips (beyond a pair's first m, unless a
    unit-scoped SUM reads every row): the contribution vectors are bit for bit those of every
    row of the kept pairs, NULLs and pairs the unit dropped included."""
    from sage_tfx.dp_statistics.aggregation import local

    rng = np.random.default_rng(11)
    units, partitions = rng.integers(0, 40, 3000), rng.integers(0, 30, 3000)
    values = rng.normal(5.0, 4.0, 3000)
    values[::7] = np.nan
    query = AggregationQuery(
        ("key",), "uid", (Aggregate.count(), Aggregate.count("x", name="n"),
                          Aggregate(AggregateKind.SUM, "x", -2.0, 12.0, scope=scope),
                          Aggregate(AggregateKind.AVG, "x", 0.0, 10.0),
                          Aggregate.median("x", 0.0, 10.0)),
        max_partitions_contributed=3, max_contributions_per_partition=2)
    bounds = {a.output_name: (a.low, a.high) for a in query.aggregates if a.bounded}
    pairs = aggregators.bound_contributions(units, partitions, 30, 3, secret_rng(0))
    assert not pairs.pair_kept.all()  # some unit dropped pairs
    kept_pairs = pairs.pair_kept.sum()
    partitions_of_unit = np.bincount(pairs.pair_unit[pairs.pair_kept])[
        pairs.pair_unit[pairs.pair_kept]]

    def contributions(pair_of_row, rank_in_pair, order):
        return aggregators.pair_contributions(query, bounds, pair_of_row, rank_in_pair,
                                              kept_pairs, {"x": values[order]},
                                              partitions_of_unit)

    every = pairs.pair_kept[pairs.pair_of_row]
    expected = contributions((np.cumsum(pairs.pair_kept) - 1)[pairs.pair_of_row[every]],
                             pairs.rank_in_pair[every], pairs.row_order[every])
    pair_of_row, rank_in_pair, order = local.read_rows(query, pairs)
    assert (rank_in_pair < 2).all() == (scope is BoundsScope.ROW)
    assert np.array_equal(contributions(pair_of_row, rank_in_pair, order), expected)


def test_units_within_their_bound_keep_every_pair_without_a_draw():
    """When no unit has more than C_u pairs, every pair is kept whatever the order, and
    bound_contributions draws only the rows' order (one permutation): local.accumulate draws
    nothing after it, so a seeded run's bits are those of drawing the pairs' order too."""
    units, partitions = np.repeat(np.arange(50), 6), np.tile(np.repeat(np.arange(3), 2), 50)
    rng, reference = np.random.default_rng(4), np.random.default_rng(4)
    pairs = aggregators.bound_contributions(units, partitions, 3, 3, rng)
    assert pairs.pair_kept.all() and pairs.pair_kept.size == 150
    reference.permutation(units.size)
    assert rng.bit_generator.state == reference.bit_generator.state
    dropping = aggregators.bound_contributions(units, partitions, 3, 2, np.random.default_rng(4))
    assert dropping.pair_kept.sum() == 100
