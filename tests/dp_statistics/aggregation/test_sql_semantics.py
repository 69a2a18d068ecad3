"""DP SQL as an analyst coming from BigQuery expects it (issue 33): NULLs skipped by each
aggregate, BigQuery's spelling, stated accuracy, monotone quantiles, and messages that say why.

Noise: tests that compare values use the `seeded_noise` fixture (the OpenDP law and scale,
drawn from seeded numpy), so they repeat exactly; bounds are a few noise scales wide."""
import csv

import numpy as np
import pandas as pd
import pyarrow as pa
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
from sage_tfx.dp_statistics.aggregation import (AggregateKind, BoundsScope,  # noqa: E402
                                                SelectionRule)

from support.dp_sql import compile_sql, refusal  # noqa: E402


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


def test_bigquerys_bounded_counts_are_unit_scoped_sums_of_a_row_indicator():
    query, columns = compile_sql(
        "SELECT WITH DIFFERENTIAL_PRIVACY area, COUNT(*, contribution_bounds_per_group => "
        "(0, 100)) AS n, COUNT(company, contribution_bounds_per_group => (0,100)) AS named "
        "FROM trips GROUP BY area")
    assert columns == ("area", "n", "named")
    for aggregate in query.aggregates:
        # the unit's count in the group clamped, not each row (bounds_rows False)
        assert (aggregate.kind, aggregate.bounds_rows, aggregate.low, aggregate.high) == (
            AggregateKind.SUM, False, 0, 100)


def test_bounded_counts_clamp_each_units_count_in_a_group(tmp_path, store_path, capsys):
    """BigQuery's COUNT(*, contribution_bounds_per_group => (0, 2)): a unit with 5 rows in a
    group counts 2. 200 units with 5 rows each in r1 (2 of them with a null label) and 200
    with 1 row in r2: r1's clamped count is 400 (COUNT(label) also 400: 3 labels a unit), r2's
    200. At epsilon 20 split over two sums of sensitivity 2 (scale 0.2 each), |noise| > 10 has
    probability e^-50."""
    BlockLedger.create(store_path)
    rows = [(f"u{unit}", "r1", "" if k < 2 else "x") for unit in range(200) for k in range(5)]
    rows += [(f"v{unit}", "r2", "x") for unit in range(200)]
    assert ingest(store_path, tmp_path, "visits", ["uid", "region", "label"], rows,
                  "uid:int") == 0
    assert "the unit column 'uid' is read as text" in capsys.readouterr().err
    assert query(store_path, "SELECT WITH DIFFERENTIAL_PRIVACY OPTIONS(public_groups = "
                 "('r1', 'r2')) region, COUNT(*, contribution_bounds_per_group => (0, 2)) AS n, "
                 "COUNT(label, contribution_bounds_per_group => (0, 2)) AS labelled FROM visits "
                 "GROUP BY region") == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    header = next(index for index, line in enumerate(lines) if line.split()[:1] == ["region"])
    released = {line.split()[0]: [float(v) for v in line.split()[1:3]]
                for line in lines[header + 1:] if line.split()[:1] in (["r1"], ["r2"])}
    assert abs(released["r1"][0] - 400) < 10 and abs(released["r1"][1] - 400) < 10
    assert abs(released["r2"][0] - 200) < 10 and abs(released["r2"][1] - 200) < 10


def test_a_subquerys_sum_stays_a_per_unit_reduction():
    query, _ = compile_sql("SELECT WITH DIFFERENTIAL_PRIVACY area, SUM(s, "
                           "contribution_bounds_per_group => (0, 9)) AS total FROM (SELECT uid, "
                           "area, SUM(fare) AS s FROM trips GROUP BY uid, area) GROUP BY area")
    assert [a.output_name for a in query.aggregates] == ["total"]


@pytest.mark.parametrize("text, named", [
    ("SELECT WITH DIFFERENTIAL_PRIVACY area, COUNT(*, contribution_bounds_per_row => (0, 5)) "
     "FROM trips GROUP BY area", "COUNT clamps each unit's count in a group: use "
     "contribution_bounds_per_group"),
    ("SELECT WITH DIFFERENTIAL_PRIVACY area, COUNT(*, contribution_bounds_per_group => (-1, 5)"
     ") FROM trips GROUP BY area", "a count's bounds must satisfy 0 <= lower < upper"),
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


# ---------------------------------------------------------------- stated accuracy
from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregationQuery,  # noqa: E402
                                                NoiseKind, aggregate, aggregators, plan)

PARTITIONS = 600


def _partitions_frame():
    """600 partitions of 6 units with 2 rows each, values spread over [0, 12] (clamped to
    [0, 10]), one NULL per unit."""
    rng = np.random.default_rng(3)
    rows = []
    for key in range(PARTITIONS):
        for unit in range(6):
            rows.append((key, f"{key}-{unit}", rng.uniform(0, 12)))
            rows.append((key, f"{key}-{unit}", np.nan))
    return pd.DataFrame(rows, columns=["key", "uid", "x"])


AGGREGATES = (Aggregate.count(), Aggregate(AggregateKind.SUM, "x", 0, 10, name="total"),
              Aggregate(AggregateKind.AVG, "x", 0, 10, name="mean"),
              Aggregate(AggregateKind.VAR, "x", 0, 10, name="var"),
              Aggregate(AggregateKind.STDDEV, "x", 0, 10, name="sd"),
              Aggregate.median("x", 0, 10, name="median"))


def _noiseless(query, values, sensitivity, epsilon, delta, l2_sensitivity=None):
    from dp_accounting import dp_event
    from sage_tfx.mechanisms import Release
    return Release(np.asarray(values, dtype=np.float64), dp_event.NoOpDpEvent())


@pytest.mark.parametrize("noise", [NoiseKind.LAPLACE, NoiseKind.GAUSSIAN])
def test_the_stated_intervals_cover_the_noiseless_value_95_percent_of_the_time(
        noise, seeded_noise, monkeypatch):
    """Each partition's interval should cover the value the noise was added to (the release
    without noise) at least 95% of the time: over 600 partitions, below 552 covered
    (binomial, p = 0.95) happens with probability < 4e-4 for an exact 95% interval; the
    conservative ones cover more. The stated stddev of COUNT and SUM is their errors' (within
    10%: the sample sd's standard error is 2.9% here)."""
    frame = _partitions_frame()
    query = AggregationQuery(("key",), "uid", AGGREGATES, max_partitions_contributed=1,
                             max_contributions_per_partition=2, selection=SelectionRule.PUBLIC,
                             public_partitions=tuple((k,) for k in range(PARTITIONS)),
                             noise=noise)
    budget = plan(query, 3.0, 1e-6)
    noisy = aggregate(frame, query, budget, seed=1, intervals=True)
    with monkeypatch.context() as patched:
        patched.setattr(aggregators, "_noisy", _noiseless)
        truth = aggregate(frame, query, budget, seed=1).table
    stated = noisy.intervals
    for name in ("count", "total", "mean", "var", "sd", "median"):
        covered = ((stated[f"{name}_ci_low"] <= truth[name] + 1e-9)
                   & (truth[name] - 1e-9 <= stated[f"{name}_ci_high"])).sum()
        assert covered >= 552, (name, covered)
    for name in ("count", "total"):
        errors = noisy.table[name] - truth[name]
        assert np.std(errors) == pytest.approx(stated[f"{name}_stddev"].iloc[0], rel=0.1), name


@pytest.mark.parametrize("noise", [NoiseKind.LAPLACE, NoiseKind.GAUSSIAN])
def test_a_quantile_trees_interval_covers_the_noiseless_median_and_is_informative(
        noise, seeded_noise, monkeypatch):
    """With 300 values per partition (epsilon 1) the tree is informative: the median's interval
    (rank noise through the descent, accuracy.py) is far narrower than [L, U] and still covers
    the noiseless median in >= 366 of 400 partitions (an exact 95% interval falls below that
    with probability < 1e-3; the method is conservative: measured 100%)."""
    rng = np.random.default_rng(3)
    frame = pd.DataFrame({"key": np.repeat(np.arange(400), 300), "uid": np.arange(400 * 300),
                          "x": rng.normal(4.0, 2.0, 400 * 300)})
    query = AggregationQuery(("key",), "uid", (Aggregate.median("x", 0, 10, name="median"),),
                             max_partitions_contributed=1, max_contributions_per_partition=1,
                             selection=SelectionRule.PUBLIC,
                             public_partitions=tuple((k,) for k in range(400)), noise=noise)
    budget = plan(query, 1.0, 1e-6)
    noisy = aggregate(frame, query, budget, seed=1, intervals=True)
    with monkeypatch.context() as patched:
        patched.setattr(aggregators, "_noisy", _noiseless)
        truth = aggregate(frame, query, budget, seed=1).table["median"]
    low, high = noisy.intervals["median_ci_low"], noisy.intervals["median_ci_high"]
    assert ((low <= truth + 1e-9) & (truth - 1e-9 <= high)).sum() >= 366
    assert (high - low).mean() < 2.0  # [L, U] is 10 wide


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_query_intervals_add_three_columns_per_aggregate(speeds, tmp_path, suffix, capsys):
    store, _ = speeds
    out = tmp_path / f"release{suffix}"
    assert query(store, "SELECT WITH DIFFERENTIAL_PRIVACY OPTIONS(max_groups_contributed = 1) "
                        "region, COUNT(*) AS n, AVG(speed, contribution_bounds_per_group => "
                        "(0, 100)) AS mean_speed FROM drives GROUP BY region", "--intervals",
                 out=out) == 0, capsys.readouterr().err
    released = pd.read_parquet(out) if suffix == ".parquet" else pd.read_csv(out)
    assert list(released.columns) == [
        "region", "n", "n_stddev", "n_ci_low", "n_ci_high",
        "mean_speed", "mean_speed_stddev", "mean_speed_ci_low", "mean_speed_ci_high"]
    assert (released["mean_speed_ci_low"] <= released["mean_speed"]).all()
    assert (released["mean_speed"] <= released["mean_speed_ci_high"]).all()
    assert (released["n_stddev"] > 0).all()


def test_ntile_cut_points_are_released_in_order(tmp_path, store_path, seeded_noise, capsys):
    """Before issue 33 each cut point came from its own noisy histogram, unsorted: at this
    epsilon most of the 40 groups' quartiles were out of order."""
    BlockLedger.create(store_path)
    rows = [(f"u{i}", f"g{i % 40}", f"{(i * 7) % 10}") for i in range(400)]
    assert ingest(store_path, tmp_path, "t", ["uid", "g", "x"], rows, "x:float") == 0
    groups = ", ".join(f"'g{i}'" for i in range(40))
    out = tmp_path / "release.csv"
    assert query(store_path, f"SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1, "
                             f"public_groups = ({groups})) g, ANON_NTILE(x, 4, 0, 10) AS q "
                             "FROM t GROUP BY g", "--intervals", epsilon="0.5", out=out) == 0, \
        capsys.readouterr().err
    released = pd.read_csv(out)
    cuts = released[["q_1", "q_2", "q_3"]].to_numpy()
    assert (np.diff(cuts, axis=1) >= 0).all()
    for end in ("ci_low", "ci_high"):
        assert (np.diff(released[[f"q_{k}_{end}" for k in (1, 2, 3)]].to_numpy(), axis=1)
                >= 0).all()


def test_non_negative_counts_are_an_option_stated_in_the_release(tmp_path, store_path,
                                                                 seeded_noise, capsys):
    BlockLedger.create(store_path)
    rows = [(f"u{i}", f"g{i % 60}", "1") for i in range(60)]  # one unit per group
    assert ingest(store_path, tmp_path, "t", ["uid", "g", "x"], rows, "x:float") == 0
    groups = ", ".join(f"'g{i}'" for i in range(60))
    text = (f"SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1, public_groups = "
            f"({groups})) g, ANON_COUNT(*) AS n FROM t GROUP BY g")
    plain, clamped = tmp_path / "plain.csv", tmp_path / "clamped.csv"
    assert query(store_path, text, epsilon="0.5", out=plain) == 0
    assert "clamped" not in capsys.readouterr().out  # off by default
    assert (pd.read_csv(plain)["n"] < 0).any()  # 1 + Laplace(16): negative about 47% of the time
    assert query(store_path, text, "--non-negative", epsilon="0.5", out=clamped) == 0
    assert "counts clamped at 0 by post-processing" in capsys.readouterr().out
    assert (pd.read_csv(clamped)["n"] >= 0).all()
    with open(f"{clamped}.guarantee.json") as handle:
        assert "counts clamped at 0" in handle.read()


# ---------------------------------------------------------------- messages
def test_when_no_group_passes_selection_the_release_says_why_in_public_numbers(
        tmp_path, store_path, capsys):
    BlockLedger.create(store_path)
    rows = [(f"u{i}", f"g{i % 50}", "1") for i in range(100)]  # 2 units per group
    assert ingest(store_path, tmp_path, "t", ["uid", "g", "x"], rows, "x:float") == 0
    text = ("SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 4) g, "
            "ANON_COUNT(*) AS n FROM t GROUP BY g")
    assert query(store_path, text, epsilon="0.3", delta="1e-6") == 0
    printed = capsys.readouterr().out
    first = next(line for line in printed.splitlines() if line.startswith("no group"))
    assert first.startswith("no group released: partition selection (weighted_gaussian, "
                            "epsilon 0.15 of the query's 0.3"), printed
    threshold = int(first.split("only from about ")[1].split()[0])
    assert threshold > 2  # above the 2 units each group has: why nothing passed
    for option in ("public_groups", "raise --epsilon", "lower max_groups_contributed"):
        assert option in first


@pytest.mark.parametrize("rule", ["laplace_threshold", "gaussian_threshold",
                                  "truncated_geometric"])
def test_every_selection_rule_says_from_how_many_units_it_keeps_a_group(
        rule, tmp_path, store_path, capsys):
    """The weighted Gaussian's message above, for the other rules (gaussian_threshold's
    failed after the charge: its threshold was re-derived in the front end from a name the
    mechanisms package does not export)."""
    BlockLedger.create(store_path)
    rows = [(f"u{i}", f"g{i % 50}", "1") for i in range(100)]
    assert ingest(store_path, tmp_path, "t", ["uid", "g", "x"], rows, "x:float") == 0
    text = (f"SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 4, selection = {rule}) "
            "g, ANON_COUNT(*) AS n FROM t GROUP BY g")
    assert query(store_path, text, epsilon="0.3", delta="1e-6") == 0
    first = next(line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("no group"))
    assert first.startswith(f"no group released: partition selection ({rule}, ")
    assert int(first.split("only from about ")[1].split()[0]) > 2


def test_the_truncated_geometric_threshold_stated_is_where_its_coins_reach_one_half(
        monkeypatch):
    """The number the message states is read from the keep probabilities the mechanism draws
    its coins with (designed at delta (1 - 2^-10)): at C = 4, epsilon 1, delta 1e-6 a front-end
    copy of the rule at delta itself said 53, where the coin is below 1/2."""
    from sage_tfx.dp_statistics.aggregation import frontend, sql
    from sage_tfx.mechanisms import selection

    text = ("SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 4, selection = "
            "truncated_geometric) g, ANON_COUNT(*) AS n FROM t GROUP BY g")
    schema = sql.TableSchema("uid", {"uid": "string", "g": "string"})
    arrow = pa.schema([("uid", pa.string()), ("g", pa.string())])
    planned = frontend.plan_query(sql.parse(text), {"t": schema}, {"t": arrow}, 2.0, 1e-6)
    step = planned.budget.step("partition_selection")
    assert (step.noise_epsilon, step.delta) == (1.0, 1e-6)
    message = frontend.nothing_released(planned, "uid")
    stated = int(message.split("only from about ")[1].split()[0])

    coins = {}  # keep probability of each count, as the mechanism flips its coins
    real = selection._exact_bernoulli
    monkeypatch.setattr(selection, "_exact_bernoulli", lambda probability, size: (
        coins.setdefault(len(coins), probability), real(probability, size))[1])
    selection.truncated_geometric_selection(np.array([stated - 1, stated]),
                                            max_partitions_per_unit=4, epsilon=1.0, delta=1e-6)
    assert coins[0] < 0.5 <= coins[1], (stated, coins)


def test_a_denial_names_the_free_budget_of_each_block(tmp_path, store_path, capsys):
    BlockLedger.create(store_path)
    rows = [(f"u{i}", "g", "1") for i in range(10)]
    assert ingest(store_path, tmp_path, "t", ["uid", "g", "x"], rows, "x:float") == 0
    assert query(store_path, "SELECT WITH DIFFERENTIAL_PRIVACY COUNT(*) AS n FROM t",
                 epsilon="150", delta="0") == 3
    err = capsys.readouterr().err
    assert "only 0 block(s) of table t can pay" in err and "t.users-0-of-1:" in err, err
    assert "100" in err.split("t.users-0-of-1:")[1]  # its free epsilon, as ledger request says


def test_the_documented_bigquery_query_runs_unchanged(speeds, capsys):
    """docs/statistics.md's first ```sql block, exactly as written, with the flags it shows."""
    import re
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[3] / "docs" / "statistics.md").read_text()
    documented = re.search(r"```sql\n(.*?)```", guide, re.S).group(1)
    store, _ = speeds
    assert query(store, documented, "--intervals", epsilon="1", delta="1e-6") == 0, \
        capsys.readouterr().err
    header = next(line for line in capsys.readouterr().out.splitlines()
                  if line.split()[:1] == ["region"])
    assert header.split()[:6] == ["region", "trips", "trips_stddev", "trips_ci_low",
                                  "trips_ci_high", "speeds"]


def test_a_later_file_missing_or_adding_a_column_is_refused_before_anything_is_registered(
        tmp_path, store_path, capsys):
    BlockLedger.create(store_path)
    january = [("u1", "a", "3", "2013-01-05")]

    def monthly(name, header, rows, start, end):
        path = tmp_path / f"{name}.csv"
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(rows)
        return main(["ingest", "--store", store_path, "--csv", str(path), "--table", "trips",
                     "--unit-column", "uid", "--time-column", "ts", "--start", start, "--end",
                     end, "--types", "fare:float", "--epsilon", "1", "--delta", "1e-6",
                     "--out", str(tmp_path / f"blocks-{name}")])

    assert monthly("jan", ["uid", "key", "fare", "ts"], january, "2013-01", "2013-02") == 0
    before = [b.block_id for b in BlockLedger(store_path).blocks()]
    capsys.readouterr()
    assert monthly("feb", ["uid", "fare", "ts", "tip"], [("u1", "3", "2013-02-05", "1")],
                   "2013-02", "2013-03") == 2
    err = capsys.readouterr().err
    assert "missing ['key'], extra ['tip']" in err, err
    assert [b.block_id for b in BlockLedger(store_path).blocks()] == before


def test_sorting_quantiles_sorts_their_interval_ends_and_keeps_each_ones_stddev():
    """Monotone quantiles are post-processing: the values and the interval ends are sorted
    by q, but a stddev is a scale, not a value ordered by q: each quantile keeps its own."""
    query = AggregationQuery(("key",), "uid", (
        Aggregate(AggregateKind.QUANTILE, "x", 0, 10, q=0.9, name="p90"),
        Aggregate(AggregateKind.QUANTILE, "x", 0, 10, q=0.1, name="p10")))
    table = pd.DataFrame({"p90": [2.0], "p10": [5.0]})  # out of order after the noise
    stated = {"p90": (np.array([0.5]), np.array([1.0]), np.array([3.0])),
              "p10": (np.array([1.5]), np.array([4.0]), np.array([6.0]))}
    aggregators._quantiles_in_order(query, {"p90": (0, 10), "p10": (0, 10)}, table, stated)
    assert table.loc[0, ["p10", "p90"]].tolist() == [2.0, 5.0]
    assert [stated["p10"][1][0], stated["p90"][1][0]] == [1.0, 4.0]  # low ends sorted
    assert [stated["p10"][2][0], stated["p90"][2][0]] == [3.0, 6.0]  # high ends sorted
    assert [stated["p10"][0][0], stated["p90"][0][0]] == [1.5, 0.5]  # own stddev each
