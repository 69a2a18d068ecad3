"""`sage-tfx ingest` stores nothing that depends on one row beyond that row (issue 16 §1): two
inputs differing by one row give the same table record, the same blocks (ids, ceilings, key
ranges) and the same printed lines, and differ only in the one block's rows."""
import csv
import os

import pyarrow.parquet as pq
import pytest

from sage_tfx.cli import main
from sage_tfx.dp_statistics import tables
from sage_tfx.sage_access import BlockLedger

ROWS = [(f"u{i % 7}", i % 3, f"{i * 1.5:.1f}", f"2013-0{1 + i % 2}-1{i % 9}")
        for i in range(40)]


def ingest(root, rows, capsys):
    os.makedirs(root)
    with open(os.path.join(root, "trips.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "area", "fare", "day"])
        writer.writerows(rows)
    store = os.path.join(root, "ledger.sqlite")
    BlockLedger.create(store)
    assert main(["ingest", "--store", store, "--csv", os.path.join(root, "trips.csv"),
                 "--unit-column", "uid", "--time-column", "day", "--start", "2013-01",
                 "--end", "2013-04", "--types", "area:int,fare:float", "--epsilon", "1",
                 "--delta", "1e-6", "--out", os.path.join(root, "blocks")]) == 0
    ledger = BlockLedger(store)
    blocks = [(b.block_id, b.epsilon_ceiling, b.delta_ceiling, b.start, b.end,
               os.path.relpath(b.data_uri, root)) for b in ledger.blocks()]
    rows_of = {b[0]: pq.read_table(os.path.join(root, b[5], tables.ROWS_FILE))
               for b in blocks}
    printed = capsys.readouterr().out.replace(root, "ROOT")
    return tables.find_table(ledger, "trips"), blocks, rows_of, printed


@pytest.mark.parametrize("removed", [0, 25])
def test_one_row_changes_only_the_rows_of_its_block(tmp_path, capsys, removed):
    table, blocks, rows_of, printed = ingest(str(tmp_path / "run"), ROWS, capsys)
    other = ingest(str(tmp_path / "run-without"), ROWS[:removed] + ROWS[removed + 1:], capsys)
    assert (table, blocks) == other[:2]
    assert printed == other[3].replace("run-without", "run")
    assert [b[0] for b in blocks] == ["trips.2013-01", "trips.2013-02", "trips.2013-03"]
    changed = [block for block in rows_of if not rows_of[block].equals(other[2][block])]
    month = ROWS[removed][3][:7]
    assert changed == [f"trips.{month}"]
