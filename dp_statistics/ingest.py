"""`sage-tfx ingest`: a CSV file into ledger blocks with their rows (what BlockExampleGen does,
without a TFX run), as a table the DP statistics can query (tables.py).

What is stored depends on the rows only through the rows themselves (issue 16 §1):
* the blocks registered are the public schedule's, never the data's: every period of
  [--start, --end) for a time column (an empty month is still a block, as in BlockExampleGen),
  or the K hash buckets of --user-blocks K;
* the columns' types are declared (--types), never inferred from the rows: an inferred type
  would let one odd cell change how every other row is read;
* nothing is counted, logged or printed about the rows.

Bad rows (the project's record rule, components/record_rule.py, applied column-wise): a line
with the wrong number of cells, or with a cell that is not UTF-8, is dropped by itself (as the
stream reader drops it: `read_text_csv`; no error quotes a line or a byte's position). Each cell
is mapped on its own to a value of its column's declared type, and a cell of a number column
that is not one (text, an empty cell, NaN; for an int column also a fraction or an infinity) is
stored as NULL, which every aggregate skips (SQL's and BigQuery's semantics; a default such as
0 would pull a mean toward it). An empty cell of a string column is the empty string. A row without a unit id, or whose time is missing, unreadable or outside the schedule,
is dropped (add-or-remove-one covers dropping it, and nothing says whether any was). So the
rows stored are f(row) for a per-row map f, and adding or removing one input row changes one
stored row of one block.
"""
from __future__ import annotations

import csv
import datetime as dt
import hashlib
import os
import secrets
from typing import Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from sage_tfx import console
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
    try:
        return int(float(text))
    except ValueError:
        pass
    try:  # fromisoformat reads no bare month, which a monthly schedule names most often
        moment = dt.datetime.strptime(text.strip(), "%Y-%m")
    except ValueError:
        try:
            moment = dt.datetime.fromisoformat(text.strip())
        except ValueError:
            raise BadRequest(f"{what} {text!r} is neither Unix seconds nor an ISO 8601 date or "
                             "time (e.g. 2013-01 or 2013-01-01)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return int(moment.timestamp())


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


def csv_header(path: str, what: str) -> list[str]:
    """The column names on a CSV file's first line, stripped. Bytes that are not UTF-8 become
    U+FFFD (a column so named is then missing, and the file refused by name): never a decoding
    error that would tell where a byte lies."""
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as handle:
            return [name.strip() for name in next(csv.reader(handle), [])]
    except OSError as error:
        raise BadRequest(f"cannot read {what} {path}: {error.strerror}") from None


def _header(path: str) -> list[str]:
    header = csv_header(path, "--csv")
    if not header:
        raise BadRequest(f"--csv {path} is empty; its first line must name the columns")
    if len(set(header)) != len(header) or not all(header):
        raise BadRequest(f"--csv {path}: the header must name each column once: {header}")
    return header


def read_text_csv(path: str, what: str, columns: Optional[Sequence[str]] = None,
                  missing_is_null: bool = False) -> pa.Table:
    """The named columns (default: all) of a CSV file, every cell as UTF-8 text, never
    type-inferred. The per-record rule (ingest and the stream reader): a row with the wrong
    number of cells, or with a cell that is not UTF-8, is dropped by itself; refusing the file
    would branch on one record, and Arrow's message would quote it. `missing_is_null`:
    Arrow's null spellings (empty, NA, NULL, ...) read as null instead of as text. Errors name
    the file only (BadRequest)."""
    names = csv_header(path, what) if columns is None else list(columns)
    try:
        table = pacsv.read_csv(
            path, convert_options=pacsv.ConvertOptions(
                include_columns=list(columns or []),
                column_types={c: pa.binary() for c in names},
                strings_can_be_null=missing_is_null,
                quoted_strings_can_be_null=missing_is_null),
            parse_options=pacsv.ParseOptions(invalid_row_handler=lambda row: "skip"))
    except OSError as error:
        raise BadRequest(f"cannot read {what} {path}: {error.strerror}") from None
    except pa.ArrowInvalid:  # its message may quote a line of the file: not shown
        raise BadRequest(f"{what} {path}: Arrow's CSV reader cannot read it (the lines are "
                         "not shown); check that it is a CSV file") from None
    return _decoded(table)


def _decoded(table: pa.Table) -> pa.Table:
    """`table`'s binary cells as UTF-8 text, dropping each row with a cell that is not UTF-8
    (that record alone: one unit's malformed bytes never refuse the input)."""
    valid = np.ones(table.num_rows, dtype=bool)
    for column in table.columns:
        try:
            pc.cast(column, pa.string())
        except pa.ArrowInvalid:  # rare: find the bad cells one by one
            valid &= [cell is None or _is_utf8(cell) for cell in column.to_pylist()]
    if not valid.all():
        table = table.filter(pa.array(valid))
    return pa.table({name: pc.cast(column, pa.string())
                     for name, column in zip(table.column_names, table.columns)})


def _is_utf8(cell: bytes) -> bool:
    try:
        cell.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _typed(cells: pd.Series, kind: str) -> pa.Array:
    """One column's cells as `kind`, each on its own; a number cell that is not one is NULL."""
    if kind == "string":
        return pa.array(cells.fillna(""), pa.string())
    numbers = pd.to_numeric(cells.str.strip(), errors="coerce").astype("float64").to_numpy()
    if kind == "float":
        return pa.array(numbers, pa.float64(), mask=np.isnan(numbers))
    whole = np.isfinite(numbers) & (numbers == np.round(numbers)) & (np.abs(numbers) < 2 ** 62)
    return pa.array(np.where(whole, numbers, 0.0).astype(np.int64), pa.int64(), mask=~whole)


def time_seconds(cells: pd.Series) -> np.ndarray:
    """Unix seconds of each cell (a number, or an ISO 8601 date/time, UTC without a zone);
    NaN where the cell is neither."""
    text = cells.fillna("").str.strip()
    seconds = pd.to_numeric(text, errors="coerce").astype("float64").to_numpy()
    iso = pd.to_datetime(text.where(np.isnan(seconds), ""), errors="coerce", utc=True,
                         format="ISO8601")
    iso_seconds = (iso - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)
    return np.where(np.isnan(seconds), iso_seconds.to_numpy(dtype="float64", na_value=np.nan),
                    seconds)


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
        seconds = time_seconds(raw[time_column])
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
            arrays.append(_typed(raw[column], kind))
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
