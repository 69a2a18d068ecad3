"""The local and Beam engines on the same input: equal pre-noise accumulators, the same noise
law (docs/architecture.md: one conformance test per operator). Beam runs on the DirectRunner."""
import numpy as np
import pandas as pd
from scipy import stats
from support.beam_engine import (CONFORMANCE_QUERY, accumulate_with_beam, conformance_frame,
                                 sorted_by_keys)

from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregateKind, AggregationQuery,
                                                SelectionRule, aggregators, local, plan)
from sage_tfx.dp_statistics.aggregation.beam import aggregate_with_beam
from sage_tfx.randomness import secret_rng


def test_both_engines_accumulate_the_same_pre_noise_sums():
    frame, budget = conformance_frame(), plan(CONFORMANCE_QUERY, 1.0, 1e-6)
    local_keys, local_sums = sorted_by_keys(local.accumulate(frame, CONFORMANCE_QUERY, budget,
                                                             secret_rng(0)))
    beam_keys, beam_sums = sorted_by_keys(accumulate_with_beam(frame, CONFORMANCE_QUERY, budget))
    pd.testing.assert_frame_equal(local_keys, beam_keys)
    np.testing.assert_allclose(local_sums, beam_sums)
    # the sums are the data's: units per partition, and fares clamped per unit into [0, 50]
    truth = frame.groupby(["area", "day"]).agg(units=("uid", "nunique"), rows=("uid", "size"))
    np.testing.assert_array_equal(local_sums[:, 0], truth["units"].to_numpy())
    np.testing.assert_array_equal(local_sums[:, 1], truth["rows"].to_numpy())
    # the weighted Gaussian's weights: each unit gives 1 / sqrt(its number of partitions)
    per_unit = frame.groupby("uid")[["area", "day"]].apply(lambda rows: len(rows.drop_duplicates()))
    pairs = frame[["area", "day", "uid"]].drop_duplicates()
    weights = (1 / np.sqrt(pairs["uid"].map(per_unit))).groupby([pairs["area"], pairs["day"]]).sum()
    np.testing.assert_allclose(local_sums[:, aggregators.Layout.WEIGHT], weights.to_numpy())
    unit_totals = frame.groupby(["area", "day", "uid"])["fare"].sum().clip(0, 50)
    np.testing.assert_allclose(local_sums[:, aggregators.layout(CONFORMANCE_QUERY).blocks["sum_fare"].start],
                               unit_totals.groupby(level=[0, 1]).sum())


def test_both_engines_bound_a_heavy_unit_alike():
    """With sampling active (one unit in all 12 partitions), both keep C_u of its partitions."""
    frame = pd.concat([conformance_frame(), pd.DataFrame({"area": [f"a{k}" for k in range(12)],
                                               "day": [k % 2 for k in range(12)],
                                               "uid": 99, "fare": 1.0})])
    budget = plan(CONFORMANCE_QUERY, 1.0, 1e-6)
    local_units = local.accumulate(frame, CONFORMANCE_QUERY, budget,
                                   secret_rng(1)).accumulators[:, 0].sum()
    beam_units = accumulate_with_beam(frame, CONFORMANCE_QUERY, budget).accumulators[:, 0].sum()
    pairs = conformance_frame().groupby("uid")["area"].nunique().sum()
    assert local_units == beam_units == pairs + 3


def test_the_beam_engine_releases_with_the_local_noise_law():
    """600 identical public partitions (5 units, 2 rows each): COUNT's errors are Laplace at
    C_u m / epsilon on Beam as on the local engine, and the medians read from the quantile tree
    have the same law on both (KS, false-failure rate 1e-4 each), and both state the same
    accuracy when asked."""
    frame = pd.DataFrame({"key": np.repeat(np.arange(600), 10),
                          "uid": np.repeat(np.arange(3000), 2), "fare": 1.0})
    query = AggregationQuery(("key",), "uid", (Aggregate.count(),
                                               Aggregate(AggregateKind.SUM, "fare"),
                                               Aggregate.median("fare", 0.0, 4.0)),
                             selection=SelectionRule.PUBLIC,
                             public_partitions=tuple((k,) for k in range(600)))
    budget = plan(query, 1.0, 0.0)
    scale = query.max_partitions_contributed * query.max_contributions_per_partition / (
        budget.step("count").epsilon)
    beam_release = aggregate_with_beam(frame, query, budget, intervals=True)
    local_release = local.aggregate(frame, query, budget, intervals=True)
    # the stated accuracy, asked of both engines: COUNT's stddev is its noise law's on both
    np.testing.assert_array_equal(beam_release.intervals["count_stddev"],
                                  local_release.intervals["count_stddev"])
    for release in (beam_release, local_release):
        errors = release.table["count"].to_numpy() - 10.0
        assert stats.kstest(errors, stats.laplace(scale=scale).cdf).pvalue > 1e-4
        assert list(release.events) == ["count", "bounds:sum_fare", "sum_fare", "median_fare"]
        assert release.table["key"].tolist() == list(range(600))
    assert stats.ks_2samp(beam_release.table["count"], local_release.table["count"]).pvalue > 1e-4
    # the quantile tree's descent: the same law on both engines
    assert stats.ks_2samp(beam_release.table["median_fare"],
                          local_release.table["median_fare"]).pvalue > 1e-4


def test_a_dict_row_without_a_key_column_falls_in_the_null_key_partition_on_beam():
    """Beam takes dicts as they come; one lacking `day` must not stop a charged run (the local
    engine's frame has NaN there): it counts in the partition whose day is null."""
    frame, budget = conformance_frame(), plan(CONFORMANCE_QUERY, 1.0, 1e-6)
    records = frame.to_dict("records") + [{"area": "a0", "uid": 100, "fare": 1.0}]
    accumulated = accumulate_with_beam(records, CONFORMANCE_QUERY, budget)
    null_day = accumulated.keys["day"].isna().to_numpy()
    assert null_day.sum() == 1
    np.testing.assert_array_equal(accumulated.accumulators[null_day, :2], [[1, 1]])


def test_both_engines_group_keys_whole_and_typed_as_declared():
    """Issue 29: keys are grouped by their whole value and keep the table's types on both
    engines: "a\\x00" (not representable) drops its row instead of merging into "a", an
    integer key column holding a NULL stays integer, and 2^53 and 2^53 + 1 stay apart."""
    import pyarrow as pa

    big = 2 ** 53
    table = pa.table({
        "uid": pa.array(["u0", "u1", "u2", "u3", "u4", "u5", "u6"]),
        "area": pa.array(["a\x00", "a", "a", "b", "b", "a", "b"]),
        "day": pa.array([1, 1, None, big, big + 1, big + 1, 1], pa.int64()),
        "fare": pa.array([1.0] * 7)})
    query = CONFORMANCE_QUERY
    budget = plan(query, 1.0, 1e-6)
    local_keys, local_sums = sorted_by_keys(local.accumulate(local._frame(table, query), query,
                                                             budget, secret_rng(0)))
    beam_keys, beam_sums = sorted_by_keys(accumulate_with_beam(table, query, budget))
    pd.testing.assert_frame_equal(local_keys, beam_keys)
    np.testing.assert_allclose(local_sums, beam_sums)
    assert [str(t) for t in local_keys.dtypes] == ["string[pyarrow]", "int64[pyarrow]"]
    assert local_keys.astype(object).where(local_keys.notna(), None).values.tolist() == [
        ["a", 1], ["a", big + 1], ["a", None], ["b", 1], ["b", big], ["b", big + 1]]
    np.testing.assert_array_equal(local_sums[:, 0], [1, 1, 1, 1, 1, 1])  # u0's row dropped


def test_both_engines_saturate_a_sum_beyond_2_to_the_1000():
    """Issue 29: 8 units at the bound 2^998 sum to 2^1001; both engines saturate at 2^1000."""
    query = AggregationQuery(("area",), "uid", (Aggregate(AggregateKind.SUM, "x", 0, 2.0 ** 998),),
                             max_partitions_contributed=1)
    frame = pd.DataFrame({"area": "a", "uid": range(8), "x": 2.0 ** 998})
    budget = plan(query, 1.0, 1e-6)
    local_sums = local.accumulate(frame, query, budget, secret_rng(0)).accumulators
    beam_sums = accumulate_with_beam(frame, query, budget).accumulators
    np.testing.assert_array_equal(local_sums, [[8, 8, 8, 2.0 ** 1000]])
    np.testing.assert_array_equal(beam_sums, local_sums)


def _by_key(accumulated):
    """{key tuple: its distinct units and rows}; keys that are == (0.0/-0.0, 1/1.0/True) would collide,
    so the caller also checks the number of partitions."""
    keys = accumulated.keys.astype(object).where(accumulated.keys.notna(), None)
    return {key: tuple(row[:2]) for key, row in zip(keys.itertuples(index=False, name=None),
                                                accumulated.accumulators)}


def test_a_unit_at_zero_and_minus_zero_is_one_pair_of_the_public_partition_on_beam():
    """Review finding: Beam paired rows by the key's encoding, so u1@0.0 and u1@-0.0 were two
    pairs of the public partition (0.0,): 3 distinct units for 2, and a unit with m rows at each
    moved COUNT by 2m under noise calibrated for C_eff * m = m. Both engines: one pair."""
    query = AggregationQuery(("k",), "uid", (Aggregate.count(), Aggregate.count_distinct()),
                             selection=SelectionRule.PUBLIC, public_partitions=((0.0,),),
                             max_partitions_contributed=2, max_contributions_per_partition=8)
    assert query.partitions_per_unit == 1  # C_eff = min(C_u, G)
    budget = plan(query, 1.0, 1e-6)
    three_rows = pd.DataFrame({"k": [0.0, -0.0, 0.0], "uid": ["u1", "u1", "u2"]})
    heavy = pd.DataFrame({"k": [0.0] * 8 + [-0.0] * 8, "uid": "u1"})
    for frame, units, count in ((three_rows, 2, 3), (heavy, 1, 8)):
        for accumulated in (local.accumulate(frame, query, budget, secret_rng(0)),
                            accumulate_with_beam(frame, query, budget, seed=0)):
            assert len(accumulated.keys) == 1
            assert str(accumulated.keys["k"].iloc[0]) == "0.0"
            np.testing.assert_array_equal(accumulated.accumulators[0, :2], [units, count])


def test_both_engines_group_equal_keys_and_units_of_mixed_types_alike():
    """Keys and units equal under == but of different types or signs (0.0/-0.0 in a float
    column; 1, 1.0, True and 0, -0.0, False in object columns; unit 7 and 7.0) are one
    partition and one unit on both engines, public or selected; a selected zero shows as 0.0 on
    both (the sign of a first row's zero is not released)."""
    floats = pd.DataFrame({"k": [-0.0, 0.0, -0.0, 2.5, 2.5], "uid": [1, 1, 2, 2, 3]})
    mixed = pd.DataFrame({"k": pd.Series([1, 1.0, True, 0, -0.0, False, "1"], dtype=object),
                          "uid": pd.Series([7, 7.0, 8, 7, 7.0, 8, 7], dtype=object)})
    aggregates = (Aggregate.count(), Aggregate.count_distinct())
    selected = AggregationQuery(("k",), "uid", aggregates, max_partitions_contributed=3,
                                max_contributions_per_partition=4)
    for frame, public in ((floats, ((-0.0,), (2.5,))), (mixed, ((True,), (0.0,), ("1",)))):
        listed = AggregationQuery(("k",), "uid", aggregates, selection=SelectionRule.PUBLIC,
                                  public_partitions=public, max_partitions_contributed=3,
                                  max_contributions_per_partition=4)
        for query in (selected, listed):
            budget = plan(query, 1.0, 1e-6)
            local_sums = local.accumulate(frame, query, budget, secret_rng(0))
            beam_sums = accumulate_with_beam(frame, query, budget, seed=0)
            assert len(beam_sums.keys) == len(local_sums.keys) == len(public)
            assert _by_key(beam_sums) == _by_key(local_sums)
            if query is selected:  # public: the listed key itself is shown
                assert "-0.0" not in repr(beam_sums.keys["k"].tolist())
                assert "-0.0" not in repr(local_sums.keys["k"].tolist())
    # distinct units: 1 and 2 at 0.0 (unit 1 once), 2 and 3 at 2.5; in `mixed`, unit 7
    # (7 and 7.0) and 8 at 1 and at 0, unit 7 alone at "1"
    assert _by_key(local.accumulate(mixed, selected, plan(selected, 1.0, 1e-6),
                                    secret_rng(0))) == {(1,): (2.0, 3.0), (0,): (2.0, 3.0),
                                                        ("1",): (1.0, 1.0)}
