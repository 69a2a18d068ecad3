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
