"""The arithmetic of dp_sgd.keyed_gaussian_noise's Box-Muller transform, compiled (numba), on
both sides of numpy's vectorised log, cos and sin (numpy's SIMD code: numba would call the C
library's scalar ones, several times slower).

Every operation here is exact or one IEEE rounding (dp_sgd.box_muller states the transform as
whole-array operations): a 52-bit (23-bit) integer times a power of two is exact in float64
(float32), and there is no fast-math (no reassociation, no fused multiply-add).

Compiled when first imported on a machine and cached (sage_tfx.compiled.kernel); dp_sgd imports
it, so no draw compiles after a charge.
"""
from __future__ import annotations

import numba
import numpy as np

from sage_tfx.compiled import kernel

_UNIT52 = 2.0 ** -52  # a 52-bit integer times this: a float64 uniform on [0, 1)
_UNIT23 = np.float32(2.0 ** -23)  # a 23-bit integer times this: a float32 uniform on [0, 1)


@kernel(numba.void(numba.uint64[::1], numba.float64[::1]))
def tails(words, tail):
    """tail[j] = (1 - high) - low 2^-52 in (0, 1], for the uniforms high and low on [0, 1)
    that words 2j and 2j + 1 give (their top 52 bits)."""
    for j in range(tail.shape[0]):
        high = np.float64(words[2 * j] >> np.uint64(12)) * _UNIT52
        low = np.float64(words[2 * j + 1] >> np.uint64(12)) * _UNIT52
        tail[j] = (1.0 - high) - low * _UNIT52


@kernel(numba.void(numba.float64[::1], numba.float32, numba.float32[::1]))
def radii(log_tail, stddev, radius):
    """radius[j] = float32(sqrt(-2 ln tail)) * stddev (stddev outside the square root:
    stddev^2 would overflow float32 beyond 1.8e19)."""
    for j in range(radius.shape[0]):
        radius[j] = np.float32(np.sqrt(-2.0 * log_tail[j])) * stddev


@kernel(numba.void(numba.uint32[::1], numba.float32[::1]))
def angles(words, angle):
    """angle[j] = 2 pi A for the float32 uniform A on [0, 1) that word j gives (its top 23
    bits)."""
    turn = np.float32(2.0 * np.pi)
    for j in range(angle.shape[0]):
        angle[j] = (np.float32(words[j] >> np.uint32(9)) * _UNIT23) * turn
