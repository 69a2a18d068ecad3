"""The BLT noise recurrence of factorization.py, compiled (numba): one pass per stream.

`noise_paths` computes what factorization._noise_paths describes, Z' over a block of steps of
each stream and the n + 2 states before chosen steps, with the floating-point operations of the
numpy/scipy code it replaced (scipy.signal.lfilter per buffer, then numpy's products, sums,
differences and cumsum), in the same order, so every output has the same bits
(test_factorization.py runs that code as the oracle). Per step t of a stream, with x = z_t:

    y_i    = S_i + 0.0 * x                   lfilter's output: zi + b_0 x with b_0 = 0
                                              (the same as S_i but for the sign of a zero)
    Z      = x + y_1 u_1, then Z + y_i u_i    i = 2..n, in buffer order (np.add, then +=)
    S_i    = x theta_i - y_i (-theta_i)       lfilter's state update, b_1 x - a_1 y, with
                                              b = (0, theta), a = (1, -theta) (a_0 = 1, so its
                                              normalisation divides by 1: exact)
    Z'     = Z' + (Z - Z_prev) e_t            np.diff, times the step's gain, cumsum from Z'
                                              of the step before (a sum of two: commutative)

The recurrences are sequential in t; scipy ran each buffer's over every stream apart, a chain of
dependent additions and products per step (about 3.6 ns a step and buffer here), and numpy
then made a dozen more passes over the block. Here one loop per stream updates the n
independent buffers together and keeps Z, Z' in registers (about 7 ns a step for all six
buffers and Z', against about 30). numba compiles without fast-math (no reassociation, no
fused multiply-add contraction), so each written operation is one IEEE operation, rounded as
numpy rounds it.

Compiled once per machine: the first call compiles (about half a second) and caches the
machine code beside this file (numba's cache=True; __pycache__), which later processes load.
"""
from __future__ import annotations

import numba
import numpy as np


def _array(dtype, dimensions: int, readonly: bool = True):
    """A C-ordered array type; inputs read-only (writable arrays convert to it, not back)."""
    return numba.types.Array(dtype, dimensions, "C", readonly=readonly)


_FLOATS, _INTS = _array(numba.float64, 1), _array(numba.int64, 1)


# An explicit signature: compiled, or loaded from the cache, when this module is imported,
# never in the middle of a window, and never again for another layout.
@numba.njit(numba.void(_array(numba.float64, 2), _array(numba.float64, 2), _FLOATS, _FLOATS,
                       _FLOATS, _INTS, _array(numba.int64, 2),
                       _array(numba.float64, 2, readonly=False),
                       _array(numba.float64, 3, readonly=False), _FLOATS, _INTS, numba.int64,
                       _array(numba.float64, 2, readonly=False)), cache=True, nogil=True)
def noise_paths(z, starts, decays, weights, gains, first_steps, columns, noise, states,
                thresholds, lengths, block, minima):
    """Fill `noise` (rows, k; or (0, 0): not wanted) with Z' at the k steps of z's columns and
    `states` (rows, m, n + 2) with the states (S_1..S_n, Z, Z') before the step of column
    columns[r, j]. starts (rows, n + 2): the states before the first column; column c of row
    r is step first_steps[r] + c + 1, its gain gains[first_steps[r] + c]; columns[r]
    nondecreasing, each < k (checked by the caller).
    With thresholds (tau_l at l - 1; empty: none), `minima` (rows, k / block) gets the minimum
    over each block of columns of R = tau_l - Z'(l) at step l (tau's last entry past its end),
    +inf past the row's length `lengths[r]`: the values factorization's summaries computed with
    numpy (the same subtraction; a NaN, which finite noise never gives, propagates as np.min's
    does)."""
    rows, steps = z.shape
    buffers = decays.shape[0]
    wanted = columns.shape[1]
    keep_noise = noise.shape[0] > 0
    summarise = thresholds.shape[0] > 0
    last_threshold = thresholds.shape[0] - 1
    negated = -decays
    buffered = np.empty(buffers)
    outputs = np.empty(buffers)
    for row in range(rows):
        for i in range(buffers):
            buffered[i] = starts[row, i]
        previous = starts[row, buffers]
        normalised = starts[row, buffers + 1]
        j = 0
        first = first_steps[row]
        if summarise:
            for b in range(minima.shape[1]):
                minima[row, b] = np.inf
        for column in range(steps):
            x = z[row, column]
            for i in range(buffers):
                outputs[i] = buffered[i] + 0.0 * x
            while j < wanted and columns[row, j] == column:
                for i in range(buffers):
                    states[row, j, i] = outputs[i]
                states[row, j, buffers] = previous
                states[row, j, buffers + 1] = normalised
                j += 1
            total = x + outputs[0] * weights[0]
            for i in range(1, buffers):
                total = total + outputs[i] * weights[i]
            for i in range(buffers):
                buffered[i] = x * decays[i] - outputs[i] * negated[i]
            normalised = normalised + (total - previous) * gains[first + column]
            previous = total
            if keep_noise:
                noise[row, column] = normalised
            if summarise:
                step = first + column + 1
                if step <= lengths[row]:
                    required = thresholds[min(step - 1, last_threshold)] - normalised
                    lowest = minima[row, column // block]
                    if lowest == lowest and (required < lowest or required != required):
                        minima[row, column // block] = required
