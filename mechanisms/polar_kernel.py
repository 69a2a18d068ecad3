"""The arithmetic of keyed.py's polar draws, compiled (numba): the same operations in the same
order as the numpy code they replaced, so the same bits (test_keyed.py pins the values).

keyed.KeyedGaussian._pairs draws a pair of normals per AES block: (u, v) uniform in [-1, 1)^2
from the block's two words, kept if 0 < s = u^2 + v^2 < 1, else redrawn from the next attempt's
block; then (u, v) * sqrt(-2 ln s / s). In numpy that was about 25 passes and calls per batch
of blocks and 12 more per round of redraws (a round for 21% of the pairs, then 4.6%, ... :
about seven rounds for 30,000 pairs, three for a hundred), most of the time of a call for the
few dozen streams the engine draws at once. Here each is one loop. AES stays in `cryptography`
and the logarithm in numpy (np.log's own SIMD code: a compiled log could round differently);
every other operation is an IEEE shift, or, subtraction, product, quotient or square root,
rounded as numpy rounds it (numba compiles without fast-math: no reassociation, no fused
multiply-add).

Compiled when first imported on a machine and cached (sage_tfx.compiled.kernel: beside this
file, or compiled in each process where no cache can be written); keyed.py imports it, so a
draw never compiles, and never fails, after a charge.
"""
from __future__ import annotations

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


@kernel(numba.void(numba.float64[:, ::1], _FLOATS, _FLOATS))
def polar_scale(pairs, radius, log_radius):
    """pairs *= sqrt(-2 ln s / s) per row, in place: (ln s * -2.0) / s, its square root, then
    each of u and v times it, as numpy computed it."""
    for i in range(pairs.shape[0]):
        factor = np.sqrt(log_radius[i] * -2.0 / radius[i])
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
