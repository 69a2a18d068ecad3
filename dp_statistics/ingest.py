"""`sage-tfx ingest`: a CSV file into ledger blocks with their rows (what BlockExampleGen does,
without a TFX run), as a table the DP statistics can query (tables.py).

What is stored depends on the rows only through the rows themselves (issue 16 §1):
* the blocks registered are the public schedule's, never the data's: every period of
  [--start, --end) for a time column (an empty month is still a block, as in BlockExampleGen),
  or the K hash buckets of --user-blocks K;
* the columns' types are declared (--types), never inferred from the rows: an inferred type
  would let one odd cell change how every other row is read;
* nothing is counted, logged or printed about the rows.

Bad rows (the project's record rule, components/record_rule.py, applied column-wise): each
line is one record, and a line that ends inside a quoted cell, is not UTF-8 or has the wrong
number of cells is dropped by itself (as the stream reader and BlockExampleGen drop it:
`text_csv`; no error quotes a line or a byte's position). Each cell is mapped on its own
(dp_statistics/cells.py) to a value of its column's declared type, and a cell of a number column
that is not one (text, an empty cell, NaN; for an int column also a fraction or an infinity) is
stored as NULL, which every aggregate skips (SQL's and BigQuery's semantics; a default such as
0 would pull a mean toward it). An empty cell of a string column is the empty string. A row without a unit id, or whose time is missing, unreadable or outside the schedule,
is dropped (add-or-remove-one covers dropping it, and nothing says whether any was). So the
rows stored are f(row) for a per-row map f, and adding or removing one input row changes one
stored row of one block.
"""
from __future__ import annotations

import csv
import hashlib
import io
import math
import os
import re
import secrets
from typing import BinaryIO, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from sage_tfx import console
from sage_tfx.dp_statistics import cells as cells_of
from sage_tfx.dp_statistics import tables
from sage_tfx.dp_statistics.aggregation.sql import ARROW_TYPES
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.ledger import TABLE, BlockLedger, NewBlock
from sage_tfx.sage_access.schedule import TIME_UNITS, block_of, schedule

# The key of a --user-blocks table's hash (`user_block_of`): 32 random bytes drawn from
# `secrets` when the table is ingested, one per table, and written to this file in the table's
# directory under --out, beside its blocks' rows (mode 0600): it is private state like the
# rows, so it is never stored in ML Metadata (whose properties any reader of the ledger sees),
# printed or logged. Why secret: with a key anyone knows (one written in the source, as before
# issue 29), anyone who knows a person's id knows which block holds their rows and whose
# budget a release from that block spends, and can choose ids that land in one block.
# A --user-blocks table is ingested once (all its K blocks at once; blocks are immutable), so
# the key is used at that ingest only and kept to re-derive or audit the placement. Tables
# ingested before keys existed were placed with the old public key: they stay queryable (a
# query never needs the key), and re-ingesting them under a new --table name gives them a
# secret one.
USER_HASH_KEY_FILE = "user_hash.key"
_NUMPY_PERIODS = {"month": "datetime64[M]", "day": "datetime64[D]", "hour": "datetime64[h]"}


def parse_time(text: str, what: str) -> int:
    """Unix seconds of an ISO 8601 date or time (UTC when it names no zone) or of a number."""
    seconds = cells_of.unix_seconds(text)
    if math.isnan(seconds):
        raise BadRequest(f"{what} {text!r} is neither Unix seconds nor an ISO 8601 date or "
                         "time (e.g. 2013-01 or 2013-01-01)")
    return int(seconds)


def parse_types(text: Optional[str]) -> dict[str, str]:
    """--types "fare:float,trip_seconds:int" as {column: type}."""
    declared: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, kind = item.partition(":")
        name, kind = name.strip(), kind.strip()
        if kind not in ARROW_TYPES:
            raise BadRequest(f"--types {item!r}: give COLUMN:TYPE with TYPE one of "
                             f"{', '.join(ARROW_TYPES)}")
        declared[name] = kind
    return declared


def header_of(handle: BinaryIO) -> list[str]:
    """The column names on the first line of a CSV file open for reading bytes, stripped. That
    line is parsed alone (a quote it leaves open ends with it, never taking the next lines in).
    Bytes that are not UTF-8 become U+FFFD (a column so named is then missing, and the file
    refused by name): never a decoding error that would tell where a byte lies."""
    first = _LINE_END.split(handle.readline(), maxsplit=1)[0]
    return [name.strip() for name in next(csv.reader([first.decode("utf-8", "replace")]), [])]


def csv_header(path: str, what: str) -> list[str]:
    """`header_of` a local CSV file; BadRequest naming the file if it cannot be read."""
    try:
        with open(path, "rb") as handle:
            return header_of(handle)
    except OSError as error:
        raise BadRequest(f"cannot read {what} {path}: {error.strerror}") from None


def _header(path: str) -> list[str]:
    header = csv_header(path, "--csv")
    if not header:
        raise BadRequest(f"--csv {path} is empty; its first line must name the columns")
    if len(set(header)) != len(header) or not all(header):
        raise BadRequest(f"--csv {path}: the header must name each column once: {header}")
    return header


# CSV text is read one line at a time: a record is one line (ended by \n, \r or \r\n), and a bad
# line is dropped by itself, before Arrow parses anything:
# * A line that ends inside a quoted cell. Arrow's reader (like Python's csv) continues a quoted
#   cell onto the next lines: before issue 45 one line with an unclosed quote took every later
#   line up to Arrow's block size into one invalid row, dropped with it (one crafted line after
#   row 1,499 of 3,000 left 1,499 rows). _OPEN_LINE is Arrow's own grammar (RE2, run by Arrow on
#   all lines at once): a quote opens a quoted cell only at a cell's start; inside one, "" is a
#   quote and a quote before anything else closes it (text may follow up to the next comma, a
#   quote there being text). A line is open when, after whole cells, a quoted cell starts and
#   no quote closes it.
# * A line that is not UTF-8. Arrow hands an invalid row's text to the handler that skips it as
#   UTF-8: a line with the wrong number of cells and a byte that is not UTF-8 made the handler
#   fail, and Arrow refuse the whole file.
# A dropped line is blanked (Arrow skips empty lines); Arrow then reads every other line as one
# row, and drops a row with the wrong number of cells by itself.
_LINE_END = re.compile(rb"\r\n|\r|\n")
_CELL = r'(?:"(?:[^"\n]|"")*"(?:[^",\n][^,\n]*)?|[^",\n][^,\n]*|)'
_OPEN_LINE = r'^(?:' + _CELL + r',)*"(?:[^"\n]|"")*\n?$'


def _own_lines(body: bytes) -> bytes:
    """`body` with each line that ends inside a quoted cell or is not UTF-8 blanked (above)."""
    quoted, utf8 = b'"' in body, _is_utf8(body)
    if not quoted and utf8:  # the common case: every line is read as it is
        return body
    body = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    text = np.frombuffer(body, dtype=np.uint8)
    starts = np.concatenate([[0], np.flatnonzero(text == ord("\n")) + 1]).astype(np.int64)
    if starts[-1] < len(text):  # the last line has no line end
        starts = np.append(starts, len(text))
    lines = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(starts) - 1,
                                             [None, pa.py_buffer(starts), pa.py_buffer(body)])
    dropped = np.zeros(len(lines), dtype=bool)
    if quoted:
        dropped[pc.indices_nonzero(pc.match_substring_regex(lines, _OPEN_LINE)).to_numpy()] = True
    if not utf8:  # rare: find the lines one by one
        dropped |= [not _is_utf8(line) for line in lines.to_pylist()]
    if not dropped.any():
        return body
    edges = np.zeros(len(text) + 1, dtype=np.int8)  # +1 where a dropped line starts, -1 after
    edges[starts[:-1][dropped]] += 1
    edges[starts[1:][dropped]] -= 1
    blanked = text.copy()
    blanked[np.cumsum(edges[:-1], dtype=np.int8) > 0] = ord("\n")
    return blanked.tobytes()


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_text_csv(path: str, what: str, columns: Optional[Sequence[str]] = None,
                  missing_is_null: bool = False) -> pa.Table:
    """The named columns (default: all) of a local CSV file (`text_csv`)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        raise BadRequest(f"cannot read {what} {path}: {error.strerror}") from None
    return text_csv(data, f"{what} {path}", columns, missing_is_null)


def text_csv(data: bytes, what: str, columns: Optional[Sequence[str]] = None,
             missing_is_null: bool = False) -> pa.Table:
    """The named columns (default: all) of a CSV file's bytes `data` (its first line names the
    columns), every cell as UTF-8 text, never type-inferred. The per-record rule (ingest, the
    stream reader, BlockExampleGen): each line is one record, read by itself; a line that ends
    inside a quoted cell, is not UTF-8 or has the wrong number of cells is dropped by itself
    (_own_lines); refusing the file would branch on one record, and Arrow's message would
    quote it. `missing_is_null`: Arrow's null spellings (empty, NA, NULL, ...) read as null
    instead of as text. Errors name `what` only (BadRequest)."""
    header = header_of(io.BytesIO(data))
    first_line = _LINE_END.search(data)
    body = _own_lines(data[first_line.end():]) if first_line else b""
    if not body.strip(b"\r\n"):  # Arrow refuses input without a line: no record is no error
        return pa.table({name: pa.array([], pa.string()) for name in columns or header})
    try:
        table = pacsv.read_csv(
            pa.BufferReader(body), read_options=pacsv.ReadOptions(column_names=header),
            convert_options=pacsv.ConvertOptions(
                include_columns=list(columns or header),
                column_types={c: pa.string() for c in header},
                strings_can_be_null=missing_is_null,
                quoted_strings_can_be_null=missing_is_null),
            parse_options=pacsv.ParseOptions(invalid_row_handler=lambda row: "skip"))
    except pa.ArrowInvalid:  # its message may quote a line of the file: not shown
        raise BadRequest(f"{what}: Arrow's CSV reader cannot read it (the lines are not "
                         "shown); check that it is a CSV file") from None
    return table


def typed_cells(cells: pd.Series, kind: str) -> pa.Array:
    """One column's cells as `kind`, each on its own (dp_statistics/cells.py); a number cell that
    is not one is NULL."""
    if kind == "string":
        return pa.array(cells.fillna(""), pa.string())
    if kind == "float":
        values = cells_of.numbers(cells)
        return pa.array(values, pa.float64(), mask=np.isnan(values))
    values = cells_of.each_cell(cells, cells_of.integer, dtype=object)
    missing = pd.isna(values)
    return pa.array(np.where(missing, 0, values).astype(np.int64), pa.int64(), mask=missing)


def new_user_hash_key(table_directory: str) -> bytes:
    """A table's secret hash key, written to USER_HASH_KEY_FILE in its directory (see there)."""
    key = secrets.token_bytes(32)
    os.makedirs(table_directory, exist_ok=True)
    descriptor = os.open(os.path.join(table_directory, USER_HASH_KEY_FILE),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key)
    return key


def user_block_of(units: np.ndarray, blocks: int, key: bytes) -> np.ndarray:
    """The bucket (0..blocks-1) of each unit id: a hash keyed with the table's secret key
    (USER_HASH_KEY_FILE), so a unit's rows share a block that only the key tells."""
    unique, inverse = np.unique(units, return_inverse=True)
    buckets = np.array([int.from_bytes(hashlib.blake2b(
        unit.encode("utf-8"), digest_size=8, key=key).digest(), "big") % blocks
        for unit in unique], dtype=np.int64)
    return buckets[inverse] if len(unique) else np.zeros(0, dtype=np.int64)


def _user_part(index: int, blocks: int) -> str:
    width = len(str(blocks - 1))
    return f"users-{index:0{width}d}-of-{blocks}"


def ingest(ledger: BlockLedger, csv_path: str, out_dir: str, unit_column: str, epsilon: float,
           delta: float, table_name: Optional[str] = None, time_column: Optional[str] = None,
           period: Optional[str] = None, start: Optional[str] = None, end: Optional[str] = None,
           user_blocks: Optional[int] = None,
           types: Optional[Mapping[str, str]] = None) -> tuple[tables.Table, list[str]]:
    """Register `csv_path` as a table's blocks in `ledger` (module docstring); returns the table
    and the block ids registered, in key order. Everything is checked before a row is read."""
    name = tables.check_table_name(table_name or os.path.splitext(os.path.basename(csv_path))[0])
    header = _header(csv_path)
    declared = dict(types or {})
    for column, what in [(unit_column, "--unit-column"), (time_column, "--time-column"),
                         *[(c, "--types") for c in declared]]:
        if column is not None and column not in header:
            raise BadRequest(f"{what} {column!r} is not a column of {csv_path} ({header})")
    if (time_column is None) == (user_blocks is None):
        raise BadRequest("give either --time-column with --period, --start and --end, or "
                         "--user-blocks K")
    if unit_column in declared and declared.pop(unit_column) != "string":
        # An id typed as a number (natural for an integer id) is still an identifier: read as
        # text, so "007" and "7" stay two units and no id is rounded.
        console.report("the unit column %r is read as text (its declared type is not used)",
                       unit_column)
    columns = {c: ("int" if c == time_column else declared.get(c, "string")) for c in header}
    if time_column is not None:
        if period not in TIME_UNITS:
            raise BadRequest(f"--period must be one of {', '.join(TIME_UNITS)}")
        if start is None or end is None:
            raise BadRequest("--time-column needs the public schedule --start and --end (the "
                             "blocks registered never depend on the data)")
        first, last = parse_time(start, "--start"), parse_time(end, "--end")
        try:
            planned = schedule(first, last, period, 0)
        except ValueError as error:
            raise BadRequest(f"--start/--end: {error}") from None
        table = tables.Table(name, unit_column, columns, period, time_column=time_column)
        parts = [(block[0], block[2], block[3]) for block in planned]
    else:
        if isinstance(user_blocks, bool) or not isinstance(user_blocks, int) or user_blocks < 1:
            raise BadRequest(f"--user-blocks must be a positive integer, got {user_blocks!r}")
        table = tables.Table(name, unit_column, columns, tables.USER_HASH,
                             user_blocks=user_blocks)
        parts = [(_user_part(k, user_blocks), None, None) for k in range(user_blocks)]
    existing = tables.find_table(ledger, name, missing_ok=True)
    if existing is not None:  # the schema the table declared, checked against this file's
        missing = [c for c in existing.columns if c not in header]
        extra = [c for c in header if c not in existing.columns]
        if missing or extra:
            raise BadRequest(f"--csv {csv_path} does not have table {name!r}'s columns: "
                             f"missing {missing}, extra {extra} (the table has "
                             f"{list(existing.columns)}); nothing was registered")
    if existing is not None and existing != table:
        raise BadRequest(f"table {name!r} exists in ledger {ledger.context!r} with another "
                         f"definition ({existing.to_json()}); ingest under a new --table name")
    known = {block.block_id for block in ledger.blocks()}
    taken = [table.block_id(part) for part, _, _ in parts if table.block_id(part) in known]
    if taken:
        raise BadRequest(f"ledger {ledger.context!r} already has block(s) {taken[:5]}: blocks "
                         "are immutable once registered; ingest the next period")
    directories = {part: os.path.abspath(os.path.join(out_dir, name, table.block_id(part)))
                   for part, _, _ in parts}
    key_file = os.path.abspath(os.path.join(out_dir, name, USER_HASH_KEY_FILE))
    present = [d for d in [*directories.values(), key_file] if os.path.exists(d)]
    if present:
        raise BadRequest(f"--out already holds {present[0]}; give a new directory")

    raw = read_text_csv(csv_path, "--csv").to_pandas()
    units = raw[unit_column].fillna("").str.strip()
    keep = (units != "").to_numpy()
    if time_column is not None:
        seconds = cells_of.time_seconds(raw[time_column])
        keep &= np.isfinite(seconds) & (seconds >= first) & (seconds < last)
        raw, seconds = raw[keep], seconds[keep]
        stamps = seconds.astype(np.int64).astype("datetime64[s]")
        starts = stamps.astype(_NUMPY_PERIODS[period]).astype("datetime64[s]").astype(np.int64)
        part_of = {int(s): block_of(int(s), period, 0)[0] for s in np.unique(starts)}
        row_parts = np.array([part_of[int(s)] for s in starts], dtype=object)
    else:
        raw = raw[keep]
        buckets = user_block_of(raw[unit_column].str.strip().to_numpy(dtype=str), user_blocks,
                                new_user_hash_key(os.path.dirname(key_file)))
        row_parts = np.array([_user_part(int(b), user_blocks) for b in buckets], dtype=object)
    arrays = []
    for column, kind in columns.items():
        if column == time_column:
            arrays.append(pa.array(seconds.astype(np.int64), pa.int64()))
        elif column == unit_column:
            arrays.append(pa.array(raw[column].str.strip(), pa.string()))
        else:
            arrays.append(typed_cells(raw[column], kind))
    rows = pa.Table.from_arrays(arrays, schema=table.schema)
    for part, _, _ in parts:  # data first: a registered block always has its rows
        os.makedirs(directories[part])
        pq.write_table(rows.filter(pa.array(row_parts == part)),
                       os.path.join(directories[part], tables.ROWS_FILE))
    tables.register_table(ledger, table)
    ledger.add_blocks([NewBlock(table.block_id(part), float(epsilon), float(delta), block_start,
                                block_end, directories[part], TABLE)
                       for part, block_start, block_end in parts])
    return table, [table.block_id(part) for part, _, _ in parts]
