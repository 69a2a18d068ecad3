"""Public groups (a query without GROUP BY is one): the noise is calibrated for
C_eff = min(max_groups_contributed, number of public groups) groups (spec.AggregationQuery.
partitions_per_unit), while the charge stays what was asked; selected groups keep C_u.

Noise: the value tests use `seeded_noise` (the OpenDP law and scale from numpy seeded with 0),
so they repeat exactly; the statistical bounds are stated with their false-failure rate under
fresh noise. The audits draw the real OpenDP noise: their rates are in each test."""
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from dp_accounting import dp_event

from sage_tfx import release
from sage_tfx.audit import mechanisms as audits
from sage_tfx.audit.bounds import epsilon_lower_bound
from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregationQuery, SelectionRule,
                                                frontend, local, plan, relation, sql)
from sage_tfx.sage_access import BlockLedger
from sage_tfx.sage_access.accounting import event_from_json
from sage_tfx.sage_access.ledger import BlockIds

M = 8  # the default max_rows_contributed_per_group
SCHEMA = sql.TableSchema("uid", {"uid": "string", "g": "string", "fare": "float"})
TOTAL = "SELECT WITH ANONYMIZATION OPTIONS(privacy_unit_column = uid) ANON_COUNT(*) AS n, " \
        "ANON_SUM(fare, 0, 20) AS fares FROM t"
TWO_GROUPS = ("SELECT WITH ANONYMIZATION OPTIONS(privacy_unit_column = uid, public_groups = "
              "('a', 'b')) g, ANON_COUNT(*) AS n, ANON_SUM(fare, 0, 20) AS fares FROM t "
              "GROUP BY g")
SELECTED = ("SELECT WITH ANONYMIZATION OPTIONS(privacy_unit_column = uid) g, ANON_COUNT(*) AS "
            "n, ANON_SUM(fare, 0, 20) AS fares FROM t GROUP BY g")


def frame(groups=("a", "b"), units=300):
    """Each unit has 3 rows in every one of `groups`."""
    rng = np.random.default_rng(5)
    rows = [(f"u{u}", g) for u in range(units) for g in groups for _ in range(3)]
    return pd.DataFrame({"uid": [u for u, _ in rows], "g": [g for _, g in rows],
                         "fare": rng.uniform(0, 10, len(rows))})


def planned(text, epsilon=1.0):
    arrow = pa.Table.from_pandas(frame(), preserve_index=False).schema
    return frontend.plan_query(sql.parse(text), {"t": SCHEMA}, {"t": arrow}, epsilon, 1e-6)


def released(store_path, text, data=None, epsilon=1.0):
    """dp_aggregate() through a ledger grant, with intervals; returns (release, ledger)."""
    ledger = BlockLedger.create(store_path)
    ledger.add_block("b1", 5.0, 1e-5)
    charged = release.charge(ledger, planned(text, epsilon).release_plan("test", text),
                             BlockIds(["b1"]))
    result = frontend.dp_aggregate(frame() if data is None else data, text, charged.grant,
                                   ledger, intervals=True)
    return result, ledger


@pytest.mark.parametrize("text, partitions_per_unit", [(TOTAL, 1), (TWO_GROUPS, 2),
                                                        (SELECTED, 4)])
def test_the_noise_is_for_min_of_c_and_the_public_groups_and_the_charge_is_what_was_asked(
        text, partitions_per_unit, store_path, seeded_noise):
    """COUNT (Delta m = 8) and a unit-scoped SUM in [0, 20] (Delta 20): Laplace noise of scale
    C_eff Delta / (the step's epsilon), stddev sqrt(2) times it; over public groups each step
    has epsilon 0.5 (the two Laplace steps compose by adding). Before the fix C_eff was 4 (the
    default max_groups_contributed) in all three queries."""
    budget = planned(text).budget
    assert budget.query.partitions_per_unit == partitions_per_unit
    result, ledger = released(store_path, text)
    for name, sensitivity in (("n", M), ("fares", 20.0)):
        epsilon = budget.step(name).noise_epsilon
        if partitions_per_unit < 4:
            assert epsilon == 0.5
        assert result.table[f"{name}_stddev"].to_numpy() == pytest.approx(
            math.sqrt(2) * partitions_per_unit * sensitivity / epsilon)
    # The charge: the grant's (epsilon, delta) as asked; each step's event is the plan's, the
    # one that ran, and over public groups the same as at C_eff = 1 (events are per unit of
    # sensitivity: C_eff moves the noise's scale, never the charge).
    [record] = ledger.grant_records()
    assert (record["epsilon"], record["delta"]) == (1.0, 1e-6)
    for step in budget.steps:
        assert event_from_json(record["events"][step.name]) == step.event
    for name in ("n", "fares"):  # read back from the noise as it ran (to rounding)
        assert result.events[name].noise_multiplier == pytest.approx(
            budget.step(name).event.noise_multiplier, rel=1e-12)
    if partitions_per_unit < 4:
        for name in ("n", "fares"):
            assert result.events[name] == dp_event.LaplaceDpEvent(noise_multiplier=2.0)
    # The guarantee states the calibration over public groups (the plan's parameters).
    guarantee = record["steps"]["n"]["guarantee"]
    if partitions_per_unit < 4:
        assert (f"noise calibrated for a unit in at most {partitions_per_unit} group(s): "
                "min(max_groups_contributed 4,") in guarantee
    else:
        assert "noise calibrated" not in guarantee


def test_a_total_counts_and_sums_with_the_variance_of_one_group(seeded_noise):
    """The empirical variance of the no-GROUP-BY COUNT(*) and SUM over 4,000 releases is the
    variance of Laplace noise for C_eff = 1, 2 b^2 with b = Delta / 0.5 (the former C_eff = 4
    gave 16 times it). The sample variance of n Laplace draws has a relative standard
    deviation of sqrt(5 / n) = 3.5% (kurtosis 6), so the band [0.8, 1.25] is more than 5.7 of
    them wide on each side: under fresh noise a false failure has probability below 1e-7
    (normal approximation; below 3% by Chebyshev alone). The draws are seeded: it repeats.

    The release runs once on the accumulators of one bounding repeated 4,000 times (the
    noise is independent per row, at the scale the query's one public group sets)."""
    planned_total = planned(TOTAL)
    query, budget = planned_total.query, planned_total.budget
    rows = relation.evaluate(
        planned_total.checked, lambda _: pa.Table.from_pandas(frame(), preserve_index=False))
    once = local.accumulate(rows.to_pandas(), query, budget, np.random.default_rng(0))
    runs = 4_000
    repeated = local.Accumulated(pd.concat([once.keys] * runs, ignore_index=True),
                                 np.tile(once.accumulators, (runs, 1)), once.bounds, {})
    noisy = local.release_accumulated(query, budget, repeated, "unit").table
    truth_rows = once.accumulators[0, 1]
    for name, truth, delta_ in (("n", truth_rows, M), ("fares", None, 20.0)):
        values = noisy[name].to_numpy()
        centre = values.mean() if truth is None else truth
        variance = np.mean((values - centre) ** 2)
        assert 0.8 <= variance / (2 * (delta_ / 0.5) ** 2) <= 1.25, (name, variance)


def test_the_calibration_reads_the_public_list_not_the_groups_the_data_fills(store_path,
                                                                           seeded_noise):
    """Three public groups, C = 4: the noise is for 3 groups whether the data fills one of
    them or all three (a C_eff counted from the data would move the noise scale with one
    unit: the broken variant the audit below catches)."""
    text = TWO_GROUPS.replace("('a', 'b')", "('a', 'b', 'c')")
    stddevs = []
    for groups in (("a",), ("a", "b", "c")):
        result, _ = released(store_path + "".join(groups), text, frame(groups))
        assert sorted(result.table["g"]) == ["a", "b", "c"]
        stddevs.append(result.table["n_stddev"].to_numpy())
    np.testing.assert_array_equal(stddevs[0], stddevs[1])
    assert stddevs[0] == pytest.approx(math.sqrt(2) * 3 * M / 0.5)


def test_a_query_api_over_public_partitions_has_the_same_calibration():
    """The Python API (AggregationQuery) states the same C_eff as SQL; bounds and the overflow
    check read it too (largest_change)."""
    count = Aggregate.count()
    public = AggregationQuery(("k",), "u", (count,), selection=SelectionRule.PUBLIC,
                              public_partitions=((1,), (2,)))
    assert public.partitions_per_unit == 2
    assert public.largest_change(Aggregate("sum", "x", 0, 10)) == 2 * 10
    assert AggregationQuery(("k",), "u", (count,), max_partitions_contributed=1,
                            selection=SelectionRule.PUBLIC,
                            public_partitions=((1,), (2,))).partitions_per_unit == 1
    assert AggregationQuery(("k",), "u", (count,)).partitions_per_unit == 4
    assert plan(public, 1.0, 0.0).event == plan(AggregationQuery(
        ("k",), "u", (count,), selection=SelectionRule.PUBLIC,
        public_partitions=tuple((k,) for k in range(10))), 1.0, 0.0).event


# --- the empirical audit (sage_tfx.audit.mechanisms.public_groups_outputs) -----------------

TRIALS = 5_000


def test_a_total_stays_within_its_epsilon_at_the_noise_of_one_group():
    """Coverage: the bound exceeds the true epsilon with probability <= 1e-4 (confidence
    0.9999). Power: the claim is tight for one group (measured 0.78-0.86), so the bound also
    shows the audit sees the new calibration: under the former one (noise for 4 groups, true
    epsilon 1/4) a bound above 0.5 has probability <= 1e-2 (confidence 0.99)."""
    first, second = audits.public_groups_outputs(TRIALS, seed=0, groups=1)
    assert epsilon_lower_bound(first, second, delta=0.0, confidence=0.9999) <= (
        audits.PUBLIC_GROUPS_EPSILON)
    assert epsilon_lower_bound(first, second, delta=0.0, confidence=0.99) > 0.5


def test_two_public_groups_stay_within_their_epsilon():
    first, second = audits.public_groups_outputs(TRIALS, seed=0, groups=2)
    assert epsilon_lower_bound(first, second, delta=0.0, confidence=0.9999) <= (
        audits.PUBLIC_GROUPS_EPSILON)


def test_a_calibration_from_the_groups_the_data_fills_is_caught():
    """Power, not coverage: measured bound 2.6 against the claim 1 at these trials."""
    first, second = audits.public_groups_outputs(TRIALS, seed=0, groups=2,
                                                 broken="data_groups")
    assert epsilon_lower_bound(first, second, delta=0.0, confidence=0.99) > (
        audits.PUBLIC_GROUPS_EPSILON)


def test_the_public_group_audits_are_shipped():
    for name in ("dp_sql_total", "dp_sql_public_groups_2"):
        audit = audits.shipped()[name]
        assert audit.run(1_000).epsilon_lower_bound <= audit.claimed_epsilon
