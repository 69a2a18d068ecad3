"""DP SQL: what a query means to the operator, and every refusal of the seed's row-ownership
rules (Table 4.3), each naming the offending clause. No data, no ledger: pure parsing."""
import math

import pyarrow as pa
import pytest

from sage_tfx.dp_statistics.aggregation import (AggregateKind, AggregationQuery, QueryError,
                                                SelectionRule)
from sage_tfx.dp_statistics.aggregation import relation, sql
from support.dp_sql import SCHEMAS, compile_sql, refusal


def test_anonymization_query_with_options_becomes_the_operators_query():
    query, columns = compile_sql(
        "SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 2, "
        "max_rows_contributed_per_group = 3, selection = 'laplace_threshold', noise = gaussian) "
        "area, ANON_COUNT(*) AS trips, ANON_SUM(fare, 0, 50), ANON_AVG(fare, 0, 50) mean_fare, "
        "ANON_VAR(fare, 0, 50) v, ANON_STDDEV(fare, 0, 50) s, ANON_NTILE(fare, 4, 0, 100) q, "
        "ANON_MEDIAN(fare, 0, 100) m, ANON_MIN(fare, 0, 100) lo, ANON_MAX(fare, 0, 100) hi, "
        "ANON_COUNT(DISTINCT uid) riders FROM trips WHERE company = 'x' GROUP BY area")
    assert query.unit_column == "uid" and query.group_by == ("area",)
    assert (query.max_partitions_contributed, query.max_contributions_per_partition) == (2, 3)
    assert query.selection is SelectionRule.LAPLACE_THRESHOLD
    assert query.noise.value == "gaussian"
    kinds = {a.name: (a.kind, a.low, a.high, a.q) for a in query.aggregates}
    assert kinds["trips"][0] is AggregateKind.COUNT
    assert kinds["anon_sum_fare"] == (AggregateKind.SUM, 0.0, 50.0, None)
    assert kinds["mean_fare"][0] is AggregateKind.AVG
    assert kinds["v"][0] is AggregateKind.VAR and kinds["s"][0] is AggregateKind.STDDEV
    assert [kinds[f"q_{k}"][3] for k in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert [kinds[n][3] for n in ("m", "lo", "hi")] == [0.5, 0.0, 1.0]
    assert kinds["riders"][0] is AggregateKind.COUNT_DISTINCT
    assert columns == ("area", "trips", "anon_sum_fare", "mean_fare", "v", "s", "q_1", "q_2",
                       "q_3", "m", "lo", "hi", "riders")


def test_bigquery_spelling_defaults_public_groups_and_a_string_that_reads_like_the_clause():
    query, _ = compile_sql(
        "SELECT WITH DIFFERENTIAL_PRIVACY OPTIONS(public_groups = (8, 32), privacy_unit_column = "
        "uid) area, ANON_COUNT(*) FROM trips WHERE company <> 'SELECT WITH ANONYMIZATION' "
        "GROUP BY area")
    assert query.selection is SelectionRule.PUBLIC
    assert query.public_partitions == ((8,), (32,))
    assert query.max_partitions_contributed == 4  # the documented default
    default, _ = compile_sql("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM trips "
                             "GROUP BY area")
    # one default selection rule, the operator's (the SQL front door had its own before):
    # weighted Gaussian, truncated geometric when a unit is in one group only
    assert default.selection is SelectionRule.WEIGHTED_GAUSSIAN
    assert default.selection is AggregationQuery(("area",), "uid", ()).selection
    single, _ = compile_sql("SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1) "
                            "area, ANON_COUNT(*) FROM trips GROUP BY area")
    assert single.selection is SelectionRule.TRUNCATED_GEOMETRIC is AggregationQuery(
        ("area",), "uid", (), max_partitions_contributed=1).selection


def test_join_using_the_unit_and_a_subquery_grouped_by_it_are_accepted():
    checked = sql.check(sql.parse(
        "SELECT WITH ANONYMIZATION t.area, ANON_SUM(per_user, 0, 100) FROM "
        "(SELECT uid, area, SUM(fare) AS per_user FROM trips GROUP BY uid, area) t "
        "JOIN riders r ON t.uid = r.uid WHERE r.age > 30 GROUP BY t.area"), SCHEMAS)
    rows = relation.evaluate(checked, {
        "trips": pa.table({"uid": ["a", "a", "b"], "area": [1, 1, 2], "fare": [3.0, 4.0, 5.0],
                           "company": ["x", "x", "y"]}),
        "riders": pa.table({"uid": ["a", "b"], "age": [40, 20], "area": [9, 9]})}.__getitem__)
    # One row per (uid, area) with its own sum; the rider under 31 is filtered row by row.
    assert rows.to_pydict() == {"uid": ["a"], "area": [1], "__value0": [7.0]}


@pytest.mark.parametrize("text, named", [
    # join not on the unit
    ("SELECT WITH ANONYMIZATION t.area, ANON_COUNT(*) FROM trips t JOIN riders r "
     "ON t.area = r.area GROUP BY t.area", "JOIN riders AS r ON t.area = r.area"),
    ("SELECT WITH ANONYMIZATION t.area, ANON_COUNT(*) FROM trips t JOIN riders r "
     "USING (area) GROUP BY t.area", "JOIN riders AS r USING (area)"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM trips, riders GROUP BY area",
     "riders"),
    ("SELECT WITH ANONYMIZATION t.area, ANON_COUNT(*) FROM trips t JOIN riders r "
     "ON t.uid = r.uid AND t.area = r.area GROUP BY t.area", "t.area = r.area"),
    # tables whose units differ
    ("SELECT WITH ANONYMIZATION t.area, ANON_COUNT(*) FROM trips t JOIN fleet f "
     "ON t.uid = f.car GROUP BY t.area", "JOIN fleet AS f ON t.uid = f.car"),
    ("SELECT WITH ANONYMIZATION t.area, ANON_COUNT(*) FROM trips t JOIN fleet f "
     "ON t.uid = f.car GROUP BY t.area", "same people's ids: only the names are compared"),
    # inner aggregation not grouped by the unit
    ("SELECT WITH ANONYMIZATION area, ANON_SUM(s, 0, 9) FROM (SELECT uid, area, SUM(fare) s "
     "FROM trips GROUP BY area) GROUP BY area", "GROUP BY area"),
    ("SELECT WITH ANONYMIZATION area, ANON_SUM(s, 0, 9) FROM (SELECT SUM(fare) s, 1 AS area "
     "FROM trips) GROUP BY area", "an aggregate without GROUP BY"),
    # a projection that drops the unit
    ("SELECT WITH ANONYMIZATION area, ANON_SUM(fare, 0, 9) FROM (SELECT area, fare FROM trips) "
     "GROUP BY area", "drops the privacy unit uid"),
    # a projection whose output named uid is not the unit column: it would become the unit
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM (SELECT uid, company AS uid, area "
     "FROM trips) GROUP BY area", "two of its output columns are named uid"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM (SELECT uid, 'same' AS uid, area "
     "FROM trips) GROUP BY area", "two of its output columns are named uid"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM (SELECT company AS uid, area "
     "FROM trips) GROUP BY area", "company AS uid: the output named uid must be the privacy "
     "unit column uid itself"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM (SELECT uid, area, MAX(company) AS "
     "uid FROM trips GROUP BY uid, area) GROUP BY area", "two of its output columns are named "
     "uid"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM (SELECT area, MAX(uid) AS uid "
     "FROM trips GROUP BY uid, area) GROUP BY area", "MAX(uid) AS uid: the output named uid"),
    # rows of other units read through WHERE or a window
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM trips WHERE uid IN "
     "(SELECT uid FROM riders) GROUP BY area", "WHERE uid IN (SELECT uid FROM riders)"),
    ("SELECT WITH ANONYMIZATION area, ANON_SUM(x, 0, 9) FROM (SELECT uid, area, "
     "SUM(fare) OVER (PARTITION BY area) AS x FROM trips) GROUP BY area", "OVER"),
    # COUNT(DISTINCT) of something other than the unit
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(DISTINCT company) FROM trips GROUP BY area",
     "ANON_COUNT(DISTINCT company)"),
])
def test_ownership_violations_are_refused_naming_the_clause(text, named):
    message = refusal(text)
    assert named in message, message


@pytest.mark.parametrize("text, named", [
    ("SELECT WITH ANONYMIZATION area, ANON_SUM(tip, 0, 5) FROM trips GROUP BY area",
     "unknown column tip"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM trips WHERE nope > 1 GROUP BY area",
     "unknown column nope"),
    ("SELECT WITH ANONYMIZATION zone, ANON_COUNT(*) FROM trips GROUP BY zone",
     "unknown column zone"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM cabs GROUP BY area",
     "FROM cabs: no such table"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM trips t JOIN riders r USING (uid) "
     "GROUP BY area", "column area is ambiguous"),
])
def test_unknown_columns_and_tables_are_refused(text, named):
    assert named in refusal(text)


def test_missing_bounds_are_inferred_unless_inference_is_off():
    query, _ = compile_sql("SELECT WITH ANONYMIZATION area, ANON_SUM(fare) FROM trips "
                           "GROUP BY area")
    assert query.aggregates[0].bounds_inferred
    message = refusal("SELECT WITH ANONYMIZATION OPTIONS(infer_bounds = false) area, "
                      "ANON_SUM(fare) FROM trips GROUP BY area")
    assert "aggregate 'anon_sum_fare' has no bounds and bounds inference is off" in message


@pytest.mark.parametrize("text, named", [
    ("SELECT area, ANON_COUNT(*) FROM trips GROUP BY area", "SELECT WITH ANONYMIZATION"),
    ("SELECT WITH ANONYMIZATION OPTIONS(epsilons = 1) area, ANON_COUNT(*) FROM trips "
     "GROUP BY area", "unknown option(s) ['epsilons']"),
    ("SELECT WITH ANONYMIZATION OPTIONS(privacy_unit_column = company) area, ANON_COUNT(*) "
     "FROM trips GROUP BY area", "recorded at ingest, is uid"),
    ("SELECT WITH ANONYMIZATION area, company, ANON_COUNT(*) FROM trips GROUP BY area",
     "SELECT company: not an ANON_ aggregate and not in GROUP BY"),
    ("SELECT WITH ANONYMIZATION area, ANON_SUM(company, 0, 1) FROM trips GROUP BY area",
     "company is text"),
    ("SELECT WITH ANONYMIZATION area, ANON_SUM((company), 0, 1) FROM trips GROUP BY area",
     "(company) is text"),
    ("SELECT WITH ANONYMIZATION area, ANON_SUM(COALESCE(company, '0'), 0, 1) FROM trips "
     "GROUP BY area", "COALESCE(company, '0') is text"),
    ("SELECT WITH ANONYMIZATION area, ANON_SUM(c, 0, 1) FROM (SELECT uid, area, MIN(company) "
     "AS c FROM trips GROUP BY uid, area) GROUP BY area", "c is text"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM trips WHERE company / 2 > 1 "
     "GROUP BY area", "company / 2 divides text"),
    ("SELECT WITH ANONYMIZATION area, ANON_SUM(fare, 5, 1) FROM trips GROUP BY area",
     "lower bound 5 must be below"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM trips GROUP BY area ORDER BY area",
     "ORDER"),
    # names of the relation's internal columns: a key so named would be replaced by a value
    ("SELECT WITH ANONYMIZATION company AS __value0, ANON_SUM(fare, 0, 1) FROM trips "
     "GROUP BY company", "the name __value0 starts with __, which is reserved"),
    ("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM (SELECT uid, company AS __argument0, "
     "MAX(fare) AS area FROM trips GROUP BY uid, company) GROUP BY area",
     "the name __argument0 starts with __"),
])
def test_other_malformed_queries_are_refused(text, named):
    assert named in refusal(text)


def test_type_errors_surface_on_the_schema_before_any_data():
    checked = sql.check(sql.parse("SELECT WITH ANONYMIZATION area, ANON_COUNT(*) FROM trips "
                                  "WHERE company > 3 GROUP BY area"), SCHEMAS)
    schemas = {"trips": pa.schema([("uid", pa.string()), ("area", pa.int64()),
                                   ("fare", pa.float64()), ("company", pa.string())])}
    with pytest.raises(QueryError, match="column types"):
        relation.check_on_schema(checked, schemas)


def test_aggregate_arguments_keep_null_as_nan_for_the_aggregates_to_skip():
    checked = sql.check(sql.parse("SELECT WITH ANONYMIZATION area, ANON_SUM(fare / area, 0, 9) "
                                  "FROM trips GROUP BY area"), SCHEMAS)
    rows = relation.evaluate(checked, lambda _: pa.table({
        "uid": ["a", "b", "c"], "area": [0, 2, 0], "fare": [1.0, None, 0.0],
        "company": ["x", "y", "z"]}))
    # 1/0 = inf (a value: clamped to the bound), NULL/2 = NULL and 0/0 = NaN (skipped by the
    # aggregate, never replaced by a default).
    values = rows.column("__value0").to_pylist()
    assert values[0] == float("inf") and math.isnan(values[1]) and math.isnan(values[2])


def test_no_value_can_make_the_relation_fail_after_the_charge():
    # An integer beyond float64's exact range and an overflowing product: Arrow's checked
    # casts and arithmetic would raise on these values only; the relation uses unchecked ones.
    checked = sql.check(sql.parse("SELECT WITH ANONYMIZATION area, ANON_SUM(area * 4, 0, 9), "
                                  "ANON_AVG(area / 3, 0, 9) FROM trips WHERE area * area <> 1 "
                                  "GROUP BY area"), SCHEMAS)
    rows = relation.evaluate(checked, lambda _: pa.table({
        "uid": ["a", "b"], "area": [2 ** 62 + 1, 3], "fare": [1.0, 2.0],
        "company": ["x", "y"]}))
    assert rows.num_rows == 2 and rows.column("uid").to_pylist() == ["a", "b"]


def test_a_text_argument_the_static_types_miss_is_refused_on_the_schema():
    # The declared types say number, the Arrow schema says text: check_on_schema refuses it.
    declared = {"trips": sql.TableSchema("uid", {"uid": "string", "area": "int",
                                                 "company": "float"})}
    checked = sql.check(sql.parse("SELECT WITH ANONYMIZATION area, ANON_SUM(company, 0, 9) "
                                  "FROM trips GROUP BY area"), declared)
    schemas = {"trips": pa.schema([("uid", pa.string()), ("area", pa.int64()),
                                   ("company", pa.string())])}
    with pytest.raises(QueryError, match="ANON_SUM.*its argument is string"):
        relation.check_on_schema(checked, schemas)
    # And the conversion after the charge is total: text that does not parse is NULL (NaN).
    rows = relation.evaluate(checked, lambda _: pa.table({
        "uid": ["a", "b", "c"], "area": [1, 1, 1], "company": ["2.5", "secret", None]}))
    values = rows.column("__value0").to_pylist()
    assert values[0] == 2.5 and math.isnan(values[1]) and math.isnan(values[2])
