"""The per-record rule on text identifiers (privacy units and group keys), shared by the
streaming sources (continual/sources.py) and the aggregation engines (aggregation/local.py,
aggregation/beam.py).

A text id is *representable* when it holds no NUL character and is at most MAX_ID_BYTES long in
UTF-8. A NUL is refused because text tools end a string there: pandas' string hashing did
(so "a" and "a\\x00" became one group, labelled by whichever row came first), C readers of a
released CSV do, and a printed label hides it ("a" and "a\\x00" look the same). The length
cap keeps memory and output sizes public, not one record's choice. A record whose id is not
representable is dropped, by looking at that record alone: add-or-remove-one covers dropping
it, so neighbouring inputs stay neighbouring (one record more or less), and nothing says
whether any was dropped. A unit or key id must moreover be non-empty in a stream
(`usable_ids`); a group key of a table may be "" (ingest's public default for a text cell).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MAX_ID_BYTES = 1024  # a longer unit or key id drops its record (module docstring)


def _checks(ids) -> tuple[pa.Array, pa.Array]:
    """(length in bytes, whether it is representable) of each id; null where the id is null."""
    text = ids if isinstance(ids, (pa.Array, pa.ChunkedArray)) else pa.array(ids,
                                                                               pa.large_string())
    length = pc.binary_length(text)
    return length, pc.and_(pc.less_equal(length, MAX_ID_BYTES),
                           pc.invert(pc.match_substring(text, "\x00")))


def representable_ids(ids) -> np.ndarray:
    """Which text ids (an Arrow string array, or a sequence of str or None) may be read, grouped
    and written as they are (module docstring); a null id is representable (a null group key
    is a group of its own)."""
    _, representable = _checks(ids)
    return np.asarray(pc.fill_null(representable, True), dtype=bool)


def usable_ids(ids) -> np.ndarray:
    """Which stream unit or key ids (stripped text, "" where missing) a record may carry: not
    empty, and representable."""
    length, representable = _checks(ids)
    return np.asarray(pc.fill_null(pc.and_(pc.greater(length, 0), representable), False),
                      dtype=bool)
