"""The stream's records and their public micro-batches (dp_statistics/continual/sources.py)."""
import csv

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sage_tfx.dp_statistics.continual import sources
from sage_tfx.sage_access import BlockLedger
from sage_tfx.sage_access.errors import BadRequest

from support.neighbouring import one_more

JAN, FEB, MAR = 1356998400, 1359676800, 1362096000  # 2013-01-01, 02-01, 03-01 UTC
COLUMNS = sources.Columns(unit="uid", key="area", time="ts", value="fare")


@pytest.fixture
def ledger(store_path):
    BlockLedger.create(store_path)
    ledger = BlockLedger(store_path)
    ledger.add_block("t.2013-01", 1.0, 1e-6, "2013-01-01T00:00:00+00:00",
                     "2013-02-01T00:00:00+00:00")
    ledger.add_block("t.2013-02", 1.0, 1e-6, "2013-02-01T00:00:00+00:00",
                     "2013-03-01T00:00:00+00:00")
    ledger.add_block("t.2013-04", 1.0, 1e-6, "2013-04-01T00:00:00+00:00",
                     "2013-05-01T00:00:00+00:00")
    ledger.add_block("users-0", 1.0, 1e-6, "0", "100")
    return ledger


def write_csv(path, rows, header=("uid", "area", "ts", "fare")):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return str(path)


def test_window_is_the_blocks_time_range_and_triggers_are_public(ledger):
    window = sources.window_of_blocks(ledger, ["t.2013-02", "t.2013-01"])
    assert window.block_ids == ("t.2013-01", "t.2013-02")
    assert (window.start, window.end) == (JAN, MAR)
    width = (MAR - JAN) / 4
    assert np.allclose(window.trigger_times(4), JAN + width * np.arange(1, 5))
    times = np.array([JAN, JAN + width - 1, JAN + width, MAR - 1, MAR, JAN - 1, np.nan])
    assert list(window.micro_batch_of(times, 4)) == [1, 1, 2, 4, 0, 0, 0]


def test_a_gap_between_blocks_is_outside_the_window(ledger):
    window = sources.window_of_blocks(ledger, ["t.2013-01", "t.2013-04"])
    april = 1364774400
    assert list(window.micro_batch_of(np.array([JAN, FEB, MAR, april]), 2)) == [1, 0, 0, 2]


@pytest.mark.parametrize("ids, message", [
    (["t.2013-01", "t.2013-01"], "names a block twice"),
    (["t.2013-01", "nope"], "unknown block.* nope"),
    (["users-0"], "without an event-time range"),
    ([], "names no block"),
])
def test_bad_window_blocks_are_refused_by_name(ledger, ids, message):
    with pytest.raises(BadRequest, match=message):
        sources.window_of_blocks(ledger, ids)


def test_records_are_kept_by_themselves_and_ordered_by_batch_then_time(ledger, tmp_path):
    window = sources.window_of_blocks(ledger, ["t.2013-01", "t.2013-02"])
    path = write_csv(tmp_path / "s.csv", [
        ["u1", "8", FEB + 5, "2.5"],          # batch 2
        ["u2", "8", JAN + 9, "NaN"],          # batch 1, value 0
        ["", "8", JAN + 1, "1"],              # no unit: dropped
        ["u3", "", JAN + 1, "1"],             # no key: dropped
        ["u4", "9", "", "1"],                 # no time: dropped
        ["u5", "9", MAR, "1"],                # after the window: dropped
        ["u6", "9", "2013-01-01T00:00:03", "x"],  # ISO time, value not a number: 0
        ["u7", " 9 ", JAN + 3, "4"],          # same time as u6: input order breaks the tie
        ["u8", "9", JAN + 3, "4", "extra"],   # a malformed row: dropped, the file still read
    ])
    records = sources.read_input(path, COLUMNS, window, 2)
    assert list(records.units) == ["u6", "u7", "u2", "u1"]
    assert list(records.keys) == ["9", "9", "8", "8"]
    assert list(records.values) == [0.0, 4.0, 0.0, 2.5]
    assert list(records.batches) == [1, 1, 1, 2]
    batches = dict(records.micro_batches(3))
    assert [len(batches[i]) for i in (1, 2, 3)] == [3, 1, 0]
    assert batches[2].frame().to_dict("list") == {"unit": ["u1"], "key": ["8"], "value": [2.5]}


def test_without_a_value_column_every_record_counts_one(ledger, tmp_path):
    window = sources.window_of_blocks(ledger, ["t.2013-01"])
    path = write_csv(tmp_path / "s.csv", [["u1", "a", JAN, "7"]])
    records = sources.read_input(path, sources.Columns("uid", "area", "ts"), window, 1)
    assert list(records.values) == [1.0]


def test_a_directory_is_its_files_in_name_order(ledger, tmp_path):
    window = sources.window_of_blocks(ledger, ["t.2013-01"])
    folder = tmp_path / "arriving"
    folder.mkdir()
    write_csv(folder / "b.csv", [["late", "k", JAN + 5, "1"]])
    pq.write_table(pa.table({"uid": ["early"], "area": [3], "ts": [JAN + 5],
                             "fare": [2.0]}), str(folder / "a.parquet"))
    (folder / "notes.txt").write_text("ignored")
    records = sources.read_input(str(folder), COLUMNS, window, 1)
    # The same event time: the earlier file's record arrives first.
    assert list(records.units) == ["early", "late"]
    assert list(records.keys) == ["3", "k"]


def test_a_missing_column_names_the_file_and_the_column(ledger, tmp_path):
    window = sources.window_of_blocks(ledger, ["t.2013-01"])
    path = write_csv(tmp_path / "s.csv", [["u", "k", JAN]], header=("uid", "area", "when"))
    with pytest.raises(BadRequest, match=r"s\.csv has no column\(s\) ts, fare"):
        sources.read_input(path, COLUMNS, window, 1)
    with pytest.raises(BadRequest, match="no such file"):
        sources.read_input(str(tmp_path / "absent.csv"), COLUMNS, window, 1)


def test_table_blocks_are_the_window_records_without_input(store_path, tmp_path):
    from sage_tfx.dp_statistics.ingest import ingest
    from sage_tfx.dp_statistics.tables import find_table

    BlockLedger.create(store_path)
    ledger = BlockLedger(store_path)
    path = write_csv(tmp_path / "trips.csv", [["u1", "8", JAN + 1, "2"],
                                              ["u2", "9", FEB + 1, "3"]])
    ingest(ledger, path, str(tmp_path / "blocks"), "uid", 1.0, 1e-6, time_column="ts",
           period="month", start="2013-01", end="2013-03", types={"area": "int",
                                                                   "fare": "float"})
    table = find_table(ledger, "trips")
    window = sources.window_of_blocks(ledger, ["trips.2013-02"])
    records = sources.read_table_blocks(ledger, table, COLUMNS, window, 1)
    assert list(records.units) == ["u2"] and list(records.keys) == ["9"]
    assert list(records.values) == [3.0]
    ledger.add_block("other.2013-01", 1.0, 1e-6, "2013-01-01T00:00:00+00:00",
                     "2013-02-01T00:00:00+00:00")
    with pytest.raises(BadRequest, match="other.2013-01: not blocks of table trips"):
        sources.read_table_blocks(ledger, table, COLUMNS,
                                  sources.window_of_blocks(ledger, ["other.2013-01"]), 1)


def test_records_kept_for_later_arrive_before_newer_ones(ledger, tmp_path):
    window = sources.window_of_blocks(ledger, ["t.2013-01"])
    earlier = sources.read_input(write_csv(tmp_path / "a.csv", [["old", "k", JAN + 5, "1"]]),
                                 COLUMNS, window, 2)
    stored = sources.Records.from_arrow(earlier.to_arrow())
    newer = sources.read_input(write_csv(tmp_path / "b.csv", [["new", "k", JAN + 5, "1"],
                                                              ["first", "k", JAN, "1"]]),
                               COLUMNS, window, 2)
    assert list(stored.then(newer).units) == ["first", "old", "new"]


def test_removing_one_input_row_removes_at_most_that_record_and_moves_no_other(ledger):
    """The neighbouring relation at the source: a row's fate (kept, and in which micro-batch)
    is a function of that row alone, so removing any one row changes only whether that row is
    present. A source that cut micro-batches by record counts (every N records) fails this: one
    removed row would shift every later record's batch."""
    window = sources.window_of_blocks(ledger, ["t.2013-01", "t.2013-02"])
    rng = np.random.default_rng(0)
    rows = 60
    units = [f"u{rng.integers(8)}" if rng.random() > 0.1 else "" for _ in range(rows)]
    keys = [f"k{rng.integers(3)}" if rng.random() > 0.1 else "" for _ in range(rows)]
    times = [str(int(JAN - 86400 + rng.integers(0, 62 * 86400))) if rng.random() > 0.1 else "x"
             for _ in range(rows)]
    values = [str(rng.normal()) if rng.random() > 0.1 else "NaN" for _ in range(rows)]
    table = pa.table({"uid": units, "area": keys, "ts": times, "fare": values,
                      "row": [str(i) for i in range(rows)]})
    columns = sources.Columns("uid", "area", "ts", "fare")

    def fates(records_table):
        records = sources.records_of(records_table, columns, window, 5)
        # Each kept record, identified by its (unique) time and unit, with its batch and value.
        return {(u, t): (k, b, v) for u, k, t, b, v in zip(
            records.units, records.keys, records.times, records.batches, records.values)}

    everything = fates(table)
    assert 0 < len(everything) < rows  # some rows are dropped, some kept
    for removed in range(rows):
        without = fates(table.filter(pa.array([i != removed for i in range(rows)])))
        assert set(everything) - set(without) <= {(units[removed], float(times[removed]))
                                                  if times[removed] != "x" else None}
        assert all(everything[record] == without[record] for record in without)


def test_integer_ids_above_2_to_the_53_stay_apart_whether_or_not_one_is_missing(ledger):
    """An int64 key column read through pandas became float when a record's key was missing,
    merging 2^53 and 2^53 + 1 into one key only in the input with that record."""
    window = sources.window_of_blocks(ledger, ["t.2013-01", "t.2013-02"])
    big = 2 ** 53
    columns = sources.Columns("uid", "area", "ts")

    def keys(area):
        table = pa.table({"uid": pa.array([1, 2, 3], pa.int64()), "area": pa.array(
            area, pa.int64()), "ts": pa.array([JAN + 10, JAN + 20, JAN + 30], pa.int64())})
        return sorted(sources.records_of(table, columns, window, 5).keys)

    assert keys([big, big + 1, big + 1]) == [str(big), str(big + 1), str(big + 1)]
    assert keys([big, big + 1, None]) == [str(big), str(big + 1)]  # only the null's record goes


def test_a_unit_or_key_with_a_nul_or_over_the_public_length_drops_its_record_alone(ledger,
                                                                                   tmp_path):
    window = sources.window_of_blocks(ledger, ["t.2013-01"])
    longest = "é" * 512  # 1024 bytes in UTF-8, the documented maximum: kept
    pq.write_table(pa.table({
        "uid": ["u\x00", "u", "v" * 1025, longest, "w"],
        "area": ["k", "k", "k", "k", "\x00k"], "ts": [JAN + 1] * 5, "fare": [1.0] * 5}),
        str(tmp_path / "s.parquet"))
    records = sources.read_input(str(tmp_path / "s.parquet"), COLUMNS, window, 1)
    assert list(records.units) == ["u", longest]


@pytest.mark.parametrize("early", [True, False])
def test_a_cell_that_is_not_utf8_drops_its_row_alone_wherever_it_is(ledger, tmp_path, early):
    """A 0xff byte in the first 8 KiB once made the header read fail, and anywhere else refused
    the whole input: one unit's malformed record changed the run's outcome."""
    window = sources.window_of_blocks(ledger, ["t.2013-01"])
    rows = [f"u{i},k,{JAN + 10 + i},1\n".encode() for i in range(2000)]
    bad = b"\xffbad,k," + str(JAN + 5).encode() + b",1\n"
    rows.insert(1 if early else 1900, bad)
    path = tmp_path / "s.csv"
    path.write_bytes(b"uid,area,ts,fare\n" + b"".join(rows))
    records = sources.read_input(str(path), COLUMNS, window, 1)
    assert list(records.units) == [f"u{i}" for i in range(2000)]


def test_a_header_that_is_not_utf8_refuses_the_file_by_name(ledger, tmp_path):
    window = sources.window_of_blocks(ledger, ["t.2013-01"])
    path = tmp_path / "s.csv"
    path.write_bytes(b"uid,area,\xffts,fare\nu,k,1,1\n")
    with pytest.raises(BadRequest, match=r"s\.csv has no column\(s\) ts"):
        sources.read_input(str(path), COLUMNS, window, 1)


def _records(path, window) -> list:
    records = sources.read_input(str(path), COLUMNS, window, 4)
    return list(zip(records.units, records.keys, records.values, records.times, records.batches))


def test_a_line_with_an_unclosed_quote_drops_itself_alone(ledger, tmp_path):
    """Issue 45: one line with an unclosed quote after row 1,499 of 3,000 took every later line
    up to Arrow's block size into one invalid row, dropped with it (the stream's final release
    lost two keys). The line now drops itself alone: the records are those of the file
    without it, and so is everything a release computes from them before noise."""
    window = sources.window_of_blocks(ledger, ["t.2013-01", "t.2013-02"])
    rows = [(f"u{i % 97}", f"k{i % 3}", str(JAN + 1500 * i), "1.0") for i in range(3000)]
    plain = write_csv(tmp_path / "plain.csv", rows)
    lines = open(plain, "rb").read().split(b"\r\n")  # the header, then row 1 at index 1
    crafted = tmp_path / "crafted.csv"
    crafted.write_bytes(b"\r\n".join(lines[:1500] + [b'u-crafted,"k1,1359246000,1.0']
                                      + lines[1500:]))
    assert _records(crafted, window) == _records(plain, window)
    assert len(_records(plain, window)) == 3000


def test_a_time_with_a_zone_moves_no_other_record(ledger, tmp_path):
    """Issue 45: one record at +14:00 gave every later time without a zone its offset, moving
    records between micro-batches and out of the window. Each time is read by itself now."""
    window = sources.window_of_blocks(ledger, ["t.2013-01", "t.2013-02"])
    rows = [(f"u{i}", f"k{i % 3}", f"2013-0{1 + i % 2}-{1 + i % 28:02d}T{i % 12:02d}:30:00",
             "1.0") for i in range(60)]
    zoned = ("u-zoned", "k1", "2013-01-09T00:00:00+14:00", "1.0")
    with_zoned = _records(write_csv(tmp_path / "zoned.csv", [zoned] + rows), window)
    without = _records(write_csv(tmp_path / "plain.csv", rows), window)
    assert one_more(with_zoned, without) and len(with_zoned) == 61


def test_a_value_is_read_exactly_whatever_the_other_cells_hold(ledger, tmp_path):
    """Found with issue 45: pandas' to_numeric rounds an integer above 2^53 one way when every
    cell is an integer and another once one cell is not: one record changed the others'
    values."""
    window = sources.window_of_blocks(ledger, ["t.2013-01", "t.2013-02"])
    rows = [(f"u{i}", "k", str(JAN + i), str(591064915700530116 + 7 * i)) for i in range(20)]
    with_text = _records(write_csv(tmp_path / "text.csv", [("u-x", "k", str(JAN), "many")] + rows),
                         window)
    without = _records(write_csv(tmp_path / "plain.csv", rows), window)
    assert one_more(with_text, without) and len(with_text) == 21
    assert [record[2] for record in without] == [float(row[3]) for row in rows]
