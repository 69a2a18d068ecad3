"""`sage-tfx workload-answer`: one grant charged, the CSV written, refusals charge nothing."""
import csv
import json
import os

import numpy as np
import pytest
from support.trip_blocks import TRIP_SPEC as SPEC, write_block

from sage_tfx import cli
from sage_tfx.sage_access.ledger import BlockLedger

@pytest.fixture
def store(tmp_path):
    path = str(tmp_path / "ledger.sqlite")
    ledger = BlockLedger.create(path)
    for index in range(2):
        data = str(tmp_path / f"block{index}")
        write_block(data)
        ledger.add_block(f"b{index}", 1.0, 1e-5, data_uri=data)
    with open(tmp_path / "spec.json", "w") as handle:
        json.dump(SPEC, handle)
    return path


def _args(tmp_path, store, *extra):
    return ["workload-answer", "--store", store, "--spec", str(tmp_path / "spec.json"),
            "--out", str(tmp_path / "answers.csv"), "--delta", "1e-6", *extra]


def test_answers_are_written_and_one_grant_is_charged(tmp_path, store, capsys):
    assert cli.main(_args(tmp_path, store, "--window", "2", "--epsilon", "0.5")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(summary["blocks"]) == ["b0", "b1"] and summary["queries"] == 6 + 6
    with open(tmp_path / "answers.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 12 and all(float(r["expected_rmse"]) > 0 for r in rows)
    assert np.sqrt(np.mean([float(r["expected_rmse"]) ** 2 for r in rows])) == pytest.approx(
        summary["expected_rmse"])
    ledger = BlockLedger(store, read_only=True)
    assert [block.spent[0] for block in ledger.blocks()] == pytest.approx([0.5, 0.5])


def test_refusals_charge_nothing(tmp_path, store, capsys):
    # Not enough budget: exit 3, as `ledger request`.
    assert cli.main(_args(tmp_path, store, "--blocks", "b0", "--epsilon", "5")) == 3
    bad = dict(SPEC, queries=[{"kind": "all_ranges", "attributes": ["distance"]}])
    with open(tmp_path / "spec.json", "w") as handle:
        json.dump(bad, handle)
    assert cli.main(_args(tmp_path, store, "--blocks", "b0", "--epsilon", "0.5")) == 2
    assert "outside the declared domain" in capsys.readouterr().err
    ledger = BlockLedger(store, read_only=True)
    assert [block.spent[0] for block in ledger.blocks()] == [0.0, 0.0]
    assert not os.path.exists(tmp_path / "answers.csv")


def _ingest_trips(tmp_path, rows, **partition):
    """A table `trips` with unit column uid, ingested into a new ledger."""
    from sage_tfx.dp_statistics.ingest import ingest

    store = str(tmp_path / "table-ledger.sqlite")
    ledger = BlockLedger.create(store)
    with open(tmp_path / "trips.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "trip_seconds", "payment_type", "day"])
        writer.writerows(rows)
    _, blocks = ingest(ledger, str(tmp_path / "trips.csv"), str(tmp_path / "rows"), "uid", 100.0,
                       1e-5, table_name="trips", types={"trip_seconds": "float"}, **partition)
    with open(tmp_path / "spec.json", "w") as handle:
        json.dump(SPEC, handle)
    return store, blocks


def test_a_unit_with_many_rows_counts_once_and_the_unit_column_is_stated(tmp_path, capsys):
    # u0 owns 60 rows over both monthly blocks; u1..u9 one row each: 10 units in all.
    rows = [("u0", 30, "Cash", f"2013-0{1 + i % 2}-05") for i in range(60)]
    rows += [(f"u{i}", 200, "Credit Card", "2013-01-07") for i in range(1, 10)]
    store, _ = _ingest_trips(tmp_path, rows, time_column="day", period="month",
                             start="2013-01", end="2013-03")
    assert cli.main(_args(tmp_path, store, "--window", "2", "--epsilon", "100")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["unit"] == "all rows of one uid within the blocks read"
    assert "for adding or removing all rows of one uid within the blocks read" in \
        summary["guarantee"]
    with open(tmp_path / "answers.csv") as handle:
        answers = {row["query"]: row for row in csv.DictReader(handle)}
    total = answers["seconds in [0,2]"]
    rmse = float(total["expected_rmse"])
    # Every unit once: the total is 10 (it was 69, u0 counted 60 times). 6 expected RMSEs: a
    # Gaussian answer falls outside with probability 2e-9; rmse < 1 keeps 69 far outside.
    assert rmse < 1 and abs(float(total["answer"]) - 10) < 6 * rmse
