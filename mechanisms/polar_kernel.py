"""The arithmetic of keyed.py's polar draws, compiled (numba), with the same bits on every CPU.

keyed.KeyedGaussian._pairs draws a pair of normals per AES block: (u, v) uniform in [-1, 1)^2
from the block's two words, kept if 0 < s = u^2 + v^2 < 1, else redrawn from the next attempt's
block; then (u, v) * sqrt(-2 ln s / s). In numpy that was about 25 passes and calls per batch
of blocks and 12 more per round of redraws (a round for 21% of the pairs, then 4.6%, ... :
about seven rounds for 30,000 pairs, three for a hundred), most of the time of a call for the
few dozen streams the engine draws at once. Here each is one loop.

Portability. A keyed value is recomputed: a crashed micro-batch's noise by a resumed job, maybe
on another host, and the same release's noise by every Beam worker. Two different values for
one release would be two independent-looking noisy copies of it (half the noise), so a value
must be a function of (key, stream, counter) alone, on every x86-64 and aarch64 CPU. AES is
exact. Every other operation here is an IEEE-754 basic operation (shift, or, +, -, *, /, sqrt,
correctly rounded by the standard) or frexp (exact), in a fixed order: numba compiles without
fast-math, so LLVM neither reassociates nor contracts a multiply and an add into an FMA, even
where the CPU has FMA (test_keyed.py checks each kernel against its own Python function run by
CPython, op by op, and the pinned digests under a generic-CPU build and numpy's baseline
dispatch). The logarithm is `log` below, not numpy's: np.log dispatches per CPU feature to SIMD
code whose last bits differ (AVX-512 against AVX2 gave another digest), and libm's differs by
version.

Compiled when first imported on a machine and cached (sage_tfx.compiled.kernel: beside this
file, or compiled in each process where no cache can be written); keyed.py imports it, so a
draw never compiles, and never fails, after a charge.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from sage_tfx.compiled import kernel

_EXPONENT_TWO = np.uint64(0x4000000000000000)  # the bits of 2.0: OR a 52-bit mantissa in
_MANTISSA_SHIFT = np.uint64(12)
_WORDS = numba.uint64[:, ::1]
_FLOATS = numba.float64[::1]
_INDICES = numba.int64[::1]


@kernel(numba.void(_WORDS, _FLOATS))
def _square(words, radius):
    """(u, v) = 2 x - 3 in [-1, 1) from each row's two words, in place (52 random bits as the
    mantissa under 2.0's exponent: 2 x in [2, 4)), and radius = u^2 + v^2."""
    for i in range(words.shape[0]):
        words[i, 0] = (words[i, 0] >> _MANTISSA_SHIFT) | _EXPONENT_TWO
        words[i, 1] = (words[i, 1] >> _MANTISSA_SHIFT) | _EXPONENT_TWO
    square = words.view(np.float64)
    for i in range(words.shape[0]):
        square[i, 0] -= 3.0
        square[i, 1] -= 3.0
        radius[i] = square[i, 0] * square[i, 0] + square[i, 1] * square[i, 1]


@kernel(_INDICES(_WORDS, _FLOATS))
def uniform_square(words, radius):
    """_square over a batch; returns the rows rejected (radius <= 0 or >= 1)."""
    _square(words, radius)
    rejected = np.empty(words.shape[0], np.int64)
    count = 0
    for i in range(words.shape[0]):
        if radius[i] <= 0.0 or radius[i] >= 1.0:
            rejected[count] = i
            count += 1
    return rejected[:count].copy()


@kernel(_WORDS(_WORDS, _INDICES, numba.uint64))
def retry_blocks(blocks, rejected, attempt_bits):
    """The blocks of the rows `rejected` with the attempt's bits in the stream word."""
    again = np.empty((rejected.shape[0], 2), np.uint64)
    for k in range(rejected.shape[0]):
        again[k, 0] = blocks[rejected[k], 0] | attempt_bits
        again[k, 1] = blocks[rejected[k], 1]
    return again


@kernel(_INDICES(_WORDS, _INDICES, numba.float64[:, ::1], _FLOATS))
def accept_retries(words, rejected, pairs, radius):
    """A round of redraws: (u, v) and radius of row rejected[k] from the k-th row of `words`
    (AES of its next attempt's block), kept where accepted; returns the rows still rejected."""
    again = np.empty(words.shape[0])
    _square(words, again)
    square = words.view(np.float64)
    still = np.empty(rejected.shape[0], np.int64)
    count = 0
    for k in range(rejected.shape[0]):
        row = rejected[k]
        pairs[row, 0], pairs[row, 1], radius[row] = square[k, 0], square[k, 1], again[k]
        if again[k] <= 0.0 or again[k] >= 1.0:
            still[count] = row
            count += 1
    return still[:count].copy()


# ln 2 = LN2_HI + LN2_LO, LN2_HI with its last 32 mantissa bits zero, so that k LN2_HI is exact
# for every binary exponent k of a double (|k| < 2^11).
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_SQRT_HALF = float.fromhex("0x1.6a09e667f3bcdp-1")
# 2 / (2n + 1), n = 1..12: ln((1 + s) / (1 - s)) = 2s + s R(s^2), R(z) = sum_n 2 z^n / (2n + 1).
_ATANH_SERIES = tuple(2.0 / (2 * n + 1) for n in range(1, 13))


@kernel(numba.float64(numba.float64))
def log(x):
    """ln x for a positive normal double, from IEEE basic operations only (module docstring).

    x = m 2^k with m in [sqrt(1/2), sqrt(2)) (frexp, then m doubled when below sqrt(1/2): both
    exact), f = m - 1 (exact, Sterbenz). With s = f / (2 + f), 1 + f = (1 + s) / (1 - s), so
    ln(1 + f) = 2 atanh(s) = 2s + s R(z), z = s^2, R(z) = 2z/3 + 2z^2/5 + ... ; |s| <= 0.1716,
    z <= 0.0295, and the series cut after z^12 errs by below 1e-20. As fdlibm's e_log.c (the
    classic arrangement, re-derived here) 2s is written f - s f = f - (h - s h), h = f^2 / 2
    (s f = f^2 / (2 + f) = h (1 - s)), so that the large term f enters exactly:
    ln x = k LN2_HI - ((h - (s (h + R) + k LN2_LO)) - f). Within 1 ulp of ln x (test_keyed.py
    against mpmath); what matters more is that every step is one correctly rounded operation."""
    mantissa, exponent = math.frexp(x)
    if mantissa < _SQRT_HALF:
        mantissa *= 2.0
        exponent -= 1
    k = float(exponent)
    f = mantissa - 1.0
    s = f / (2.0 + f)
    z = s * s
    series = _ATANH_SERIES[11]
    for n in range(10, -1, -1):
        series = _ATANH_SERIES[n] + z * series
    r = z * series
    h = 0.5 * f * f
    return k * _LN2_HI - ((h - (s * (h + r) + k * _LN2_LO)) - f)


@kernel(numba.void(numba.float64[:, ::1], _FLOATS))
def polar_scale(pairs, radius):
    """pairs *= sqrt(-2 ln s / s) per row, in place: (ln s * -2.0) / s, its square root, then
    each of u and v times it."""
    for i in range(pairs.shape[0]):
        factor = np.sqrt(log(radius[i]) * -2.0 / radius[i])
        pairs[i, 0] *= factor
        pairs[i, 1] *= factor


@kernel(_WORDS(numba.uint64[::1], numba.uint64[::1], _INDICES))
def ragged_blocks(streams, first_pairs, widths):
    """The (stream, pair) blocks of widths[i] consecutive pairs of each stream from its pair
    first_pairs[i], stream after stream (KeyedGaussian.normal_ragged)."""
    blocks = np.empty((widths.sum(), 2), np.uint64)
    at = 0
    for i in range(streams.shape[0]):
        for j in range(widths[i]):
            blocks[at, 0] = streams[i]
            blocks[at, 1] = first_pairs[i] + np.uint64(j)
            at += 1
    return blocks
