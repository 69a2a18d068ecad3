"""Bad queries and grants are refused with an error that names the problem, before any noise."""
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregateKind, AggregationQuery,
                                                BoundsScope,
                                                NoiseKind, QueryError, SelectionRule, aggregate,
                                                plan)

FRAME = pd.DataFrame({"uid": [1, 1, 2], "key": ["a", "b", "a"], "fare": [3.0, 4.0, 5.0],
                      "name": pd.Series(["x", "y", "z"], dtype="string")})


def query(**changes):
    fields = dict(group_by=("key",), unit_column="uid",
                  aggregates=(Aggregate.count(), Aggregate(AggregateKind.SUM, "fare", 0, 10)))
    fields.update(changes)
    return AggregationQuery(**fields)


@pytest.mark.parametrize("bad, message", [
    (dict(group_by=()), "group_by must name"),
    (dict(group_by=("uid",)), "group_by contains the unit column"),
    (dict(aggregates=()), "at least one aggregate"),
    (dict(aggregates=(Aggregate(AggregateKind.SUM, "fare", 0, None),)), "both bounds"),
    (dict(aggregates=(Aggregate(AggregateKind.SUM, "fare", 5, 1),)), "low < high"),
    (dict(aggregates=(Aggregate(AggregateKind.SUM),)), "needs a column"),
    (dict(aggregates=(Aggregate(AggregateKind.AVG, "fare"),), infer_bounds=False),
     "'avg_fare' has no bounds and bounds inference is off"),
    (dict(aggregates=(Aggregate(AggregateKind.QUANTILE, "fare", 0, 1, q=1.5),)), "q in [0, 1]"),
    (dict(aggregates=(Aggregate.count(), Aggregate.count())), "names clash"),
    (dict(max_partitions_contributed=0), "max_partitions_contributed must be a positive"),
    (dict(public_partitions=(("a",),)), "public_partitions and selection"),
    (dict(selection=SelectionRule.PUBLIC, public_partitions=(("a", 1),)), "tuples of 1"),
])
def test_bad_queries_are_refused_by_plan(bad, message):
    with pytest.raises(QueryError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan(query(**bad), 1.0, 1e-6)


@pytest.mark.parametrize("epsilon, delta, message", [
    (0.0, 1e-6, "epsilon must be a positive"), (1.0, 1.5, r"^delta must lie in \[0, 1\)"),
    (1.0, 0.0, "partition selection spends some"),
])
def test_bad_grants_are_refused(epsilon, delta, message):
    with pytest.raises(QueryError, match=message):
        plan(query(), epsilon, delta)


def test_gaussian_noise_needs_delta_even_with_public_partitions():
    public = query(selection=SelectionRule.PUBLIC, public_partitions=(("a",),),
                   noise=NoiseKind.GAUSSIAN)
    with pytest.raises(QueryError, match="Gaussian noise spends some"):
        plan(public, 1.0, 0.0)


def test_a_grant_too_small_for_truncated_geometric_selection_is_refused():
    # Named: the default rule for units in several groups is now the weighted Gaussian, whose
    # threshold exists at any delta > 0 (computed from the tail by log1p/expm1).
    truncated = query(selection=SelectionRule.TRUNCATED_GEOMETRIC)
    with pytest.raises(QueryError, match="partition selection cannot run"):
        plan(truncated, 1.0, 1e-300)


@pytest.mark.parametrize("data", [FRAME, pa.Table.from_pandas(FRAME)])
def test_unknown_and_non_numeric_columns_are_refused(data):
    unknown = query(aggregates=(Aggregate(AggregateKind.SUM, "tip", 0, 1),))
    with pytest.raises(QueryError, match=r"unknown column\(s\) \['tip'\]"):
        aggregate(data, unknown, plan(unknown, 1.0, 1e-6))
    text = query(aggregates=(Aggregate(AggregateKind.AVG, "name", 0, 1),))
    with pytest.raises(QueryError, match="column 'name' is not numeric"):
        aggregate(data, text, plan(text, 1.0, 1e-6))


def test_a_plan_for_another_query_is_refused():
    with pytest.raises(QueryError, match="made for another query"):
        aggregate(FRAME, query(), plan(query(max_partitions_contributed=1), 1.0, 1e-6))


def test_plan_steps_split_the_grant_and_name_each_aggregate():
    q = query(aggregates=(Aggregate.count(), Aggregate.count("fare"), Aggregate.count_distinct(),
                          Aggregate(AggregateKind.SUM, "fare", 0, 10, scope=BoundsScope.ROW),
                          Aggregate(AggregateKind.AVG, "fare", 0, 10),
                          Aggregate(AggregateKind.SUM, "fare", 0, 40, name="fare_total")),
              selection=SelectionRule.LAPLACE_THRESHOLD)
    # COUNT(DISTINCT) is the thresholding's noisy unit count, COUNT(fare) and the row-scoped SUM
    # come from AVG's noisy count of non-NULL fares and its sum: none has a step of its own.
    # COUNT(*) has one (it counts rows whose fare is NULL too). AVG weighs 2 (two sums).
    budget = plan(q, 1.0, 1e-6)
    assert [s.name for s in budget.steps] == ["partition_selection", "count", "avg_fare",
                                              "fare_total"]
    assert [s.epsilon for s in budget.steps] == pytest.approx([0.2, 0.2, 0.4, 0.2])
    budget = plan(q, 1.1, 1e-6, weights={"partition_selection": 2.0, "avg_fare": 1.0})
    assert [s.epsilon for s in budget.steps] == pytest.approx([0.44, 0.22, 0.22, 0.22])
    assert sum(s.epsilon for s in budget.steps) == pytest.approx(budget.epsilon)
    assert budget.delta == budget.additional_delta == 1e-6
    with pytest.raises(QueryError, match="weights name unknown steps"):
        plan(q, 1.0, 1e-6, weights={"sum": 1.0})


def test_only_sum_clamps_a_units_total():
    with pytest.raises(QueryError, match="only SUM can clamp the unit's total"):
        plan(query(aggregates=(Aggregate(AggregateKind.AVG, "fare", 0, 1,
                                         scope=BoundsScope.UNIT),)), 1.0, 1e-6)


def test_the_release_states_its_guarantee_and_unit():
    q = query(selection=SelectionRule.PUBLIC, public_partitions=(("a",), ("b",), ("c",)))
    release = aggregate(FRAME, q, plan(q, 1.0, 0.0))
    assert release.table["key"].tolist() == ["a", "b", "c"]  # public keys, data or not
    assert (release.epsilon, release.delta) == (1.0, 0.0)
    assert release.unit == "all rows of one uid within the blocks read"
    assert list(release.events) == ["count", "sum_fare"]
    assert np.isfinite(release.table[["count", "sum_fare"]].to_numpy()).all()


def test_rows_without_a_unit_are_dropped_and_an_empty_table_releases_only_public_keys():
    nobody = pd.DataFrame({"uid": [None, None], "key": ["a", "b"], "fare": [1.0, 2.0]})
    inferred = (Aggregate.count(), Aggregate(AggregateKind.SUM, "fare"),
                Aggregate.median("fare", 0, 10))
    selected = query(aggregates=inferred)
    assert aggregate(nobody, selected, plan(selected, 1.0, 1e-6)).table.empty
    public = query(aggregates=inferred, selection=SelectionRule.PUBLIC,
                   public_partitions=(("a",), ("b",)))
    release = aggregate(nobody.iloc[:0], public, plan(public, 1.0, 0.0))
    assert release.table["key"].tolist() == ["a", "b"]
    # no value passes the DP bounds' threshold: the data-independent zero bucket is used
    assert release.bounds["sum_fare"] == (-2.0 ** -10, 2.0 ** -10)



def test_options_given_as_strings_and_lists_are_the_enums_and_tuples():
    parsed = AggregationQuery(["key"], "uid", [Aggregate("sum", "fare", 0, 10, scope="row")],
                              selection="public", public_partitions=[["a"], ["b"]],
                              noise="gaussian")
    assert parsed == AggregationQuery(
        ("key",), "uid", (Aggregate(AggregateKind.SUM, "fare", 0, 10, scope=BoundsScope.ROW),),
        selection=SelectionRule.PUBLIC, public_partitions=(("a",), ("b",)),
        noise=NoiseKind.GAUSSIAN)
    with pytest.raises(QueryError, match="unknown kind 'median'"):
        plan(query(aggregates=(Aggregate("median", "fare", 0, 1),)), 1.0, 1e-6)


@pytest.mark.parametrize("engine", ["local", "beam"])
def test_count_of_a_column_counts_the_rows_where_it_is_set_with_count_stars_noise(engine):
    """ANON_COUNT(col) / Aggregate.count(col): rows where col is not null, of any type, with
    COUNT(*)'s sensitivity (m). At epsilon 1e4 the Laplace noise has scale m / 5e3 per count:
    |noise| > 0.3 has probability exp(-0.3 * 5e3 / 4) < 1e-160 per value (false-failure rate)."""
    from sage_tfx.dp_statistics.aggregation import frontend, relation, sql
    from sage_tfx.dp_statistics.aggregation.beam import aggregate_with_beam

    run = aggregate if engine == "local" else \
        lambda data, q, budget: aggregate_with_beam(pa.table(data).to_pandas(), q, budget)
    frame = pd.DataFrame({"uid": [1, 1, 2, 3, 3, 3], "key": ["a", "a", "a", "b", "b", "b"],
                          "note": pd.Series(["x", None, "z", None, None, "w"], dtype="string")})
    counted = query(aggregates=(Aggregate.count(), Aggregate.count("note")),
                    selection=SelectionRule.PUBLIC, public_partitions=(("a",), ("b",)),
                    max_contributions_per_partition=4)
    release = run(frame, counted, plan(counted, 1e4, 0.0))
    assert np.allclose(release.table["count"], [3, 3], atol=0.3)
    assert np.allclose(release.table["count_note"], [2, 1], atol=0.3)
    assert release.events["count_note"] == release.events["count"]  # same sensitivity
    # The SQL front-end means the same, on a text column the other aggregates would refuse.
    text = ("SELECT WITH ANONYMIZATION OPTIONS(privacy_unit_column = uid, public_groups = "
            "('a', 'b'), max_rows_contributed_per_group = 4) key, ANON_COUNT(note) AS notes "
            "FROM t GROUP BY key")
    table = pa.Table.from_pandas(frame, preserve_index=False)
    schema = sql.TableSchema("uid", {"uid": "int", "key": "string", "note": "string"})
    checked, notes_query, _ = frontend.check_query(sql.parse(text), {"t": schema},
                                                   {"t": table.schema})
    assert notes_query.aggregates == (Aggregate.count("__value0", name="notes"),)
    rows = relation.evaluate(checked, lambda _: table)
    released = run(rows, notes_query, plan(notes_query, 1e4, 0.0))
    assert np.allclose(released.table["notes"], [2, 1], atol=0.3)


def test_a_text_column_is_read_cell_by_cell_so_one_cell_moves_no_other_value():
    """An untyped column's numbers are each a function of their own cell: pandas' to_numeric
    (the old reader) read integers above 2^53 exactly until one other cell was a fraction, then
    moved 818 of these 2,000 by a unit in the last place. Text that is no number is NULL."""
    from sage_tfx.dp_statistics.aggregation.local import numeric_column

    integers = [str(v) for v in np.random.default_rng(0).integers(2**53, 2**62, 2000)]
    alone = numeric_column(pd.DataFrame({"v": pd.Series(integers, dtype=object)}), "v")
    beside = numeric_column(pd.DataFrame({"v": pd.Series(integers + ["0.5", "n/a"],
                                                         dtype=object)}), "v")
    assert alone.tolist() == [float(int(v)) for v in integers]
    assert beside[:-2].tolist() == alone.tolist()
    assert beside[-2] == 0.5 and np.isnan(beside[-1])
