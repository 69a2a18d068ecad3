"""numba kernels, compiled once per machine where numba can cache them, else per process."""
from __future__ import annotations

import numba


def kernel(signature):
    """numba.njit(signature, nogil=True) with its machine code cached on disk (numba's
    cache=True: beside the module, else in the user's cache directory), so that a process
    loads it at import instead of compiling it (2-4 s). Where numba finds no writable place (a
    read-only install and home directory) enabling the cache raises "no locator available",
    even with a cache already on disk; the kernel is then compiled in the process: the same
    code and bits, a slower import. Without fast-math either way: no reassociation and no fused
    multiply-add, so each operation rounds as numpy's does."""
    def decorate(function):
        try:
            return numba.njit(signature, cache=True, nogil=True)(function)
        except RuntimeError as error:
            if "no locator available" not in str(error):
                raise
            return numba.njit(signature, nogil=True)(function)
    return decorate
