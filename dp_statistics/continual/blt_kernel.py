"""The BLT noise recurrence of factorization.py, compiled (numba), every stream in step.

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

The recurrences are sequential in t: scipy ran each buffer's over each stream apart, a chain of
dependent additions and products per step (about 3.6 ns a step and buffer here), and numpy
then made a dozen more passes over the block. Here the streams advance together, step by step
(z transposed, streams innermost): each operation above runs over every stream at once, a
loop the compiler vectorises, since streams are independent. About 4.5 ns a step of a stream
for all six buffers, Z' and the summaries' minima (64 streams together; more for a handful),
against about 40. numba compiles without fast-math (no reassociation, no fused multiply-add
contraction): each operation written is one IEEE operation per stream, rounded as numpy rounds
it, whichever vector lane runs it.

Compiled when first imported on a machine (2-4 s) and cached (sage_tfx.compiled.kernel: in
__pycache__ beside this file, or compiled in each process where no cache can be written):
later processes load the machine code at import (about 0.2 s, and numba's own import 0.2 s),
never in the middle of a window.
"""
from __future__ import annotations

import numba
import numpy as np

from sage_tfx.compiled import kernel


def _array(dtype, dimensions: int, readonly: bool = True):
    """A C-ordered array type; inputs read-only (writable arrays convert to it, not back)."""
    return numba.types.Array(dtype, dimensions, "C", readonly=readonly)


_FLOATS, _INTS = _array(numba.float64, 1), _array(numba.int64, 1)


# An explicit signature: compiled, or loaded from the cache, when this module is imported,
# never in the middle of a window, and never again for another layout.
@kernel(numba.void(_array(numba.float64, 2), _array(numba.float64, 2), _FLOATS, _FLOATS,
                       _FLOATS, _INTS, _array(numba.int64, 2),
                       _array(numba.float64, 2, readonly=False),
                       _array(numba.float64, 3, readonly=False), _FLOATS, _INTS, numba.int64,
                       _array(numba.float64, 2, readonly=False)))
def noise_paths(steps_by_stream, starts, decays, weights, gains, first_steps, columns,
                noise_by_step, states, thresholds, lengths, block, minima):
    """For z given as steps_by_stream (k, rows): z transposed, column r one stream's steps.
    Fills `noise_by_step` (k, rows; or (0, 0): not wanted) with Z' at those steps, and
    `states` (rows, m, n + 2) with the states (S_1..S_n, Z, Z') before the step of column
    columns[r, j]. starts (rows, n + 2): the states before the first step; step c of stream r
    is its step first_steps[r] + c + 1, of gain gains[first_steps[r] + c]; columns[r]
    nondecreasing, each < k (the caller checks the indices: none is checked here).
    With thresholds (tau_l at l - 1; empty: none), `minima` (rows, k / block) gets the minimum
    over each block of steps of R = tau_l - Z'(l) at step l (tau's last entry past its end),
    +inf past the stream's length `lengths[r]`: the values factorization's summaries computed
    with numpy (the same subtraction; a NaN, which finite noise never gives, propagates as
    np.min's does)."""
    steps, rows = steps_by_stream.shape
    buffers = decays.shape[0]
    wanted = columns.shape[1]
    keep_noise = noise_by_step.shape[0] > 0
    summarise = thresholds.shape[0] > 0
    last_threshold = thresholds.shape[0] - 1
    negated = -decays
    held = np.empty((buffers, rows))
    outputs = np.empty((buffers, rows))
    previous = np.empty(rows)
    normalised = np.empty(rows)
    total = np.empty(rows)
    lowest = np.full(rows, np.inf)
    # Streams that start at the same step (new selection streams, most scans) share each step's
    # gain and threshold: one number per step, not one gather per stream.
    common = rows > 0
    for r in range(rows):
        common = common and first_steps[r] == first_steps[0]
    next_state = np.zeros(rows, np.int64)  # the index in columns[r] of the next state to keep
    upcoming = steps  # the first step at which some stream keeps its states
    for r in range(rows):
        for i in range(buffers):
            held[i, r] = starts[r, i]
        previous[r] = starts[r, buffers]
        normalised[r] = starts[r, buffers + 1]
        if wanted:
            upcoming = min(upcoming, columns[r, 0])
    for step in range(steps):
        x = steps_by_stream[step]
        for i in range(buffers):
            held_i, output_i = held[i], outputs[i]
            for r in range(rows):
                output_i[r] = held_i[r] + 0.0 * x[r]
        if step == upcoming:
            upcoming = steps
            for r in range(rows):
                j = next_state[r]
                while j < wanted and columns[r, j] == step:
                    for i in range(buffers):
                        states[r, j, i] = outputs[i, r]
                    states[r, j, buffers] = previous[r]
                    states[r, j, buffers + 1] = normalised[r]
                    j += 1
                next_state[r] = j
                if j < wanted:
                    upcoming = min(upcoming, columns[r, j])
        weight, output_i = weights[0], outputs[0]
        for r in range(rows):
            total[r] = x[r] + output_i[r] * weight
        for i in range(1, buffers):
            weight, output_i = weights[i], outputs[i]
            for r in range(rows):
                total[r] = total[r] + output_i[r] * weight
        for i in range(buffers):
            decay, minus_decay, held_i, output_i = decays[i], negated[i], held[i], outputs[i]
            for r in range(rows):
                held_i[r] = x[r] * decay - output_i[r] * minus_decay
        if common:
            gain = gains[first_steps[0] + step]
            for r in range(rows):
                normalised[r] = normalised[r] + (total[r] - previous[r]) * gain
        else:
            for r in range(rows):
                normalised[r] = normalised[r] + (total[r] - previous[r]) * gains[
                    first_steps[r] + step]
        previous[:] = total
        if keep_noise:
            noise_by_step[step, :] = normalised
        if summarise and common:
            at = first_steps[0] + step + 1
            threshold = thresholds[min(at - 1, last_threshold)]
            for r in range(rows):
                required = threshold - normalised[r]
                if at <= lengths[r] and lowest[r] == lowest[r] and (required < lowest[r]
                                                                   or required != required):
                    lowest[r] = required
        elif summarise:
            for r in range(rows):
                at = first_steps[r] + step + 1
                required = thresholds[min(at - 1, last_threshold)] - normalised[r]
                if at <= lengths[r] and lowest[r] == lowest[r] and (required < lowest[r]
                                                                   or required != required):
                    lowest[r] = required
        if summarise and (step + 1) % block == 0:
            for r in range(rows):
                minima[r, step // block] = lowest[r]
                lowest[r] = np.inf


@kernel(numba.void(_FLOATS, _INTS, _INTS, numba.float64,
                       _array(numba.float64, 2, readonly=False)))
def scaled_by_step(values, starts, counts, sigma, by_step):
    """by_step[j, r] = values[starts[r] + j] * sigma for j < counts[r] (the caller sizes
    by_step and checks the indices): ragged keyed normals as z transposed, times sigma."""
    for r in range(counts.shape[0]):
        for j in range(counts[r]):
            by_step[j, r] = values[starts[r] + j] * sigma


@kernel(_array(numba.float64, 1, readonly=False)(_FLOATS, _FLOATS, _FLOATS, numba.int64))
def prefix_variances(decays, weights, gains, length):
    """Var Z'(t) / sigma^2, t = 1..length, as factorization.WindowFactor.prefix_variances
    describes: P <- M_t P M_t' + g_t g_t' over the n + 2 states. The thresholds that decide
    every release are these times a constant, and each engine, worker and resumed job
    recomputes them, so they must have the same bits on every CPU: numpy's `@` calls BLAS,
    whose kernels (chosen per CPU) sum in their own orders with FMA. Here every product is a
    plain loop, summed in index order."""
    n = decays.shape[0]
    width = n + 2
    step = np.zeros((width, width))
    for i in range(n):
        step[i, i] = decays[i]
        step[n, i] = weights[i]
    step[n + 1, n + 1] = 1.0
    fresh = np.zeros(width)
    fresh[:n] = decays
    fresh[n] = 1.0
    covariance = np.zeros((width, width))
    product = np.empty((width, width))
    variances = np.empty(length)
    for t in range(length):
        gain = gains[t]
        for i in range(n):
            step[n + 1, i] = gain * weights[i]
        step[n + 1, n] = -gain
        fresh[n + 1] = gain
        for i in range(width):  # product = M P
            for j in range(width):
                total = 0.0
                for k in range(width):
                    total += step[i, k] * covariance[k, j]
                product[i, j] = total
        for i in range(width):  # P = (M P) M' + g g'
            for j in range(width):
                total = 0.0
                for k in range(width):
                    total += product[i, k] * step[j, k]
                covariance[i, j] = total + fresh[i] * fresh[j]
        variances[t] = covariance[n + 1, n + 1]
    return variances
