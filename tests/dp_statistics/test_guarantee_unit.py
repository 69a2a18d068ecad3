"""The unit a release states comes from how its blocks were cut (their records), never from the
reader: user-level only when every block read was cut by the query's unit column."""
import csv
import os

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
