"""DP SQL as an analyst coming from BigQuery expects it (issue 33): NULLs skipped by each
aggregate, BigQuery's spelling, stated accuracy, monotone quantiles, and messages that say why.

Noise: tests that compare values use the `seeded_noise` fixture (the OpenDP law and scale,
drawn from seeded numpy), so they repeat exactly; bounds are a few noise scales wide."""
import csv

import numpy as np
import pandas as pd
import pytest

from sage_tfx.cli import main
from sage_tfx.sage_access import BlockLedger


def ingest(store, tmp_path, name, header, rows, types, **options):
    path = tmp_path / f"{name}.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    arguments = ["ingest", "--store", store, "--csv", str(path), "--unit-column", "uid",
                 "--user-blocks", "1", "--types", types, "--epsilon", "100", "--delta", "1e-3",
                 "--out", str(tmp_path / f"blocks-{name}")]
    for option, value in options.items():
        arguments += [f"--{option.replace('_', '-')}", value]
    return main(arguments)


def query(store, sql, *flags, epsilon="20", delta="1e-5", out=None):
    arguments = ["query", "--store", store, "--window", "1", "--epsilon", epsilon,
                 "--delta", delta, *flags]
    if out is not None:
        arguments += ["--out", str(out)]
    return main(arguments + [sql])


@pytest.fixture
def speeds(tmp_path, store_path):
    """The issue's table: 60% of the speed cells are NaN, empty or "fast"; the others are
    uniform on [40, 60] (mean 50). 600 units of 2 rows each, in region r1 or r2."""
    BlockLedger.create(store_path)
    rng = np.random.default_rng(7)
    rows = []
    for unit in range(600):
        for _ in range(2):
            bad = rng.random() < 0.6
            cell = rng.choice(["NaN", "", "fast"]) if bad else f"{rng.uniform(40, 60):.3f}"
            rows.append((f"u{unit}", f"r{1 + unit % 2}", cell))
    assert ingest(store_path, tmp_path, "drives", ["uid", "region", "speed"], rows,
                  "speed:float") == 0
    valid = sum(1 for row in rows if row[2] not in ("NaN", "", "fast"))
    return store_path, valid


def test_null_nan_and_unparseable_cells_are_skipped_by_each_aggregate(speeds, tmp_path,
                                                                     seeded_noise, capsys):
    store, valid = speeds
    out = tmp_path / "release.csv"
    assert query(store, "SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1, "
                        "public_groups = ('r1', 'r2')) region, ANON_COUNT(*) AS rows_, "
                        "ANON_COUNT(speed) AS speeds, ANON_AVG(speed, 0, 100) AS mean_speed, "
                        "ANON_SUM(speed, 0, 200) AS total FROM drives GROUP BY region",
                 out=out) == 0, capsys.readouterr().err
    released = pd.read_csv(out)
    # Before issue 33 the bad cells were stored as 0: the mean was about 20 and COUNT(speed)
    # counted every row. Now they are NULL: the mean is of the valid speeds (about 50) and
    # COUNT(speed) counts the valid cells only (noise scale of each a few units here).
    assert released["mean_speed"].between(47, 53).all(), released
    assert abs(released["speeds"].sum() - valid) < 40, (released, valid)
    assert abs(released["rows_"].sum() - 1200) < 40, released
    assert released["total"].sum() == pytest.approx(50 * valid, rel=0.1)


# ---------------------------------------------------------------- BigQuery's spelling
from sage_tfx.dp_statistics.aggregation import (AggregateKind, BoundsScope, QueryError,  # noqa: E402
                                                SelectionRule, sql)

SCHEMAS = {"trips": sql.TableSchema("uid", {"uid": "string", "area": "int", "fare": "float"})}


def compile_sql(text):
    return sql.to_query(sql.check(sql.parse(text), SCHEMAS))


def refusal(text):
    with pytest.raises(QueryError) as error:
        compile_sql(text)
    return str(error.value)


def test_bigquerys_aggregates_and_named_bounds_are_the_operators():
    query, columns = compile_sql(
        "SELECT WITH DIFFERENTIAL_PRIVACY OPTIONS(epsilon = 1, delta = 1e-6, "
        "max_groups_contributed = 2, privacy_unit_column = uid) area, COUNT(*) AS n, "
        "COUNT(fare) AS fares, SUM(fare, contribution_bounds_per_group => (0, 100)) AS total, "
        "SUM(fare, contribution_bounds_per_row => (0, 50)) AS row_total, "
        "AVG(fare, contribution_bounds_per_group => (0, 50)) AS mean_fare, "
        "PERCENTILE_CONT(fare, 0.9, contribution_bounds_per_row => (0, 50)) AS p90, SUM(fare) "
        "FROM trips GROUP BY area")
    assert columns == ("area", "n", "fares", "total", "row_total", "mean_fare", "p90",
                       "sum_fare")
    by_name = {a.output_name: a for a in query.aggregates}
    assert by_name["n"].kind is AggregateKind.COUNT and by_name["n"].column is None
    assert by_name["fares"].kind is AggregateKind.COUNT and by_name["fares"].column
    # per_group on SUM clamps the unit's total in the group (BigQuery's), per_row each row
    assert (by_name["total"].low, by_name["total"].high, by_name["total"].bounds_rows) == (
        0, 100, False)
    assert by_name["row_total"].scope is BoundsScope.ROW
    assert (by_name["mean_fare"].kind, by_name["mean_fare"].high) == (AggregateKind.AVG, 50)
    assert (by_name["p90"].kind, by_name["p90"].q) == (AggregateKind.QUANTILE, 0.9)
    assert by_name["sum_fare"].bounds_inferred  # no bounds: inferred with DP
    assert query.max_partitions_contributed == 2


def test_a_subquerys_sum_stays_a_per_unit_reduction():
    query, _ = compile_sql("SELECT WITH DIFFERENTIAL_PRIVACY area, SUM(s, "
                           "contribution_bounds_per_group => (0, 9)) AS total FROM (SELECT uid, "
                           "area, SUM(fare) AS s FROM trips GROUP BY uid, area) GROUP BY area")
    assert [a.output_name for a in query.aggregates] == ["total"]


@pytest.mark.parametrize("text, named", [
    ("SELECT WITH DIFFERENTIAL_PRIVACY area, COUNT(*, contribution_bounds_per_group => (0, 5)) "
     "FROM trips GROUP BY area", "max_rows_contributed_per_group"),
    ("SELECT WITH DIFFERENTIAL_PRIVACY area, SUM(fare, bounds => (0, 5)) FROM trips "
     "GROUP BY area", "give one of contribution_bounds_per_group"),
    ("SELECT WITH DIFFERENTIAL_PRIVACY area, SUM(fare, 0, 5, contribution_bounds_per_row "
     "=> (0, 5)) FROM trips GROUP BY area", "give the bounds once"),
    ("SELECT WITH DIFFERENTIAL_PRIVACY area, PERCENTILE_CONT(fare, 1.5) FROM trips "
     "GROUP BY area", "the percentile must lie in [0, 1]"),
    ("SELECT WITH DIFFERENTIAL_PRIVACY area, SUM(fare) + 1 FROM trips GROUP BY area",
     "SUM(fare) + 1: an ANON_ aggregate inside an expression"),
    ("SELECT WITH DIFFERENTIAL_PRIVACY OPTIONS(public_groups = (1)) COUNT(*) FROM trips",
     "a query without GROUP BY releases one row"),
])
def test_bigquery_spellings_outside_what_runs_are_refused_in_the_users_words(text, named):
    message = refusal(text)
    assert named in message and "BQ_" not in message, message


def test_a_query_without_group_by_releases_the_total_as_one_public_group():
    query, columns = compile_sql("SELECT WITH DIFFERENTIAL_PRIVACY COUNT(*) AS n, "
                                 "AVG(fare, contribution_bounds_per_group => (0, 50)) AS m "
                                 "FROM trips")
    assert columns == ("n", "m")  # the constant key is not released
    assert query.selection is SelectionRule.PUBLIC and query.public_partitions == ((1,),)


def test_options_epsilon_and_delta_must_be_the_grants(speeds, capsys):
    store, _ = speeds
    text = ("SELECT WITH DIFFERENTIAL_PRIVACY OPTIONS(epsilon = 2, delta = 1e-5, "
            "privacy_unit_column = uid) COUNT(*) AS n FROM drives")
    assert query(store, text, epsilon="1", delta="1e-5") == 2
    assert "OPTIONS epsilon = 2, but the grant's epsilon is 1" in capsys.readouterr().err
    assert BlockLedger(store).grant_records() == []
    assert query(store, text, epsilon="2", delta="1e-5") == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split() == ["n"]  # one row, the total, no key column


def test_a_parse_error_is_shown_on_the_users_text_without_escapes():
    text = ("SELECT WITH DIFFERENTIAL_PRIVACY OPTIONS(max_groups_contributed = 1)\n"
            "  area, COUNT(*) AS n\nFROM trips WHERE fare > ) GROUP BY area")
    message = refusal(text)
    assert "\x1b" not in message
    # line 3 of the text as written, the column of its ")"; sqlglot's class paths shortened
    assert "at line 3, column 25" in message and 'near "AS n FROM trips WHERE fare > )"' in \
        message and "<class" not in message, message
