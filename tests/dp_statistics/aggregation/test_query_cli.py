"""`sage-tfx ingest` then `sage-tfx query` on a temporary SQLite ledger, end to end through the
console entry point: what is registered, what is released with which guarantee, and that every
refused query leaves the ledger exactly as it was (nothing charged)."""
import csv
import json
import re

import pandas as pd
import pytest

from sage_tfx.cli import main
from sage_tfx.dp_statistics import tables
from sage_tfx.sage_access import BlockLedger

QUERY = ("SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 2, public_groups = "
         "('a', 'b')) key, ANON_COUNT(*) AS n, ANON_AVG(fare, 0, 50) AS mean_fare, "
         "ANON_MEDIAN(fare, 0, 50) AS median_fare FROM trips WHERE fare >= 0 GROUP BY key")


def write_trips(path, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "key", "fare", "ts"])
        writer.writerows(rows)


@pytest.fixture
def ledger_with_trips(tmp_path, store_path):
    BlockLedger.create(store_path)
    rows = [(f"u{i % 40}", "ab"[i % 2], 10 + i % 7, f"2013-01-{1 + i % 28:02d}T10:00:00")
            for i in range(300)]
    rows += [("u1", "a", "oops", "2013-02-03"),  # a bad fare is NULL
             ("u2", "b", "12", "not a time"),  # no usable time: dropped
             ("", "a", "3", "2013-01-05"),  # no unit: dropped
             ("u3", "a", "7", "1359900000")]  # Unix seconds (2013-02-03)
    write_trips(tmp_path / "trips.csv", rows)
    code = main(["ingest", "--store", store_path, "--csv", str(tmp_path / "trips.csv"),
                 "--unit-column", "uid", "--time-column", "ts", "--period", "month",
                 "--start", "2013-01", "--end", "2013-04", "--types", "fare:float",
                 "--epsilon", "2", "--delta", "1e-5", "--out", str(tmp_path / "blocks")])
    assert code == 0
    return store_path


def ledger_state(store_path):
    ledger = BlockLedger(store_path)
    return ([(b.block_id, list(b.spent), b.charges) for b in ledger.blocks()],
            ledger.grant_records())


def test_ingest_registers_the_public_schedule_with_the_unit_and_no_counts(
        ledger_with_trips, tmp_path, capsys):
    ledger = BlockLedger(ledger_with_trips)
    # March has no row and is a block all the same: which blocks exist never depends on data.
    assert [b.block_id for b in ledger.blocks()] == ["trips.2013-01", "trips.2013-02",
                                                     "trips.2013-03"]
    table = tables.find_table(ledger, "trips")
    assert (table.unit_column, table.time_column, table.partition) == ("uid", "ts", "month")
    assert dict(table.columns) == {"uid": "string", "key": "string", "fare": "float",
                                   "ts": "int"}
    february = tables.read_blocks(ledger, table, ["trips.2013-02"]).to_pydict()
    assert sorted(zip(february["uid"], february["fare"])) == [("u1", None), ("u3", 7.0)]
    printed = capsys.readouterr().out
    assert "302" not in printed and "300" not in printed  # no row count leaves ingest
    # Blocks are immutable: the same months again are refused before anything is written.
    code = main(["ingest", "--store", ledger_with_trips, "--csv", str(tmp_path / "trips.csv"),
                 "--unit-column", "uid", "--time-column", "ts", "--start", "2013-03",
                 "--end", "2013-04", "--types", "fare:float", "--epsilon", "2", "--delta",
                 "1e-5", "--out", str(tmp_path / "again")])
    assert code == 2 and "already has block(s) ['trips.2013-03']" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_query_charges_one_grant_and_prints_the_release_and_its_guarantee(
        ledger_with_trips, tmp_path, capsys):
    out = tmp_path / "release.csv"
    code = main(["query", "--store", ledger_with_trips, "--window", "2", "--epsilon", "1",
                 "--delta", "1e-6", "--out", str(out), QUERY])
    printed = capsys.readouterr().out
    assert code == 0, printed
    # The delta printed is what the steps spend (none here: Laplace noise, public groups).
    assert re.search(r"guarantee: \(1, [0-9.e-]+\)-DP for adding or removing all rows of one "
                     r"uid within the blocks read", printed), printed
    released = pd.read_csv(out)
    assert list(released.columns) == ["key", "n", "mean_fare", "median_fare"]
    assert sorted(released["key"]) == ["a", "b"]  # public groups: both, no selection
    grants = BlockLedger(ledger_with_trips).grant_records()
    assert len(grants) == 1
    assert sorted(grants[0]["blocks"]) == ["trips.2013-02", "trips.2013-03"]
    assert (grants[0]["epsilon"], grants[0]["delta"]) == (1.0, 1e-6)
    # One share per step of the query's plan (COUNT(*) may be post-processed from the AVG's
    # noisy count, with no step of its own).
    assert {"mean_fare", "median_fare"} <= set(grants[0]["split"]) <= {"n", "mean_fare",
                                                                       "median_fare"}
    # Its shares were consumed: the same grant cannot pay for a second release.
    ledger = BlockLedger(ledger_with_trips)
    with pytest.raises(Exception, match="already used"):
        ledger.use_share(ledger.find_grant(grants[0]["grant_id"]), "mean_fare", "a second run")


@pytest.mark.parametrize("query, code, message", [
    ("SELECT WITH ANONYMIZATION t.key, ANON_COUNT(*) FROM trips t JOIN trips s "
     "ON t.key = s.key GROUP BY t.key", 2, "JOIN trips AS s ON t.key = s.key"),
    ("SELECT WITH ANONYMIZATION key, ANON_SUM(s, 0, 9) FROM (SELECT uid, key, SUM(fare) AS s "
     "FROM trips GROUP BY key) GROUP BY key", 2, "GROUP BY key is not grouped by the privacy "
                                                 "unit uid"),
    ("SELECT WITH ANONYMIZATION key, ANON_SUM(tip, 0, 9) FROM trips GROUP BY key", 2,
     "unknown column tip"),
    ("SELECT WITH ANONYMIZATION OPTIONS(infer_bounds = false) key, ANON_SUM(fare) FROM trips "
     "GROUP BY key", 2, "no bounds"),
    ("SELECT WITH ANONYMIZATION key, ANON_COUNT(*) FROM trips WHERE key > 3 GROUP BY key", 2,
     "column types"),
    ("SELECT WITH ANONYMIZATION key, ANON_COUNT(*) FROM cabs GROUP BY key", 2,
     "no table 'cabs'"),
])
def test_refused_queries_charge_nothing(ledger_with_trips, capsys, query, code, message):
    before = ledger_state(ledger_with_trips)
    assert main(["query", "--store", ledger_with_trips, "--window", "2", "--epsilon", "1",
                 "--delta", "1e-6", query]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert ledger_state(ledger_with_trips) == before


def test_a_grant_too_small_is_denied_before_anything_is_charged(ledger_with_trips, capsys):
    before = ledger_state(ledger_with_trips)
    # The blocks' ceiling is epsilon 2: a query asking 3 is denied (exit 3, as `ledger request`).
    assert main(["query", "--store", ledger_with_trips, "--window", "2", "--epsilon", "3",
                 "--delta", "1e-6", QUERY]) == 3
    assert "denied" in capsys.readouterr().err
    assert main(["query", "--store", ledger_with_trips, "--blocks", "trips.2013-01",
                 "--epsilon", "3", "--delta", "1e-6", QUERY]) == 3
    assert ledger_state(ledger_with_trips) == before
    assert BlockLedger(ledger_with_trips).audit().problems == []


def test_user_blocks_make_the_guarantee_user_level(tmp_path, store_path, capsys):
    BlockLedger.create(store_path)
    write_trips(tmp_path / "rides.csv", [(f"u{i % 30}", "ab"[i % 2], 10, "2013-01-01")
                                         for i in range(200)])
    assert main(["ingest", "--store", store_path, "--csv", str(tmp_path / "rides.csv"),
                 "--unit-column", "uid", "--user-blocks", "4", "--types", "fare:float",
                 "--epsilon", "2", "--delta", "1e-5", "--out", str(tmp_path / "blocks")]) == 0
    ledger = BlockLedger(store_path)
    table = tables.find_table(ledger, "rides")
    ids = [b.block_id for b in ledger.blocks()]
    assert ids == [f"rides.users-{k}-of-4" for k in range(4)]
    per_block = [set(tables.read_blocks(ledger, table, [b]).column("uid").to_pylist())
                 for b in ids]
    assert all(a.isdisjoint(b) for i, a in enumerate(per_block) for b in per_block[i + 1:])
    assert main(["query", "--store", store_path, "--blocks", ",".join(ids), "--epsilon", "1",
                 "--delta", "1e-6", QUERY.replace("FROM trips", "FROM rides")]) == 0
    printed = capsys.readouterr().out
    assert "for adding or removing all rows of one uid" in printed
    assert "within the blocks read" not in printed
    record = json.loads(json.dumps(ledger.grant_records()[0]["split"]))
    assert record  # the grant recorded its split among the query's steps


def test_a_join_using_the_unit_reads_and_charges_both_tables_blocks(ledger_with_trips, tmp_path,
                                                                     capsys):
    with open(tmp_path / "riders.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "age"])
        writer.writerows([(f"u{i}", 20 + i) for i in range(40)])
    assert main(["ingest", "--store", ledger_with_trips, "--csv", str(tmp_path / "riders.csv"),
                 "--unit-column", "uid", "--user-blocks", "2", "--types", "age:int",
                 "--epsilon", "2", "--delta", "1e-5", "--out", str(tmp_path / "riders")]) == 0
    code = main(["query", "--store", ledger_with_trips, "--window", "2", "--epsilon", "1",
                 "--delta", "1e-6",
                 "SELECT WITH ANONYMIZATION OPTIONS(public_groups = ('a', 'b')) t.key, "
                 "ANON_AVG(age, 0, 100) AS mean_age FROM trips t JOIN riders r USING (uid) "
                 "WHERE fare > 0 GROUP BY t.key"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    # Time blocks for trips: the unit is protected within the blocks read, not overall.
    assert "all rows of one uid within the blocks read" in printed
    [grant] = BlockLedger(ledger_with_trips).grant_records()
    assert sorted(grant["blocks"]) == ["riders.users-0-of-2", "riders.users-1-of-2",
                                       "trips.2013-02", "trips.2013-03"]


def _neighbour_with_a_cell(tmp_path, name, extra_rows):
    """A ledger whose trips table has a text column `note` of numbers written as text, plus
    `extra_rows` (the added unit's)."""
    directory = tmp_path / name
    directory.mkdir()
    store = str(directory / "ledger.sqlite")
    BlockLedger.create(store)
    rows = [(f"u{i % 20}", "a", f"{i % 5}", f"2013-01-{1 + i % 28:02d}T10:00:00")
            for i in range(60)] + extra_rows
    with open(directory / "trips.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "key", "note", "ts"])
        writer.writerows(rows)
    assert main(["ingest", "--store", store, "--csv", str(directory / "trips.csv"),
                 "--unit-column", "uid", "--time-column", "ts", "--period", "month",
                 "--start", "2013-01", "--end", "2013-02", "--epsilon", "2", "--delta", "1e-5",
                 "--out", str(directory / "blocks")]) == 0
    return store


@pytest.mark.parametrize("argument", [
    "(note)", "COALESCE(note, '0')", "per_unit", "note / 1"])
def test_a_text_argument_is_refused_before_the_charge_on_neighbouring_tables_alike(
        tmp_path, capsys, argument):
    """Adding one unit whose text cell does not parse must not change the exit code nor put
    the cell in the output: the query is refused on the schema, before anything is charged."""
    source = ("(SELECT uid, key, MIN(note) AS per_unit FROM trips GROUP BY uid, key)"
              if argument == "per_unit" else "trips")
    query = (f"SELECT WITH ANONYMIZATION OPTIONS(public_groups = ('a')) key, "
             f"ANON_SUM({argument}, 0, 10) AS s FROM {source} GROUP BY key")
    outcomes = []
    for name, extra in (("without", []), ("with", [("u99", "a", "secret-cell-77",
                                                      "2013-01-05T10:00:00")])):
        store = _neighbour_with_a_cell(tmp_path, name, extra)
        capsys.readouterr()
        before = ledger_state(store)
        code = main(["query", "--store", store, "--window", "1", "--epsilon", "1",
                     "--delta", "1e-6", query])
        captured = capsys.readouterr()
        assert "secret-cell-77" not in captured.out + captured.err
        assert ledger_state(store) == before  # nothing charged
        outcomes.append((code, captured.err.replace(name, "")))
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == 2, outcomes


@pytest.fixture
def rdp_ledger_with_trips(tmp_path, store_path):
    """An rdp ledger with one month of 30 trips, each of its own unit, all in group 'a'."""
    BlockLedger.create(store_path, accounting="rdp")
    write_trips(tmp_path / "trips.csv", [(f"u{i}", "a", 10, "2013-01-05") for i in range(30)])
    assert main(["ingest", "--store", store_path, "--csv", str(tmp_path / "trips.csv"),
                 "--unit-column", "uid", "--time-column", "ts", "--start", "2013-01",
                 "--end", "2013-02", "--types", "fare:float", "--epsilon", "2", "--delta",
                 "1e-5", "--out", str(tmp_path / "blocks")]) == 0
    return store_path


def test_an_rdp_ledger_refuses_a_selection_that_spends_delta_outside_its_event(
        rdp_ledger_with_trips, capsys):
    store_path = rdp_ledger_with_trips
    before = ledger_state(store_path)
    assert main(["query", "--store", store_path, "--window", "1", "--epsilon", "1",
                 "--delta", "1e-6", "SELECT WITH ANONYMIZATION OPTIONS(selection = "
                 "gaussian_threshold) key, ANON_SUM(fare, 0, 20) FROM trips GROUP BY key"]) == 2
    assert "rdp ledger cannot charge delta spent outside" in capsys.readouterr().err
    assert ledger_state(store_path) == before


def test_an_rdp_ledger_is_charged_the_basic_plans_curve_the_cheaper_one_for_it(
        rdp_ledger_with_trips, capsys):
    """A PLD plan lowers every step's noise (budget.py), which raises the RDP curve an rdp
    ledger charges: on such a ledger the query is planned by basic composition
    (budget.composition_for), and the block is charged that plan's curve, below the PLD plan's
    at every order (before: the PLD plan's curve)."""
    from sage_tfx.dp_statistics.aggregation import Composition, frontend, sql
    from sage_tfx.sage_access.accounting import rdp_curve_of

    store_path = rdp_ledger_with_trips
    text = ("SELECT WITH ANONYMIZATION OPTIONS(public_groups = ('a'), noise = gaussian) key, "
            "ANON_COUNT(*) AS n, ANON_SUM(fare, 0, 20) AS total FROM trips GROUP BY key")
    assert main(["query", "--store", store_path, "--window", "1", "--epsilon", "1",
                 "--delta", "1e-6", text]) == 0, capsys.readouterr().err
    ledger = BlockLedger(store_path)
    table = tables.find_table(ledger, "trips")
    [block] = ledger.blocks()

    def charged_curve(composition):
        planned = frontend.plan_query(
            sql.parse(text), {"trips": sql.TableSchema(table.unit_column, table.columns)},
            {"trips": table.schema}, 1.0, 1e-6, composition)
        return rdp_curve_of([step.event for step in planned.budget.steps],
                            ledger.accounting.orders)

    basic, pld = charged_curve(Composition.BASIC), charged_curve(Composition.PLD)
    assert list(block.spent) == pytest.approx(list(basic))
    assert all(b < p for b, p in zip(basic, pld))


@pytest.mark.parametrize("raised, code, said, outcome", [
    (KeyboardInterrupt, 130, "that budget is spent and nothing was released", "interrupted"),
    (MemoryError, 7, "(that budget is spent) but nothing was released: failed while running "
                     "the query (recorded as failed in the ledger)", "failed")])
def test_a_query_stopped_after_its_charge_says_the_budget_is_spent_and_the_ledger_shows_it(
        ledger_with_trips, monkeypatch, capsys, raised, code, said, outcome):
    """Ctrl-C (or any failure) between the charge and the release: the exit code and message
    say the grant was spent with nothing released, and the grant is not shown as complete."""
    from sage_tfx.dp_statistics.aggregation import frontend

    def stopped(*args, **kwargs):
        raise raised()
    monkeypatch.setattr(frontend, "run", stopped)
    assert main(["query", "--store", ledger_with_trips, "--window", "1", "--epsilon", "1",
                 "--delta", "1e-6", QUERY]) == code
    assert said in capsys.readouterr().err
    [grant] = BlockLedger(ledger_with_trips).grant_records()
    assert (grant["outcome"], grant["front_door"], grant["request"]) == (
        outcome, "sage-tfx query", QUERY)


def test_the_beam_engine_takes_its_options_from_the_command_line(ledger_with_trips, tmp_path,
                                                                   capsys):
    """--engine beam --beam-option KEY=VALUE: the same release's shape as the local engine;
    a malformed option is refused before anything is charged."""
    base = ["query", "--store", ledger_with_trips, "--epsilon", "1", "--delta", "1e-6"]
    assert main(base + ["--blocks", "trips.2013-01", "--beam-option", "runner", QUERY]) == 2
    assert "write KEY=VALUE" in capsys.readouterr().err
    assert main(base + ["--blocks", "trips.2013-01", "--beam-option", "runner=DirectRunner",
                        QUERY]) == 2  # without --engine beam
    assert BlockLedger(ledger_with_trips).grant_records() == []
    for engine, block, options in (("local", "trips.2013-01", []),
                                   ("beam", "trips.2013-02", ["--beam-option",
                                                              "runner=DirectRunner"])):
        out = tmp_path / f"{engine}.csv"
        assert main(base + ["--blocks", block, "--engine", engine, *options, "--out", str(out),
                            QUERY]) == 0
        released = pd.read_csv(out)
        assert list(released.columns) == ["key", "n", "mean_fare", "median_fare"]
        assert list(released["key"]) == ["a", "b"]
