"""The readers of text cells: a number, an integer, a time. Each cell is read by itself.

Why (issue 45). A reader that parses a whole column at once may carry state from one cell to
the next, so that one record changes how the others are read: pandas' to_datetime (ISO 8601)
gave every later zone-less time the UTC offset of an earlier cell (one row at +14:00 removed 20
others and moved about 216 between daily blocks), and pandas' to_numeric reads an integer
above 2^53 exactly when every cell is an integer but through a float parser that rounds
differently as soon as one cell is a fraction or text (measured: 78,054 of 200,000 such
integers moved by one unit in the last place). Here every value is a function of its own
cell's text (Python's float and int, correctly rounded and exact), so a column's values
are f(cell) for a per-cell map f, and one record more or less changes one value. Each
distinct text is read once.

Used by `sage-tfx ingest` and the stream's --input (dp_statistics/ingest.py,
continual/sources.py), and by BlockExampleGen for its typed columns and its block key.
"""
from __future__ import annotations

import datetime as dt
import math
from typing import Callable, Optional

import numpy as np
import pandas as pd

# An int column holds whole numbers below 2^62 in magnitude (ingest's range, unchanged); a larger
# one is no int cell.
INT_LIMIT = 2 ** 62


def number(text: str) -> float:
    """The number a cell holds (as Python's float reads it: decimal or exponent notation,
    inf, nan), or NaN."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def integer(text: str) -> Optional[int]:
    """The whole number an int cell holds, exactly (an integer literal is read as an integer,
    never through a float), or None: for text, a fraction, a non-finite number or one of
    INT_LIMIT or more in magnitude."""
    try:
        value = int(text)
    except ValueError:
        whole = number(text)
        if not (math.isfinite(whole) and whole == math.floor(whole)):
            return None
        value = int(whole)
    return value if abs(value) < INT_LIMIT else None


def unix_seconds(text: str) -> float:
    """Unix seconds of one cell or option: a number of seconds, or an ISO 8601 date or time as
    datetime.fromisoformat reads it (UTC when it names no zone; its own zone otherwise), or a
    bare month "2013-01"; NaN when it is none of these or not finite."""
    text = text.strip()
    seconds = number(text)
    if math.isnan(seconds):
        try:
            moment = dt.datetime.fromisoformat(text)
        except ValueError:
            try:  # fromisoformat reads no bare month, which a monthly schedule names most often
                moment = dt.datetime.strptime(text, "%Y-%m")
            except ValueError:
                return math.nan
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=dt.timezone.utc)
        seconds = moment.timestamp()
    return seconds if math.isfinite(seconds) else math.nan


def each_cell(cells: pd.Series, read: Callable[[str], object], dtype=np.float64) -> np.ndarray:
    """`read` applied to each cell's text (a missing cell reads as ""), once per distinct text."""
    codes, distinct = pd.factorize(cells.fillna("").astype(str), use_na_sentinel=False)
    values = np.array([read(text) for text in distinct], dtype=dtype)
    return values[codes] if len(codes) else np.zeros(0, dtype=dtype)


def numbers(cells: pd.Series) -> np.ndarray:
    """`number` of each cell, as float64 (NaN where a cell is none)."""
    return each_cell(cells, number)


def time_seconds(cells: pd.Series) -> np.ndarray:
    """`unix_seconds` of each cell, as float64 (NaN where a cell is no time)."""
    return each_cell(cells, unix_seconds)
