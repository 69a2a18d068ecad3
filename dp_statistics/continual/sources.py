"""What the streaming operator reads: records (unit, key, value, event time) and the public
micro-batch each one belongs to.

Window and triggers (docs/streaming.md). A window is a set of ledger blocks; each block carries
its event-time range (`start`, `end`, ISO times: BlockExampleGen, `sage-tfx ingest` and
`sage-tfx ledger add-block --start --end` record them). The window's range is [first start, last
end); micro-batch i (1..T) holds the records whose event time lies in
[start + (i-1) * width, start + i * width), width = (end - start) / T. Trigger times are
therefore a function of the window and T alone, never of the data (a stream is never cut "every
N records", which would let one record move every later trigger).

Records. A record is kept or dropped by looking at that record alone: it is dropped when its
unit or key is empty, contains a NUL character or is longer than 1024 bytes in UTF-8
(identifiers.usable_ids), its time is missing or unreadable, or its time lies in no block of
the window (outside the range, or in a gap between the blocks). A value that is not a finite number becomes 0 (the
record rule's public default), so a bad cell never changes what a run does after its charge;
clamping to [-L, L] is the operator's. Without a value column every record is the value 1
(COUNT(*)). Nothing is counted, logged or printed about the records.

Inputs. `--input FILE` reads one CSV (first line names the columns; every cell read as text,
never type-inferred; each line one record: a line that ends inside a quoted cell, is not
UTF-8 or has the wrong number of cells is dropped by itself, ingest.text_csv) or Parquet file;
each time and value is read from its own cell only (dp_statistics/cells.py);
`--input DIR` reads the directory's *.csv and *.parquet files in name order, as files arriving
one after another (input order = file order, then row order). Without --input the records are
the rows of the window's blocks of a table that `sage-tfx ingest` registered
(tables.read_blocks). Within a micro-batch records are in arrival order = (event time, input
order), the order contribution bounding keeps a unit's first ones in.
"""
from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sage_tfx.dp_statistics.identifiers import usable_ids
from sage_tfx.dp_statistics.cells import numbers, time_seconds
from sage_tfx.dp_statistics.ingest import csv_header, read_text_csv
from sage_tfx.sage_access.errors import BadRequest

INPUT_SUFFIXES = (".csv", ".parquet")


@dataclass(frozen=True)
class Columns:
    """Which input columns are the unit, the key, the event time and (optionally) the value."""
    unit: str
    key: str
    time: str
    value: Optional[str] = None  # None: COUNT(*), every record is 1

    def names(self) -> list[str]:
        return [c for c in (self.unit, self.key, self.time, self.value) if c is not None]


@dataclass(frozen=True)
class Window:
    """The event-time range of a window's blocks: `ranges` are the blocks' [start, end) in
    Unix seconds (sorted), `start`/`end` their hull."""
    block_ids: tuple[str, ...]
    ranges: tuple[tuple[float, float], ...]

    @property
    def start(self) -> float:
        return self.ranges[0][0]

    @property
    def end(self) -> float:
        return max(end for _, end in self.ranges)

    def trigger_times(self, micro_batches: int) -> np.ndarray:
        """The end of each micro-batch 1..T (Unix seconds): the public trigger times."""
        steps = np.arange(1, micro_batches + 1, dtype=np.float64)
        return self.start + steps * ((self.end - self.start) / micro_batches)

    def micro_batch_of(self, seconds: np.ndarray, micro_batches: int) -> np.ndarray:
        """Micro-batch (1..T) of each event time; 0 for a time in no block of the window
        (NaN included)."""
        seconds = np.asarray(seconds, dtype=np.float64)
        inside = np.zeros(seconds.shape, dtype=bool)
        for low, high in self.ranges:
            inside |= (seconds >= low) & (seconds < high)
        width = (self.end - self.start) / micro_batches
        with np.errstate(invalid="ignore"):
            index = np.floor((np.where(inside, seconds, self.start) - self.start) / width)
        # A time just below `end` may round up to T in floating point: it belongs to batch T.
        batch = np.minimum(index.astype(np.int64) + 1, micro_batches)
        return np.where(inside, batch, 0)


def _iso_seconds(text: Optional[str]) -> Optional[float]:
    if not text:
        return None
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        return None  # e.g. a user-id range "0".."999" (BlockExampleGen block_by="users")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return moment.timestamp()


def window_of_blocks(ledger, block_ids: Sequence[str]) -> Window:
    """The window of the named blocks, from the time ranges the ledger recorded for them.
    BadRequest (naming the blocks) if a block is unknown, named twice, has no event-time range,
    or overlaps another (a record would belong to two blocks)."""
    ids = [b.strip() for b in block_ids if b.strip()]
    if not ids:
        raise BadRequest("--window-blocks names no block")
    if len(set(ids)) != len(ids):
        raise BadRequest(f"--window-blocks names a block twice: {ids}")
    known = {block.block_id: block for block in ledger.blocks(ids)}  # BadRequest if unknown
    ranges, untimed = [], []
    for block_id in ids:
        block = known[block_id]
        low, high = _iso_seconds(block.start), _iso_seconds(block.end)
        if low is None or high is None or not low < high:
            untimed.append(f"{block_id} ({block.start}, {block.end})")
        else:
            ranges.append((low, high, block_id))
    if untimed:
        raise BadRequest(f"--window-blocks: block(s) without an event-time range (ISO start < "
                         f"end): {'; '.join(untimed)}; a streaming window is cut by event time")
    ranges.sort()
    for (_, high, first), (low, _, second) in zip(ranges, ranges[1:]):
        if low < high:
            raise BadRequest(f"--window-blocks: blocks {first} and {second} overlap in time")
    return Window(tuple(b for _, _, b in ranges), tuple((lo, hi) for lo, hi, _ in ranges))


@dataclass(frozen=True)
class Records:
    """Records in arrival order: unit and key as text, value as float64, time in Unix seconds,
    micro-batch 1..T. Only kept records (module docstring)."""
    units: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    times: np.ndarray
    batches: np.ndarray

    def __len__(self) -> int:
        return len(self.units)

    def take(self, rows) -> "Records":
        return Records(self.units[rows], self.keys[rows], self.values[rows], self.times[rows],
                       self.batches[rows])

    def micro_batches(self, micro_batches: int) -> Iterator[tuple[int, "Records"]]:
        """(i, records of micro-batch i) for i = 1..T, empty batches included (a trigger with
        no records still releases)."""
        bounds = np.searchsorted(self.batches, np.arange(1, micro_batches + 2))
        for i in range(1, micro_batches + 1):
            yield i, self.take(slice(bounds[i - 1], bounds[i]))

    def then(self, later: "Records") -> "Records":
        """These records and `later` ones (which arrived after them), in arrival order."""
        both = [np.concatenate([a, b]) for a, b in zip(self._arrays(), later._arrays())]
        order = np.lexsort((both[3], both[4]))  # stable: earlier arrivals first on ties
        return Records(*(array[order] for array in both))

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.units, self.keys, self.values, self.times, self.batches

    def to_arrow(self) -> pa.Table:
        """For keeping records until their trigger (the operator's private state)."""
        return pa.table({"unit": pa.array(self.units, pa.string()),
                         "key": pa.array(self.keys, pa.string()), "value": self.values,
                         "time": self.times, "batch": self.batches})

    @classmethod
    def from_arrow(cls, table: pa.Table) -> "Records":
        return cls(*(table[name].to_numpy(zero_copy_only=False) for name in
                     ("unit", "key", "value", "time", "batch")))

    def frame(self) -> pd.DataFrame:
        """The records as operator.step's micro-batch (unit, key, value), in arrival order."""
        return pd.DataFrame({"unit": self.units, "key": self.keys, "value": self.values})


def input_files(path: str) -> list[str]:
    """FILE itself, or DIR's CSV and Parquet files in name order; BadRequest if none."""
    if os.path.isfile(path):
        if not path.endswith(INPUT_SUFFIXES):
            raise BadRequest(f"--input {path}: give a .csv or .parquet file")
        return [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, name) for name in os.listdir(path)
                       if name.endswith(INPUT_SUFFIXES) and not name.startswith("."))
        if not files:
            raise BadRequest(f"--input {path}: the directory holds no .csv or .parquet file")
        return files
    raise BadRequest(f"--input {path}: no such file or directory")


def _read_file(path: str, columns: Columns) -> pa.Table:
    """The named columns of one file, as text (CSV) or as stored (Parquet)."""
    if path.endswith(".parquet"):
        try:
            names = pq.read_schema(path).names
            missing = [c for c in columns.names() if c not in names]
            if not missing:
                return pq.read_table(path, columns=columns.names())
        except (OSError, pa.ArrowInvalid) as error:
            raise BadRequest(f"--input {path} cannot be read: {error}") from None
    else:
        missing = [c for c in columns.names() if c not in csv_header(path, "--input")]
        if not missing:
            return read_text_csv(path, "--input", columns.names(), missing_is_null=True)
    raise BadRequest(f"--input {path} has no column(s) {', '.join(missing)} (the "
                     "--unit-column, --key-column, --time-column, --value-column)")


def _text(column: pa.ChunkedArray) -> np.ndarray:
    """Each cell as stripped text, "" where missing (a key or unit 8 and "8" are the same).
    Integers are written by Arrow itself: through pandas a null would turn the column into
    floats, merging ids above 2^53 (2^53 and 2^53 + 1 would become one key) only when some
    record's id is missing, which would make a key's count depend on a neighbour."""
    if pa.types.is_integer(column.type):
        return pc.fill_null(pc.cast(column, pa.string()), "").to_numpy(zero_copy_only=False)
    series = column.to_pandas()
    if pd.api.types.is_float_dtype(series):  # an int column with nulls comes back as float
        series = series.map(lambda v: "" if pd.isna(v) else
                            (str(int(v)) if float(v).is_integer() else repr(float(v))))
    return series.astype(object).where(series.notna(), "").astype(str).str.strip().to_numpy(
        dtype=object)


def _seconds(column: pa.ChunkedArray) -> np.ndarray:
    if pa.types.is_timestamp(column.type):
        stamps = column.to_pandas()
        if stamps.dt.tz is None:
            stamps = stamps.dt.tz_localize("UTC")
        return ((stamps - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(
            dtype="float64", na_value=np.nan)
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        return column.to_pandas().to_numpy(dtype="float64", na_value=np.nan)
    # Text: every cell by the one reader of times, by itself. (A fast path that cast the column
    # in Arrow when every cell was a number, and another parser otherwise, read a cell by
    # whichever parser the other cells chose.)
    return time_seconds(pd.Series(_text(column)))


def _values(column: Optional[pa.ChunkedArray], rows: int) -> np.ndarray:
    if column is None:
        return np.ones(rows, dtype=np.float64)
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        values = column.to_pandas().to_numpy(dtype="float64", na_value=np.nan)
    else:
        values = numbers(pd.Series(_text(column)))
    return np.where(np.isfinite(values), values, 0.0)


def _fields(table: pa.Table, columns: Columns) -> tuple[np.ndarray, ...]:
    """(units, keys, values, times) of every row of `table`, in input order."""
    return (_text(table[columns.unit]), _text(table[columns.key]),
            _values(table[columns.value] if columns.value else None, table.num_rows),
            _seconds(table[columns.time]))


def _kept(parts: Sequence[tuple[np.ndarray, ...]], window: Window,
          micro_batches: int) -> Records:
    """The kept records of the parts (in input order) with their micro-batches, in arrival
    order."""
    units, keys, values, times = (np.concatenate(arrays) for arrays in zip(*parts))
    batches = window.micro_batch_of(times, micro_batches)
    kept = np.flatnonzero(usable_ids(units) & usable_ids(keys) & (batches > 0))
    # Arrival order: by micro-batch, then event time, then input order (a stable sort).
    order = kept[np.lexsort((times[kept], batches[kept]))]
    return Records(units[order], keys[order], values[order], times[order], batches[order])


def records_of(table: pa.Table, columns: Columns, window: Window,
               micro_batches: int) -> Records:
    """The kept records of one table of rows (in input order), in arrival order."""
    return _kept([_fields(table, columns)], window, micro_batches)


def read_input(path: str, columns: Columns, window: Window, micro_batches: int) -> Records:
    """The records of --input FILE|DIR (module docstring). Every file's columns are checked
    before any record is used (BadRequest naming the file and the column)."""
    tables_read = [_read_file(file, columns) for file in input_files(path)]
    return _kept([_fields(table, columns) for table in tables_read], window, micro_batches)


def read_table_blocks(ledger, table, columns: Columns, window: Window,
                      micro_batches: int) -> Records:
    """The records of the window's blocks of `table` (a table `sage-tfx ingest` registered)."""
    from sage_tfx.dp_statistics import tables

    foreign = [b for b in window.block_ids if not table.owns(b)]
    if foreign:
        raise BadRequest(f"--window-blocks {', '.join(foreign)}: not blocks of table "
                         f"{table.name}; without --input the records are the table's rows")
    missing = [c for c in columns.names() if c not in table.columns]
    if missing:
        raise BadRequest(f"table {table.name} has no column(s) {', '.join(missing)} (its "
                         f"columns: {', '.join(table.columns)})")
    rows = tables.read_blocks(ledger, table, window.block_ids).select(columns.names())
    return records_of(rows, columns, window, micro_batches)
