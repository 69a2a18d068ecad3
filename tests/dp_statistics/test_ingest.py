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

from support.neighbouring import one_more

ROWS = [(f"u{i % 7}", i % 3, f"{i * 1.5:.1f}", f"2013-0{1 + i % 2}-1{i % 9}")
        for i in range(40)]


def ingest(root, rows, capsys, raw_lines=b"", after=()):
    """Ingest `rows`, then `raw_lines` (bytes appended as they are), then the rows `after`, by
    month."""
    os.makedirs(root)
    with open(os.path.join(root, "trips.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "area", "fare", "day"])
        writer.writerows(rows)
    with open(os.path.join(root, "trips.csv"), "ab") as handle:
        handle.write(raw_lines)
    with open(os.path.join(root, "trips.csv"), "a", newline="") as handle:
        csv.writer(handle).writerows(after)
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


def neighbours(with_line, without_line) -> bool:
    """Whether two ingests (`ingest`'s results) store and print the same, except that one block
    of the first may hold one row more."""
    (table, blocks, rows_of, printed), other = with_line, without_line
    return ((table, blocks) == other[:2] and printed == other[3].replace("run-without", "run")
            and sum(len(rows_of[b]) - len(other[2][b]) for b in rows_of) <= 1
            and all(one_more(rows_of[b].to_pylist(), other[2][b].to_pylist()) for b in rows_of))


MANY = [(f"u{i % 97}", i % 3, f"{i % 40 * 1.5:.1f}", f"2013-0{1 + i % 3}-{1 + i % 28:02d}")
        for i in range(3000)]


@pytest.mark.parametrize("crafted", [
    b'u-crafted,1,"2.5,2013-01-12\n',      # a quoted cell that never closes
    b'"u-crafted,1,2.5,2013-01-12\r\n',     # from the line's start
    b'u-crafted,1,2.5,"2013-01-12""\n',    # its closing quote escaped
], ids=["middle", "first cell", "escaped close"])
def test_a_line_with_an_unclosed_quote_drops_itself_alone(tmp_path, capsys, crafted):
    """Issue 45: Arrow continued the open quote onto the next lines, so one crafted line after
    row 1,499 of 3,000 took every later line up to its block size into one invalid row, dropped
    with it (1,499 rows left, a public-groups count fell from 1193 to 637). Now the line drops
    itself alone: everything stored and printed is that of the file without it (and so is
    whatever a query or a stream computes from the rows, before noise)."""
    with_line = ingest(str(tmp_path / "run"), MANY[:1500], capsys, crafted, after=MANY[1500:])
    without_line = ingest(str(tmp_path / "run-without"), MANY, capsys)
    assert sum(len(rows) for rows in with_line[2].values()) == 3000
    assert neighbours(with_line, without_line)
    assert all(with_line[2][b].equals(without_line[2][b]) for b in with_line[2])


def test_a_time_with_a_zone_moves_no_other_row(tmp_path, capsys):
    """Issue 45: pandas parsed the time column at once and gave every later time without a
    zone the offset of an earlier cell: one row at +14:00 moved the trips of a month's first
    hours into the month before (and out of the schedule). Each cell is read by itself now:
    the file with that row stores and prints what the file without it does, plus the row."""
    rows = [(f"u{i % 7}", i % 3, "1.5", f"2013-0{2 + i % 2}-01T{i % 12:02d}:30:00")
            for i in range(48)]
    zoned = ("u-zoned", 1, "2.5", "2013-01-05T00:00:00+14:00")
    with_zoned = ingest(str(tmp_path / "run"), [zoned] + rows, capsys)
    without_zoned = ingest(str(tmp_path / "run-without"), rows, capsys)
    assert neighbours(with_zoned, without_zoned)
    assert len(with_zoned[2]["trips.2013-01"]) == 1  # the zoned row: 2013-01-04T10:00Z


def test_an_int_cell_is_read_exactly_whatever_the_other_cells_hold(tmp_path, capsys):
    """Found with issue 45: pandas' to_numeric read an integer above 2^53 exactly while every
    cell was an integer, and through a float parser that rounds otherwise once one cell held a
    fraction: that one row changed the stored value of the others."""
    rows = [(f"u{i}", 591064915700530116 + 7 * i, "1.5", "2013-01-12") for i in range(20)]
    fraction = ("u-fraction", "1.5", "1.5", "2013-01-12")  # no int: stored as NULL
    with_fraction = ingest(str(tmp_path / "run"), [fraction] + rows, capsys)
    without_fraction = ingest(str(tmp_path / "run-without"), rows, capsys)
    assert neighbours(with_fraction, without_fraction)
    assert without_fraction[2]["trips.2013-01"]["area"].to_pylist() == [row[1] for row in rows]


def test_every_line_is_read_by_itself(tmp_path):
    """Every line of up to 5 characters of x , " and a byte that is not UTF-8, each between two
    sentinel rows: each line drops itself or gives one row, and no sentinel is lost or changed
    (before issue 45 an open quote took the next lines, and a line with the wrong number of
    cells and a byte that is not UTF-8 made Arrow refuse the whole file)."""
    import itertools

    from sage_tfx.dp_statistics.ingest import read_text_csv

    lines = [b"".join(chars) for length in range(6)
             for chars in itertools.product([b"x", b",", b'"', b"\xff"], repeat=length)]
    (tmp_path / "lines.csv").write_bytes(b"a,b\n" + b"".join(
        line + b"\n" + f"s{i},s{i}\r\n".encode() for i, line in enumerate(lines)))
    rows = read_text_csv(str(tmp_path / "lines.csv"), "--csv").to_pylist()
    sentinels = [i for i, row in enumerate(rows) if row["a"].startswith("s")
                 and row == {"a": row["a"], "b": row["a"]}]
    assert [rows[i]["a"] for i in sentinels] == [f"s{i}" for i in range(len(lines))]
    assert all(later - earlier <= 2 for earlier, later in zip([-1] + sentinels, sentinels))


def test_a_header_with_an_unclosed_quote_takes_no_record_in(tmp_path, capsys):
    """Found with issue 45: the header was parsed by a CSV reader over the whole file, so a
    first line with an unclosed quote took the next lines into its last column name, and the
    refusal ("--time-column 'day' is not a column of ...") printed them. The first line is
    parsed alone now."""
    path = tmp_path / "trips.csv"
    path.write_text('uid,area,fare,"day\nSECRET-1,1,2.5,2013-01-12\nu2,2,3.5,2013-02-12\n')
    store = str(tmp_path / "ledger.sqlite")
    BlockLedger.create(store)
    assert main(["ingest", "--store", store, "--csv", str(path), "--unit-column", "uid",
                 "--time-column", "day", "--start", "2013-01", "--end", "2013-03",
                 "--types", "area:int,fare:float", "--epsilon", "1", "--delta", "1e-6",
                 "--out", str(tmp_path / "blocks")]) == 0
    captured = capsys.readouterr()
    assert "SECRET" not in captured.out + captured.err
    rows = pq.read_table(str(tmp_path / "blocks" / "trips" / "trips.2013-01" / tables.ROWS_FILE))
    assert rows["uid"].to_pylist() == ["SECRET-1"]
