"""Each aggregate's error has the law its noise scale says (KS tests), and partition selection
releases a unit's own partitions no more often than its delta allows.

False-failure rates: each KS assertion "the law matches" fails for a correct operator with
probability 1e-4 (p-value threshold); each binomial bound with probability <= 1e-6. The noise is
OpenDP's (CSPRNG, no seed), so these are random runs; the oracles are seeded numpy draws."""
import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from sage_tfx import mechanisms
from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregateKind, AggregationQuery,
                                                BoundsScope, NoiseKind, SelectionRule, aggregate, aggregators,
                                                plan)
from sage_tfx.mechanisms import selection as selection_module

P_VALUE = 1e-4
PARTITIONS, UNITS_PER_PARTITION, C, M = 600, 5, 4, 8
LOW, HIGH = 0.0, 10.0


def _identical_partitions() -> pd.DataFrame:
    """600 partitions, each with 5 units of 2 rows (values j + 1 and j + 1.5 for unit j): no
    unit exceeds C_u or m, so every partition's pre-noise aggregates are known and equal."""
    keys = np.repeat(np.arange(PARTITIONS), UNITS_PER_PARTITION * 2)
    units = np.repeat(np.arange(PARTITIONS * UNITS_PER_PARTITION), 2)
    unit_in_partition = np.tile(np.repeat(np.arange(UNITS_PER_PARTITION), 2), PARTITIONS)
    values = unit_in_partition + 1 + np.tile([0.0, 0.5], PARTITIONS * UNITS_PER_PARTITION)
    return pd.DataFrame({"key": keys, "uid": units, "x": values})


FRAME = _identical_partitions()
ROW_VALUES = FRAME["x"].to_numpy()[:UNITS_PER_PARTITION * 2]


def _run(aggregates, noise=NoiseKind.LAPLACE, epsilon=1.0, delta=0.0):
    query = AggregationQuery(("key",), "uid", aggregates, max_partitions_contributed=C,
                             max_contributions_per_partition=M, selection=SelectionRule.PUBLIC,
                             public_partitions=tuple((k,) for k in range(PARTITIONS)),
                             noise=noise)
    budget = plan(query, epsilon, delta)
    return budget, aggregate(FRAME, query, budget)


ADDITIVE = (Aggregate.count(), Aggregate.count_distinct(),
            Aggregate(AggregateKind.SUM, "x", -20.0, 30.0),
            Aggregate(AggregateKind.SUM, "x", -2.0, 3.0, scope=BoundsScope.ROW, name="row_sum"))
# true value and per-partition sensitivity Delta of each (a row-scoped SUM: m rows at max |L|, |U|)
ADDITIVE_TRUTH = {"count": (10.0, M), "count_distinct": (5.0, 1.0),
                  "sum_x": (ROW_VALUES.sum(), 30.0),
                  "row_sum": (np.clip(ROW_VALUES, -2.0, 3.0).sum(), M * 3.0)}


def test_count_count_distinct_and_sum_errors_are_laplace_at_c_u_times_delta_over_epsilon():
    budget, release = _run(ADDITIVE)
    for name, (truth, sensitivity) in ADDITIVE_TRUTH.items():
        scale = C * sensitivity / budget.step(name).epsilon
        errors = release.table[name].to_numpy() - truth
        assert stats.kstest(errors, stats.laplace(scale=scale).cdf).pvalue > P_VALUE, name
        # The check has power: a law at half the scale (noise calibrated as if a unit touched
        # one partition, at C = 2) is rejected.
        assert stats.kstest(errors, stats.laplace(scale=scale / 2).cdf).pvalue < P_VALUE, name


def test_gaussian_noise_uses_l2_sensitivity_sqrt_c_u_times_delta():
    budget, release = _run(ADDITIVE[:1], noise=NoiseKind.GAUSSIAN, delta=1e-6)
    step = budget.step("count")
    sigma = mechanisms.gaussian_sigma(l2_sensitivity=math.sqrt(C) * M, epsilon=step.epsilon,
                                      delta=step.delta)
    errors = release.table["count"].to_numpy() - 10.0
    assert stats.kstest(errors, stats.norm(scale=sigma).cdf).pvalue > P_VALUE
    assert stats.kstest(errors, stats.norm(scale=sigma * 2).cdf).pvalue < P_VALUE


def test_a_broken_operator_that_ignores_c_u_is_caught(monkeypatch):
    """Deliberately broken: noise calibrated on one partition's sensitivity (no C_u factor)."""
    original = aggregators._noisy

    def one_partition(query, values, sensitivity, epsilon, delta):
        return original(query, values, sensitivity / query.max_partitions_contributed,
                        epsilon, delta)
    monkeypatch.setattr(aggregators, "_noisy", one_partition)
    budget, release = _run(ADDITIVE[:1])
    errors = release.table["count"].to_numpy() - 10.0
    scale = C * M / budget.step("count").epsilon
    assert stats.kstest(errors, stats.laplace(scale=scale).cdf).pvalue < P_VALUE


def _oracle_moments(epsilons, draws, rng):
    """AVG / VAR's noisy moments of the identical partitions, noised by seeded numpy with the
    scales the derivation (aggregators.py) gives: rows N at C m / e_N, centred sum S at
    C m h / e_S, and VAR's variance read from them and the centred squares at
    C m h^2 / 2 / e_Q, ``epsilons`` = (e_N, e_S, e_Q): (N, S, variance)."""
    count_epsilon, sum_epsilon, squares_epsilon = epsilons
    mid, half = (LOW + HIGH) / 2, (HIGH - LOW) / 2
    centred = ROW_VALUES - mid
    rows = len(ROW_VALUES) + rng.laplace(0, C * M / count_epsilon, draws)
    sums = centred.sum() + rng.laplace(0, C * M * half / sum_epsilon, draws)
    squares = (centred ** 2 - half ** 2 / 2).sum() + rng.laplace(0, C * M * half ** 2 / 2
                                                                  / squares_epsilon, draws)
    count = np.maximum(rows, 1.0)
    mean = np.clip(mid + sums / count, LOW, HIGH)
    variance = np.clip(squares / count + half ** 2 / 2 - (mean - mid) ** 2, 0, half ** 2)
    return rows, sums, variance


def test_avg_var_and_stddev_follow_the_noisy_count_sum_and_squares_law():
    """AVG's count gets 41/100 of its epsilon and its centred sum 59/100 (budget.
    MEAN_COUNT_FRACTION): COUNT(x) and the row-scoped SUM with AVG's bounds are its N and
    mid N + S (budget.derived_from), and the released AVG is aggregators.mean_estimate of
    them (post-processing); VAR and STDDEV split theirs in thirds."""
    aggregates = (Aggregate(AggregateKind.AVG, "x", LOW, HIGH),
                  Aggregate.count("x", name="n"),
                  Aggregate(AggregateKind.SUM, "x", LOW, HIGH, scope=BoundsScope.ROW,
                            name="total"),
                  Aggregate(AggregateKind.VAR, "x", LOW, HIGH),
                  Aggregate(AggregateKind.STDDEV, "x", LOW, HIGH))
    budget, release = _run(aggregates, epsilon=30.0)
    table = release.table
    rng = np.random.default_rng(0)
    avg = budget.step("avg_x").epsilon
    rows, sums, _ = _oracle_moments((0.41 * avg, 0.59 * avg, 1.0), 20_000, rng)
    _, _, variance = _oracle_moments([budget.step("var_x").epsilon / 3] * 3, 20_000, rng)
    _, _, stddev_variance = _oracle_moments([budget.step("stddev_x").epsilon / 3] * 3,
                                            20_000, rng)
    mid, half = (LOW + HIGH) / 2, (HIGH - LOW) / 2
    released_sums = table["total"].to_numpy() - mid * table["n"].to_numpy()
    for name, released, oracle in (("n", table["n"], rows), ("total", released_sums, sums),
                                   ("var_x", table["var_x"], variance),
                                   ("stddev_x", table["stddev_x"], np.sqrt(stddev_variance))):
        assert stats.ks_2samp(released, oracle).pvalue > P_VALUE, name
    # power: the centred sum's law at half the noise is rejected
    assert stats.ks_2samp(released_sums, _oracle_moments(
        (0.82 * avg, 1.18 * avg, 1.0), 20_000, rng)[1]).pvalue < P_VALUE
    laws = [aggregators.accuracy.NoiseLaw("laplace", C * M * scale / share)
            for scale, share in ((1.0, 0.41 * avg), (half, 0.59 * avg))]
    estimate, _ = aggregators.mean_estimate(table["n"].to_numpy(), released_sums, half, *laws)
    np.testing.assert_allclose(table["avg_x"], np.clip(mid + estimate, LOW, HIGH), rtol=1e-9)


def test_quantiles_follow_the_noisy_tree_law():
    """Every tree count gets Laplace noise at C H m / epsilon (a row is in one bucket per
    level); a tree at a third of that noise is rejected."""
    budget, release = _run((Aggregate.median("x", LOW, HIGH),), epsilon=20.0)
    counts = np.bincount(aggregators.tree_nodes(ROW_VALUES, LOW, HIGH).ravel(),
                         minlength=aggregators.QUANTILE_TREE_NODES).astype(float)
    scale = C * aggregators.QUANTILE_LEVELS * M / budget.step("median_x").epsilon
    rng = np.random.default_rng(1)
    noisy = counts + rng.laplace(0, scale, (20_000, counts.size))
    oracle = aggregators.quantile_from_tree(noisy, 0.5, LOW, HIGH)
    assert stats.ks_2samp(release.table["median_x"], oracle).pvalue > P_VALUE
    broken = aggregators.quantile_from_tree(
        counts + rng.laplace(0, scale / 3, (20_000, counts.size)), 0.5, LOW, HIGH)
    assert stats.ks_2samp(release.table["median_x"], broken).pvalue < P_VALUE


def test_a_quantile_of_a_large_partition_is_within_a_bucket_and_noise():
    rng = np.random.default_rng(2)
    frame = pd.DataFrame({"key": 0, "uid": np.arange(20_000), "x": rng.uniform(0, 100, 20_000)})
    query = AggregationQuery(("key",), "uid", (Aggregate.median("x", 0.0, 100.0),
                                               Aggregate.minimum("x", 0.0, 100.0),
                                               Aggregate.maximum("x", 0.0, 100.0)),
                             selection=SelectionRule.PUBLIC, public_partitions=((0,),))
    table = aggregate(frame, query, plan(query, 3.0, 0.0)).table
    # Laplace scale 4 * 8 / 1 = 32 per bucket of ~312 values: the median's cumulative noise over
    # 32 buckets has sd ~ 256, i.e. < 1.3 buckets (2 of 100); |error| < 6 fails w.p. < 1e-6.
    assert abs(table["median_x"][0] - 50.0) < 6.0
    assert table["min_x"][0] < 6.0 and table["max_x"][0] > 94.0


def _own_partitions(units: int) -> pd.DataFrame:
    """Each unit alone in C partitions of its own (one row each)."""
    return pd.DataFrame({"key": np.arange(units * C), "uid": np.repeat(np.arange(units), C)})


@pytest.mark.parametrize("rule", [SelectionRule.LAPLACE_THRESHOLD,
                                  SelectionRule.GAUSSIAN_THRESHOLD,
                                  SelectionRule.TRUNCATED_GEOMETRIC])
def test_a_units_own_partitions_are_released_at_most_with_the_selection_delta(rule):
    units, delta = 2000, 0.02
    query = AggregationQuery(("key",), "uid", (Aggregate.count_distinct(),),
                             max_partitions_contributed=C, selection=rule)
    release = aggregate(_own_partitions(units), query, plan(query, 1.0, delta))
    exposed = release.table["key"].floordiv(C).nunique()  # units with a partition shown
    allowed = release.additional_delta
    assert allowed <= delta
    assert exposed <= stats.binom.isf(1e-6, units, allowed)


def test_a_threshold_set_too_low_is_caught(monkeypatch):
    """Deliberately broken: tau 6 lower than the derivation's (4.5 times the keep rate)."""
    original = selection_module.laplace_threshold_tau
    monkeypatch.setattr(selection_module, "laplace_threshold_tau",
                        lambda **kwargs: original(**kwargs) - 6)
    units = 2000
    query = AggregationQuery(("key",), "uid", (Aggregate.count_distinct(),),
                             max_partitions_contributed=C,
                             selection=SelectionRule.LAPLACE_THRESHOLD)
    release = aggregate(_own_partitions(units), query, plan(query, 1.0, 0.02))
    exposed = release.table["key"].floordiv(C).nunique()
    # expected ~ 170 against a bound of ~ 70; it stays under it with probability < 1e-6
    assert exposed > stats.binom.isf(1e-6, units, release.additional_delta)


def test_the_weighted_selection_releases_keep_bits_only_and_values_are_drawn_apart(
        monkeypatch):
    """The weighted Gaussian's noise (mechanisms/keyed.py, not OpenDP) may only decide which
    partitions are kept (selection.weighted_gaussian_selection says why): with every partition
    far above the threshold, two runs whose selection noise has different keys release the same
    values, all drawn by the (here seeded) OpenDP-based mechanisms, COUNT(DISTINCT) included
    as a step of its own; the selection returns no noisy value."""
    from sage_tfx.mechanisms import additive
    from sage_tfx.mechanisms.keyed import KEY_BYTES, KeyedGaussian
    from support.seeded_noise import seeded_measurement

    frame = pd.DataFrame({"key": np.repeat(np.arange(5), 400), "uid": np.arange(2000),
                          "x": np.linspace(0.0, 10.0, 2000)})
    query = AggregationQuery(("key",), "uid", (
        Aggregate(AggregateKind.COUNT_DISTINCT, name="units"),
        Aggregate(AggregateKind.AVG, "x", LOW, HIGH, name="mean")),
        selection=SelectionRule.WEIGHTED_GAUSSIAN)
    budget = plan(query, 1.0, 1e-6)
    assert "units" in [step.name for step in budget.steps]  # not read off the selection
    released = []
    for key_byte, measurement in ((1, seeded_measurement()), (2, seeded_measurement())):
        monkeypatch.setattr(selection_module.KeyedGaussian, "fresh", classmethod(
            lambda cls, key=bytes([key_byte]) * KEY_BYTES: KeyedGaussian(key)))
        monkeypatch.setattr(additive, "_measurement", measurement)  # the same seed each run
        released.append(aggregate(frame, query, budget, seed=1).table)
    pd.testing.assert_frame_equal(released[0], released[1])
    assert len(released[0]) == 5
    kept = selection_module.weighted_gaussian_selection(
        np.full(3, 100.0), max_partitions_per_unit=4, epsilon=1.0, delta=1e-6).value
    assert kept.keep.all() and kept.noisy_unit_counts is None


# --- AVG's budget split and its shrinkage (issue 48) --------------------------------------------

def test_avgs_count_gets_41_hundredths_of_its_budget_and_its_sum_the_rest():
    """The plan's event for an AVG is its count's Laplace at 41/100 of the step's epsilon and
    its centred sum's at 59/100 (budget.MEAN_COUNT_FRACTION: the split that minimises the
    mean's error averaged over where the mean lies in the bounds), not an even split."""
    query = AggregationQuery(("key",), "uid", (Aggregate(AggregateKind.AVG, "x", LOW, HIGH),),
                             selection=SelectionRule.PUBLIC, public_partitions=((0,),))
    step = plan(query, 1.0, 0.0).step("avg_x")
    count, total = step.event.events
    assert (1.0 / count.noise_multiplier, 1.0 / total.noise_multiplier) == pytest.approx(
        (0.41 * step.epsilon, 0.59 * step.epsilon), rel=1e-12)


def _small_partitions(rng) -> pd.DataFrame:
    """600 partitions of 6 units with one row each, values uniform on [1, 4] (true mean 2.5,
    against the bounds' midpoint 5): at epsilon 1 the noise of the centred sum (scale
    C m h / 0.59 = 271 per partition) dwarfs the 6 rows."""
    keys = np.repeat(np.arange(PARTITIONS), 6)
    return pd.DataFrame({"key": keys, "uid": np.arange(keys.size),
                         "x": rng.uniform(1.0, 4.0, keys.size)})


def _mean_query(partitions: int) -> AggregationQuery:
    aggregates = (Aggregate(AggregateKind.AVG, "x", LOW, HIGH, name="mean"),
                  Aggregate.count("x", name="n"),
                  Aggregate(AggregateKind.SUM, "x", LOW, HIGH, scope=BoundsScope.ROW,
                            name="total"))
    return AggregationQuery(("key",), "uid", aggregates, max_partitions_contributed=C,
                            max_contributions_per_partition=M, selection=SelectionRule.PUBLIC,
                            public_partitions=tuple((k,) for k in range(partitions)))


def _midpoint_shrunk(table: pd.DataFrame, budget) -> np.ndarray:
    """The per-group minimax estimate (aggregators.mean_shrinkage) from the released N and
    mid N + S: mid + t S / max(N, 1), t = h^2 / (h^2 + v / N^2), v = sd_S^2 + h^2 sd_N^2."""
    mid, half = (LOW + HIGH) / 2, (HIGH - LOW) / 2
    count_event, sum_event = budget.step("mean").event.events
    sd_n = math.sqrt(2) * count_event.noise_multiplier * C * M
    sd_s = math.sqrt(2) * sum_event.noise_multiplier * C * M * half
    rows = table["n"].to_numpy()
    count = np.maximum(rows, 1.0)
    shrinkage = half ** 2 / (half ** 2 + (sd_s ** 2 + half ** 2 * sd_n ** 2) / count ** 2)
    return np.clip(mid + shrinkage * (table["total"].to_numpy() - mid * rows) / count, LOW, HIGH)


def test_a_noisy_mean_is_pooled_with_the_other_groups_and_is_nearer_the_truth(seeded_noise):
    """600 small groups (6 rows each, true mean 2.5 against the bounds' midpoint 5): each
    group's ratio is mostly noise, so the released AVG (pooled over the groups: aggregators.
    mean_estimate) reads mostly the groups' pooled mean. Its root mean squared error is below
    0.75 of the plain ratio's mid + S / N (clamped), read from the same noisy sums (COUNT(x)
    and the row-scoped SUM are N and mid N + S: budget.derived_from), and below 0.5 of the
    per-group shrinkage towards the midpoint (issue 48's estimator before pooling, whose error
    is mostly the 2.5 between the truth and the midpoint). With this seeded draw: 0.10 and 0.19
    of them. A group with many rows is the ratio itself (t within 1e-4 of 1)."""
    rng = np.random.default_rng(5)
    frame = _small_partitions(rng)
    query = _mean_query(PARTITIONS)
    budget = plan(query, 1.0, 0.0)
    table = aggregate(frame, query, budget, seed=0).table
    mid = (LOW + HIGH) / 2
    truth = frame.groupby("key")["x"].mean().to_numpy()
    count = np.maximum(table["n"].to_numpy(), 1.0)
    ratio = np.clip(mid + (table["total"].to_numpy() - mid * table["n"].to_numpy()) / count,
                    LOW, HIGH)
    error = np.sqrt(np.mean((table["mean"].to_numpy() - truth) ** 2))
    plain = np.sqrt(np.mean((ratio - truth) ** 2))
    midpoint = np.sqrt(np.mean((_midpoint_shrunk(table, budget) - truth) ** 2))
    assert error < 0.75 * plain, (error, plain)
    assert error < 0.5 * midpoint, (error, midpoint)

    big = pd.DataFrame({"key": np.zeros(200_000, np.int64), "uid": np.arange(200_000),
                        "x": rng.uniform(1.0, 4.0, 200_000)})
    one = dataclasses.replace(query, public_partitions=((0,),))
    row = aggregate(big, one, plan(one, 1.0, 0.0), seed=0).table.iloc[0]
    ratio = mid + (row["total"] - mid * row["n"]) / row["n"]
    assert abs(row["mean"] - mid) == pytest.approx(abs(ratio - mid), rel=1e-4)


def test_fewer_than_ten_groups_are_each_shrunk_towards_the_midpoint(seeded_noise):
    """Below POOLING_MIN_GROUPS released groups the spread of their means cannot be estimated:
    each AVG is its own minimax shrinkage towards the midpoint (aggregators.mean_shrinkage)."""
    frame = _small_partitions(np.random.default_rng(5))
    query = _mean_query(aggregators.POOLING_MIN_GROUPS - 1)
    budget = plan(query, 1.0, 0.0)
    table = aggregate(frame, query, budget, seed=0).table
    np.testing.assert_allclose(table["mean"], _midpoint_shrunk(table, budget), rtol=1e-12)


def test_groups_whose_means_differ_keep_their_own_means(seeded_noise):
    """20 groups of 20,000 units, half with values near 2 and half near 8: the moment equation
    finds their spread (about 9, against noise of standard deviation ~0.04 per ratio), so
    every t_i is near 1 and each released mean is within 0.2 of its group's own (5 noise
    standard deviations; the pooled mean, 5, is 3 away)."""
    rng = np.random.default_rng(7)
    keys = np.repeat(np.arange(20), 20_000)
    centre = np.where(keys % 2 == 0, 2.0, 8.0)
    frame = pd.DataFrame({"key": keys, "uid": np.arange(keys.size),
                          "x": centre + rng.uniform(-0.5, 0.5, keys.size)})
    query = _mean_query(20)
    table = aggregate(frame, query, plan(query, 1.0, 0.0), seed=0).table
    truth = frame.groupby("key")["x"].mean().to_numpy()
    assert np.max(np.abs(table["mean"].to_numpy() - truth)) < 0.2
