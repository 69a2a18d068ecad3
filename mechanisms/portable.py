"""Binary exponents computed exactly, so that every CPU agrees on them.

floor(log2(x)) through a logarithm (math.log2, np.log2) rounds: for x just below a power of
two a log within an ulp may return the power's exponent, and which one does depends on the
libm or on numpy's per-CPU SIMD code. The lattices, release grids and histogram buckets below
are recomputed by every engine, Beam worker and resumed job, and must be the same everywhere
(polar_kernel.py says why for the noise itself). frexp reads the exponent off the bits.
"""
from __future__ import annotations

import numpy as np


def floor_log2(values):
    """floor(log2(v)) of positive finite values, exact (an int for a scalar, else an array)."""
    _, exponents = np.frexp(values)  # v = m 2^e with m in [0.5, 1): floor(log2 v) = e - 1
    if np.ndim(exponents) == 0:
        return int(exponents) - 1
    return exponents.astype(np.int64) - 1
