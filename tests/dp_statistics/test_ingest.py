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

from support.private import not_private

ROWS = [(f"u{i % 7}", i % 3, f"{i * 1.5:.1f}", f"2013-0{1 + i % 2}-1{i % 9}")
        for i in range(40)]


def ingest(root, rows, capsys, raw_lines=b""):
    """Ingest `rows` (then `raw_lines`, bytes appended as they are) by month."""
    os.makedirs(root)
    with open(os.path.join(root, "trips.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "area", "fare", "day"])
        writer.writerows(rows)
    with open(os.path.join(root, "trips.csv"), "ab") as handle:
        handle.write(raw_lines)
    store = os.path.join(root, "ledger.sqlite")
    BlockLedger.create(store)
    assert main(["ingest", "--store", store, "--csv", os.path.join(root, "trips.csv"),
                 "--unit-column", "uid", "--time-column", "day", "--start", "2013-01",
                 "--end", "2013-04", "--types", "area:int,fare:float", "--epsilon", "1",
                 "--delta", "1e-6", "--out", os.path.join(root, "blocks")]) == 0
    ledger = BlockLedger(store)
    # Recorded as tables: a window of Examples (the BlockLedger component) never takes them.
    assert {b.data_format for b in ledger.blocks()} == {"table"}
    blocks = [(b.block_id, b.epsilon_ceiling, b.delta_ceiling, b.start, b.end,
               os.path.relpath(b.data_uri, root)) for b in ledger.blocks()]
    rows_of = {b[0]: pq.read_table(os.path.join(root, b[5], tables.ROWS_FILE))
               for b in blocks}
    captured = capsys.readouterr()
    printed = (captured.out + captured.err).replace(root, "ROOT")
    return tables.find_table(ledger, "trips"), blocks, rows_of, printed


def test_ingested_rows_and_the_ledger_are_readable_by_their_owner_only(tmp_path, capsys,
                                                                     umask_022):
    """Blocks' rows.parquet (raw unit ids) were 0644 under umask 022."""
    ingest(str(tmp_path / "run"), ROWS, capsys)
    assert not_private(tmp_path / "run" / "blocks") == []
    assert not_private(tmp_path / "run" / "ledger.sqlite") == []


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


@pytest.mark.parametrize("bad_line", [
    b"SECRET-ROW,1,2.0,2013-01-12,extra\n",  # a cell too many
    b"SECRET-ROW,1\n",  # cells missing
    b"SECRET-ROW,1,\xff\xfe2.5,2013-01-12\n",  # a cell that is not UTF-8
    b"u1,SECRET\xc3,2.5,2013-01-12\n"])
def test_a_malformed_row_is_dropped_by_itself_and_never_echoed(tmp_path, capsys, bad_line):
    """Issue 29: ingest refused the file with Arrow's message, which quoted the row
    ("Expected 4 columns, got 5: SECRET-ROW,...") or told a bad byte's position. Such a row
    now follows the record rule (dropped by itself, as the stream reader does): the run and
    everything it stores and prints are those of the file without it."""
    table, blocks, rows_of, printed = ingest(str(tmp_path / "run"), ROWS, capsys, bad_line)
    other = ingest(str(tmp_path / "run-without"), ROWS, capsys)
    assert (table, blocks) == other[:2]
    assert printed == other[3].replace("run-without", "run")
    assert "SECRET" not in printed and "position" not in printed
    assert all(rows_of[block].equals(other[2][block]) for block in rows_of)


def test_user_blocks_are_cut_by_a_secret_key_kept_beside_the_rows(tmp_path, capsys):
    """Issue 29: the user-block hash used a key written in the source, so anyone could tell
    which block holds a known id. Each --user-blocks table now draws its own key (secrets),
    kept in a 0600 file beside its blocks' rows: never in ML Metadata, never printed."""
    from sage_tfx.dp_statistics.ingest import USER_HASH_KEY_FILE

    source = tmp_path / "trips.csv"
    with open(source, "w", newline="") as handle:
        csv.writer(handle).writerows([("uid", "fare")] + [(f"u{i}", i) for i in range(40)])
    store = str(tmp_path / "ledger.sqlite")
    BlockLedger.create(store)
    placements = []
    for name in ("first", "second"):
        assert main(["ingest", "--store", store, "--csv", str(source), "--unit-column", "uid",
                     "--user-blocks", "4", "--table", name, "--epsilon", "1", "--delta", "1e-6",
                     "--out", str(tmp_path / "blocks")]) == 0
        ledger = BlockLedger(store)
        placements.append({uid: block.block_id.split(".", 1)[1] for block in ledger.blocks()
                           if block.block_id.startswith(name + ".")
                           for uid in pq.read_table(os.path.join(block.data_uri,
                                                                 tables.ROWS_FILE))["uid"]
                           .to_pylist()})
        key_file = tmp_path / "blocks" / name / USER_HASH_KEY_FILE
        assert len(key_file.read_bytes()) == 32 and (key_file.stat().st_mode & 0o777) == 0o600
    # 40 units in 4 blocks: two independent keys place them alike with probability 4^-40.
    assert placements[0] != placements[1]
    printed = capsys.readouterr()
    keys = [(tmp_path / "blocks" / name / USER_HASH_KEY_FILE).read_bytes().hex()
            for name in ("first", "second")]
    with open(store, "rb") as handle:
        stored = handle.read()
    for key in keys:
        assert key not in printed.out + printed.err
        assert key.encode() not in stored and bytes.fromhex(key) not in stored
