"""External-memory arrays, the operations on them, and the record of the accesses they make
(the "trace").

An oblivious algorithm touches external memory only through `read` and `write` below. Each one
records the positions it is about to use and then runs the numpy op with exactly those
positions, so the trace is what executed, not what a plan says should execute. A routing
whose read or write addresses depend on the secret therefore changes the trace.

The trace keeps a running SHA-256 over (operation, array, positions), so two runs have equal
hashes exactly when they touched the same positions of the same arrays in the same order, and
it counts the positions read and written per array, so a test can check the trace covers every
slot of the output (code that bypasses these ops leaves slots unrecorded). The non-oblivious
baseline reads through `read` too, which is how the tests show the trace tells the two apart.

Memory. An `ExternalArray` stores its rows in pieces of consecutive rows, each allocated on
its first write and freed by `release` once it has been read for the last time. An array that
is filled and drained piece by piece (the routing's blocks) never holds all its rows at once,
and writes go into the array in place: no op here copies a whole array.
"""
from __future__ import annotations

import hashlib
import mmap
from collections import Counter
from typing import Optional

import numpy as np


class AccessTrace:
    def __init__(self):
        self._digest = hashlib.sha256()
        self.reads = 0
        self.writes = 0
        self.written = Counter()  # array name -> positions written

    def _record(self, operation: bytes, array: str, positions: np.ndarray) -> None:
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        self._digest.update(operation + array.encode() + b":" + str(positions.size).encode())
        self._digest.update(positions.tobytes())

    def record_read(self, array: str, positions: np.ndarray) -> None:
        self._record(b"R", array, positions)
        self.reads += int(np.size(positions))

    def record_write(self, array: str, positions: np.ndarray) -> None:
        self._record(b"W", array, positions)
        self.writes += int(np.size(positions))
        self.written[array] += int(np.size(positions))

    def sha256(self) -> str:
        return self._digest.copy().hexdigest()


def null_rows(rows: int, like: np.ndarray) -> np.ndarray:
    """`rows` null records shaped like the rows of `like`: zeros, or b"" for serialized ones."""
    if like.dtype == object:
        return np.full((rows,) + like.shape[1:], b"", dtype=object)
    return np.zeros((rows,) + like.shape[1:], dtype=like.dtype)


class ExternalArray:
    """`rows` rows of external memory named `name`, stored as pieces of `piece_rows` rows.

    Pieces of numbers live in one private anonymous memory map, each piece on its own pages: a
    page takes memory when first written, and `release` hands a piece's pages back to the
    kernel (madvise DONTNEED). Private, not shared: only private anonymous memory gets
    transparent huge pages (shared memory is shmem, whose huge pages are off by default). Freeing pieces through malloc would not: glibc serves mid-sized blocks
    from its heap once a large block has been freed, and a heap shrinks only from its top."""

    def __init__(self, name: str, rows: int, like: np.ndarray, piece_rows: Optional[int] = None,
                 data: Optional[np.ndarray] = None):
        self.name, self.rows = name, rows
        self.piece_rows = max(1, piece_rows or rows)
        self._like = like[:0]
        count = 1 if data is not None else -(-rows // self.piece_rows)
        self._pieces: list[Optional[np.ndarray]] = [data] if data is not None else [None] * count
        self._released: set[int] = set()
        self._map, self._stride = None, 0
        if data is None and like.dtype != object and count > 1:
            row_bytes = like.dtype.itemsize * int(np.prod(like.shape[1:], dtype=np.int64))
            self._stride = -(-self.piece_rows * row_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
            self._map = mmap.mmap(-1, max(1, self._stride * count),
                                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                # Transparent huge pages, as numpy asks for its own large arrays: one page
                # fault per 2 MB instead of per 4 KB (the faults of the blocks' 4 KB pages
                # were a third of a Poisson epoch's time at 10^6 rows).
                self._map.madvise(mmap.MADV_HUGEPAGE)

    @classmethod
    def of(cls, name: str, values: np.ndarray) -> "ExternalArray":
        """An existing array (no copy) as one piece."""
        return cls(name, values.shape[0], values, data=values)

    @property
    def row_template(self) -> np.ndarray:
        """No rows, with the array's row shape and dtype (for null rows and new arrays)."""
        return self._like

    def _piece(self, index: int) -> np.ndarray:
        if index in self._released:
            raise ValueError(f"piece {index} of {self.name!r} was released")
        if self._pieces[index] is None:
            rows = min(self.piece_rows, self.rows - index * self.piece_rows)
            shape = (rows,) + self._like.shape[1:]
            if self._map is None:
                self._pieces[index] = np.empty(shape, self._like.dtype)
            else:
                self._pieces[index] = np.frombuffer(
                    self._map, self._like.dtype, int(np.prod(shape, dtype=np.int64)),
                    index * self._stride).reshape(shape)
        return self._pieces[index]

    def release(self, index: int) -> None:
        """Free piece `index`; reading or writing it afterwards raises."""
        self._pieces[index] = None
        self._released.add(index)
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED, index * self._stride, self._stride)

    def values(self) -> np.ndarray:
        """All rows as one array (an array of one piece: that piece, not a copy)."""
        if len(self._pieces) == 1:
            return self._piece(0)
        return np.concatenate([self._piece(i) for i in range(len(self._pieces))])

    def _split(self, positions: np.ndarray):
        """(piece, rows within it, index into positions) for each piece the positions touch.
        Positions in piece order (the routing's runs) split into slices, no copies; a run of
        consecutive rows within a piece is a slice too."""
        if positions.size == 0:
            return []
        piece = positions // self.piece_rows
        if not np.all(piece[1:] >= piece[:-1]):
            return [(int(p), positions[piece == p] - p * self.piece_rows, piece == p)
                    for p in np.unique(piece)]
        bounds = np.concatenate(([0], np.flatnonzero(np.diff(piece)) + 1, [piece.size]))
        parts = []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            index = int(piece[start])
            local = positions[start:stop] - index * self.piece_rows
            if local[-1] - local[0] == local.size - 1 and np.all(np.diff(local) == 1):
                local = slice(int(local[0]), int(local[-1]) + 1)
            parts.append((index, local, slice(int(start), int(stop))))
        return parts


def read(trace: Optional[AccessTrace], array: ExternalArray, positions: np.ndarray) -> np.ndarray:
    """array[positions]: a read of external memory at `positions`, recorded as executed. A run
    of consecutive positions within one piece is a view, not a copy."""
    positions = np.asarray(positions, dtype=np.int64)
    if trace is not None:
        trace.record_read(array.name, positions)
    parts = array._split(positions)
    if len(parts) == 1:
        piece, local, _ = parts[0]
        return array._piece(piece)[local]
    output = np.empty((positions.size,) + array._like.shape[1:], array._like.dtype)
    for piece, local, where in parts:
        output[where] = array._piece(piece)[local]
    return output


def write(trace: Optional[AccessTrace], array: ExternalArray, positions: np.ndarray,
          values: np.ndarray) -> None:
    """array[positions] = values, in place, recorded as executed."""
    positions = np.asarray(positions, dtype=np.int64)
    if trace is not None:
        trace.record_write(array.name, positions)
    for piece, local, where in array._split(positions):
        array._piece(piece)[local] = values[where]


def write_gathered(trace: Optional[AccessTrace], array: ExternalArray, positions: np.ndarray,
                   rows: np.ndarray, index: np.ndarray) -> None:
    """array[positions] = rows[index], with a null row where index >= len(rows): a write of
    external memory at `positions`, recorded as executed. `rows` is private memory (what a read
    returned); each value is gathered from it straight into its place, with no copy of the
    values first, and only the rows at `positions` change."""
    positions = np.asarray(positions, dtype=np.int64)
    index = np.asarray(index)
    if trace is not None:
        trace.record_write(array.name, positions)
    null = index >= rows.shape[0]
    null_value = null_rows(1, array._like)[0]
    for piece, local, where in array._split(positions):
        wanted, nulls = index[where], null[where]
        if isinstance(local, slice):  # a run of rows: gather into the piece itself
            destination = array._piece(piece)[local]
            if rows.shape[0]:
                np.take(rows, wanted, axis=0, out=destination, mode="clip")
            destination[nulls] = null_value
        else:
            values = np.take(rows, wanted, axis=0, mode="clip") if rows.shape[0] else \
                null_rows(wanted.size, array._like)
            values[nulls] = null_value
            array._piece(piece)[local] = values

