"""The record of external-memory accesses an oblivious algorithm makes (its "trace").

Every read or write of external memory goes through `read`/`write` with the positions touched,
in order. The trace keeps a running SHA-256 over (operation, array, positions), so two runs
have equal hashes exactly when they touched the same positions of the same arrays in the same
order. The non-oblivious baseline records its secret gather positions here too, which is how
the tests show that the trace tells the two apart.
"""
from __future__ import annotations

import hashlib

import numpy as np


class AccessTrace:
    def __init__(self):
        self._digest = hashlib.sha256()
        self.reads = 0
        self.writes = 0

    def _record(self, operation: bytes, array: str, positions: np.ndarray) -> None:
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        self._digest.update(operation + array.encode() + b":" + str(positions.size).encode())
        self._digest.update(positions.tobytes())

    def read(self, array: str, positions: np.ndarray) -> None:
        self._record(b"R", array, positions)
        self.reads += int(np.size(positions))

    def write(self, array: str, positions: np.ndarray) -> None:
        self._record(b"W", array, positions)
        self.writes += int(np.size(positions))

    def sha256(self) -> str:
        return self._digest.copy().hexdigest()
