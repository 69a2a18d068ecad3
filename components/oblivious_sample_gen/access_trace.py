"""External-memory operations, and the record of the accesses they make (the "trace").

An oblivious algorithm touches external memory only through `read` and `write` below. Each one
records the positions it is about to use and then runs the TensorFlow op with exactly those
positions, so the trace is what executed, not what a plan says should execute. A routing
whose read or write addresses depend on the secret therefore changes the trace.

The trace keeps a running SHA-256 over (operation, array, positions), so two runs have equal
hashes exactly when they touched the same positions of the same arrays in the same order, and
it counts the positions read and written per array, so a test can check the trace covers every
slot of the output (code that bypasses these ops leaves slots unrecorded). The non-oblivious
baseline reads through `read` too, which is how the tests show the trace tells the two apart.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from typing import Optional

import numpy as np
import tensorflow as tf


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


def read(trace: Optional[AccessTrace], array: str, values: tf.Tensor,
         positions: np.ndarray) -> tf.Tensor:
    """values[positions]: a read of external memory at `positions`, recorded as executed."""
    positions = np.asarray(positions, dtype=np.int64)
    if trace is not None:
        trace.record_read(array, positions)
    if np.array_equal(positions, np.arange(values.shape[0])):
        return values  # a read of the whole array in order: its rows as they are
    return tf.gather(values, positions)


def write(trace: Optional[AccessTrace], array: str, values: tf.Tensor,
          positions: np.ndarray) -> tf.Tensor:
    """The external array of len(positions) rows with row positions[i] = values[i] (positions
    is a permutation of its range), recorded as executed. A write in order is the values
    themselves; any other order moves them."""
    positions = np.asarray(positions, dtype=np.int64)
    if trace is not None:
        trace.record_write(array, positions)
    if np.array_equal(positions, np.arange(positions.size)):
        return values
    inverse = np.empty_like(positions)
    inverse[positions] = np.arange(positions.size)
    return tf.gather(values, inverse)
