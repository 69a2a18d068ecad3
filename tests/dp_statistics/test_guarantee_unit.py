"""The unit a release states comes from how its blocks were cut (their records), never from the
reader: user-level only when every block read was cut by the query's unit column."""
import csv
import os

import pytest

from sage_tfx.dp_statistics import tables
from sage_tfx.dp_statistics.aggregation import GuaranteeUnit
from sage_tfx.dp_statistics.ingest import ingest
from sage_tfx.sage_access import BlockLedger

UNIT, WITHIN = GuaranteeUnit.UNIT, GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ


def block(ledger, root, block_id, cut_by=None):
    directory = os.path.join(root, block_id)
    os.makedirs(directory)
    if cut_by is not None:
        tables.record_block_key(directory, cut_by)
    ledger.add_block(block_id, 1.0, 1e-6, data_uri=directory)
    return block_id


def test_blocks_cut_by_the_unit_give_the_unit_and_any_other_block_the_weaker_one(tmp_path):
    ledger = BlockLedger.create(str(tmp_path / "ledger.sqlite"))
    users = [block(ledger, tmp_path, f"users-{i}", cut_by="uid") for i in range(2)]
    month = block(ledger, tmp_path, "2014-01")
    assert tables.guarantee_unit_of_blocks(ledger, users, "uid") is UNIT
    # Cut by another column, mixed with a time block, or no block at all: within the blocks.
    assert tables.guarantee_unit_of_blocks(ledger, users, "taxi_id") is WITHIN
    assert tables.guarantee_unit_of_blocks(ledger, users + [month], "uid") is WITHIN
    assert tables.guarantee_unit_of_blocks(ledger, [], "uid") is WITHIN


def test_an_ingested_table_states_the_unit_its_record_says(tmp_path):
    ledger = BlockLedger.create(str(tmp_path / "ledger.sqlite"))
    with open(tmp_path / "trips.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "day"])
        writer.writerows([[f"u{i}", f"2013-01-1{i}"] for i in range(5)])
    _, hashed = ingest(ledger, str(tmp_path / "trips.csv"), str(tmp_path / "out"), "uid", 1.0,
                       1e-6, table_name="hashed", user_blocks=2)
    _, timed = ingest(ledger, str(tmp_path / "trips.csv"), str(tmp_path / "out"), "uid", 1.0,
                      1e-6, table_name="timed", time_column="day", period="month",
                      start="2013-01", end="2013-02")
    assert tables.guarantee_unit_of_blocks(ledger, hashed, "uid") is UNIT
    assert tables.guarantee_unit_of_blocks(ledger, timed, "uid") is WITHIN


def test_tables_use_the_ledgers_open_store_and_read_blocks_in_one_query(tmp_path, monkeypatch):
    """No second MLMD connection per lookup, and the blocks of a read in one ledger query."""
    from sage_tfx.sage_access import store

    def no_new_connection(*_):
        raise AssertionError("opened a second MLMD connection")

    ledger = BlockLedger.create(str(tmp_path / "ledger.sqlite"))
    monkeypatch.setattr(store, "connect", no_new_connection)
    monkeypatch.setattr(tables, "connect", no_new_connection, raising=False)
    monkeypatch.setattr(ledger, "block", lambda *_: pytest.fail("one query per block"))
    with open(tmp_path / "trips.csv", "w", newline="") as handle:
        csv.writer(handle).writerows([["uid", "day"]] + [[f"u{i}", "2013-01-10"]
                                                          for i in range(5)])
    table, blocks = ingest(ledger, str(tmp_path / "trips.csv"), str(tmp_path / "out"), "uid", 1.0,
                           1e-6, table_name="hashed", user_blocks=2)
    assert tables.find_table(ledger, "hashed") == table
    assert tables.read_blocks(ledger, table, blocks).num_rows == 5
    assert tables.guarantee_unit_of_blocks(ledger, blocks, "uid") is UNIT
    examples = block(ledger, tmp_path, "users-0", cut_by="uid")
    assert tables.guarantee_unit_of_blocks(ledger, blocks + [examples], "uid") is UNIT
