"""A streaming square-root factorization of the prefix-sum workload (BLT), vectorised over streams.

The alternative to tree.py for the operator's running sums (issue 34). Both are matrix
mechanisms for the prefix-sum workload A (T x T, lower-triangular all ones): factor A = B C,
release B (C x + z) = A x + B z with z ~ N(0, sigma^2 I). Privacy is that of C x + z (a Gaussian
mechanism whose sensitivity is C's, below); B z is post-processing, so the operator only ever
computes the noise Z = B z and adds it to the exact prefix.

The square-root factorization. B = C = A^{1/2}: A is the Toeplitz matrix of 1 / (1 - x), so its
square root is the Toeplitz matrix of (1 - x)^{-1/2} = sum_k c_k x^k, c_k = binom(2k, k) / 4^k
(c_0 = 1, c_k = c_{k-1} (2k - 1) / (2k), c_k ~ 1 / sqrt(pi k)). It is within a small constant
of the best lower-triangular factorization for every T (Fichtenberger, Henzinger and Upadhyay
2023; Henzinger, Kalinin and Upadhyay 2025): per unit of sensitivity its prefix noise variance
is sum_{k<t} c_k^2 ~ ln(t) / pi, where the tree pays ~ log2(T) levels of sensitivity times
~ log2(t) / 2 Honaker nodes.

Made streaming: BLT, not binning. Z(t) = sum_{j<=t} b_{t-j} z_j with dense Toeplitz b needs
the whole history of z (O(T) memory and work per step). A buffered linear Toeplitz decoder
(Dvijotham, McMahan, Pillutla, Steinke and Thakurta 2024) replaces it by
    b_0 = 1,   b_k = sum_i u_i theta_i^k  (k >= 1),  n buffers with decays 0 < theta_i < 1,
so with S_i(t) = sum_{j<t} theta_i^{t-j} z_j:
    Z(t) = z_t + sum_i u_i S_i(t),   S_i(t + 1) = theta_i (S_i(t) + z_t),
O(n) state and work per step (blt_kernel.py runs the recurrence, compiled). We chose BLT over the
binned square root (Andersson and Pagh 2024) because (1) its state is n numbers however long
the window (binning keeps O(log T) bins of piecewise-constant coefficients); (2) its generating
function is rational, b(x) = 1 + sum_i u_i theta_i x / (1 - theta_i x), so the encoder
C = B^{-1} A, whose column norms ARE the privacy, has coefficients c(x) = 1 / ((1 - x) b(x))
computed exactly (to float rounding) by an O(T n) recurrence, for any T; (3) a sum of decaying
exponentials approximates c_k ~ k^{-1/2} well (c_k = (1/pi) int_0^1 x^(k - 1/2) (1 - x)^(-1/2) dx
is itself a mixture of exponentials in k). We parametrise the DECODER B as the BLT (the noise
generator must be the cheap one) and take the encoder to be whatever B^{-1} A is: B C = A holds
exactly, so the release is unbiased, and the accounting uses C's true coefficients, not the
square root's: fitting error only costs accuracy, never privacy.

The fit (`fit_square_root`): decays with 1 - theta_i log-spaced in [1 / (4T), 0.7], weights
u_i >= 0 by non-negative least squares of the relative error of b_k against c_k, k = 1..T-1.
With 6 buffers the mean prefix variance times the squared sensitivity is within 0.05% of the
exact square root at T = 1,000 and 0.2% at T = 10,000 (test_factorization.py, which also checks
B, C = B^{-1} A and the variances against dense matrices).

Column normalisation (`WindowFactor`, what the operator runs). C's column j (a contribution at
step j) has norm ||c_{0..T-j}||, decreasing in j: only column 1 reaches the sensitivity
s = ||c_{0..T-1}||, the later ones leave slack. Scale them up: C' = C D, D = diag(d_j),
d_j = s / ||c_{0..T-j}|| >= 1, and B' = A C'^{-1} = A D^{-1} C^{-1} = A E A^{-1} B with
E = D^{-1} = diag(e_j), e_j = ||c_{0..T-j}|| / s in (0, 1] (C^{-1} = A^{-1} B: Toeplitz
matrices commute). B' C' = A still holds exactly, B' is lower-triangular (so the release at t
depends on steps <= t), every column of C' has norm s, so the sensitivity is unchanged, and the
noise is
    Z'(t) = sum_{j<=t} e_j (Z(j) - Z(j-1))   (Z = B z the BLT noise, Z(0) = 0),
a weighted running sum of the BLT noise's increments: two more numbers of state, Z(t - 1) and
Z'(t - 1), beside the n buffers. It lowers the variance where the releases matter most, late in
the window (Var Z'(t) / Var Z(t) at T = 100: 1 at t = 1, 0.94 at t = 50, 0.69 at t = T; at
T = 1,000: 0.95 at t = 500, 0.64 at t = T; the largest over the window, s^2 max_t Var Z'(t),
falls 14% and 11%), where selection keys cross (counts grow over the window) and where the
final pane releases every value. This is the standard first step of the max-error optimal
factorizations (their solutions have equal column norms); D is fixed by T alone (public).
Not a Toeplitz matrix any more, so the matrix library's online strategy keeps the Toeplitz
square root (its workloads are not all prefixes of one window).

Sensitivity. A unit changes x by u = sum_j w_j e_j, |w_j| <= 1, over its steps (scaled by the
record bound outside); the release's sensitivity is max ||C' u||. A selection stream takes one
step of weight 1 from a unit (it counts once per (key, round)): max_j ||C' e_j|| = s. The
value sums allow several records of a unit at one step, so u ranges over the l1 ball of radius
k = C: ||C' u|| is convex, its maximum is at a vertex k e_j, so the sensitivity is k s.
`WindowFactor.sensitivity` is the largest column norm of the C' that runs, computed from its
columns (in floating point, s up to rounding), not assumed.

Noise (`FactorizationIndex`): z_t of a stream is sigma * keyed normal (stream id, counter t - 1),
so Z' is a pure function of (secret key, stream id, t): from the n + 2 states before any step
c + 1 (the buffers S(c + 1), Z(c) and Z'(c)), the recurrences run over z_{c+1}, z_{c+2}, ...
give Z' from there on, bit for bit the values of one pass from step 1 (a step is
y = S + 0 * x, then the same two products, blt_kernel.py: restarting from a state it returned
changes no operation; Z' is a running sum started from the stored Z'(c), the same additions in
the same order).
 - Value streams need no history: a cursor (a step and the n + 2 states before it, O(buffers),
   not O(T)) where the engine has settled, moved forward as the stream is released; a step
   asked again before the cursor is replayed from step 0 (state 0).
 - Selection streams keep the n + 2 states at every block start (every BLOCK = 32 steps) and the
   tree's per-block minima of R: n + 3 numbers per block, 9 ceil(T / 32) per stream, O(T / 32)
   like the tree's summaries. The prediction needs them: as a key's count grows it must find
   the first future block whose minimum the count exceeds and scan that block exactly, at any
   distance. Minima alone would force a replay from the settled step to that block: we
   measured it (two cursors per stream, the settled step and the last block scanned): 8%
   more time at T = 1,000 with the load low, 26.9 s against 21.3 s profiled at load 4-5, the
   replays doubling the noise computed (6.8 M steps against 3.2 M for block scans).

Thresholds and prediction with correlated noise. The release at step l is c + Z'(l), Z'(l)
Gaussian with sd lambda_l = sigma sqrt(Var Z'(l)) (`prefix_std`; `WindowFactor.prefix_variances`
propagates the covariance of the n + 2 states; tested against B' B'^T from dense matrices). The
coupling of budget.py needs P(exists l: Z'(l) > tau_l) <= beta over the window. The union
bound (Bonferroni) P(...) <= sum_l P(Z'(l) > tau_l) holds for ANY joint law, so tau_l =
lambda_l Phi^{-1}(1 - beta / T) is sound unchanged; tests that assume independence across steps
(e.g. 1 - prod (1 - p_l)) are not, and with strongly positively correlated Z they would not
even be needed (the union bound is then conservative, never wrong). Prediction (Algorithm 4)
stays exact: without new data the noisy count is c + Z'(l), a known function of the keyed
noise, so the first crossing is found by scanning Z', as for the tree.

Is the union bound loose? Could a sound bound over fewer events (only the steps where a key
can first cross, i.e. the upcrossings P(A_1) + sum_l P(A_l, not A_{l-1})) lower tau? Not by
more than a rounding. By Bonferroni's lower bound P(union) >= sum_l P(A_l) - sum_{l<m}
P(A_l, A_m), and at these tails the pairs are negligible: Z'(l) is z_l (fresh) plus a function
of the past, and at tau / lambda ~ 8 sd two Gaussians of correlation <= 0.91 exceed it together
orders of magnitude less often than either alone. Computed exactly for the window's covariance
(test_factorization.py, by quadrature of the bivariate normal tail), sum_{l<m} P(A_l, A_m) is
0.26% of sum_l P(A_l) at T = 100 and 0.67% at T = 1,000 with the operator's thresholds. So the
union bound is within 1% of the true probability, and any sound threshold of this shape is at
most Phi^{-1}(1 - beta / T) - Phi^{-1}(1 - 1.01 beta / T) ~ 0.001 sd (0.01% of tau) below ours.
Only lambda_l (the factorization) and beta (the budget) move tau.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from scipy.linalg import toeplitz
from scipy.optimize import nnls

from sage_tfx.dp_statistics.continual import blt_kernel
from sage_tfx.dp_statistics.continual.tree import BLOCK, TreeIndex
from sage_tfx.mechanisms.keyed import KeyedGaussian

BUFFERS = 6  # see the module docstring: within 0.2% of the exact square root up to T = 10^4
_SMALLEST_GAP, _LARGEST_GAP = 0.25, 0.7  # 1 - theta in [0.25 / T, 0.7]


def square_root_coefficients(length: int) -> np.ndarray:
    """c_k = binom(2k, k) / 4^k, k = 0..length-1: the Toeplitz coefficients of A^{1/2}."""
    ratios = (2.0 * np.arange(1, length) - 1.0) / (2.0 * np.arange(1, length))
    return np.concatenate([[1.0], np.cumprod(ratios)])[:length]


@dataclass(frozen=True)
class BufferedToeplitz:
    """The BLT decoder b_0 = 1, b_k = sum_i weights[i] decays[i]^k (module docstring)."""
    decays: tuple[float, ...]
    weights: tuple[float, ...]

    def __post_init__(self):
        decays, weights = np.asarray(self.decays, float), np.asarray(self.weights, float)
        if decays.shape != weights.shape or decays.ndim != 1 or not len(decays):
            raise ValueError("a BLT needs as many weights as decays, at least one")
        if not (np.all((decays > 0) & (decays < 1)) and np.all(np.isfinite(weights))):
            raise ValueError(f"BLT decays must be in (0, 1) and weights finite, got "
                             f"{self.decays}, {self.weights}")
        object.__setattr__(self, "decays", tuple(float(d) for d in decays))
        object.__setattr__(self, "weights", tuple(float(w) for w in weights))

    def decoder(self, length: int) -> np.ndarray:
        """b_0..b_{length-1}: the Toeplitz coefficients of B (Z = B z)."""
        steps = np.arange(1, length)[:, None]
        powers = np.exp(steps * np.log(np.asarray(self.decays))[None, :])
        return np.concatenate([[1.0], powers @ np.asarray(self.weights)])[:length]

    def encoder(self, length: int) -> np.ndarray:
        """The Toeplitz coefficients of C = B^{-1} A: c = running sum of d = the coefficients
        of 1 / b(x). b * d = 1 reads d_t = [t = 0] - sum_i u_i S_i(t) with S_i the buffers of
        d itself (S_i(t + 1) = theta_i (S_i(t) + d_t)): the same first-order recurrences as the
        noise, stable for 0 < theta < 1 (a high-order rational filter of the same function,
        lfilter(D, N), loses 1e-5 relative accuracy at T = 1,000 to its poles near 1).
        O(T n) Python-float steps: once per window plan."""
        inverse = np.empty(length)
        pairs = list(zip(self.decays, self.weights))
        states = [0.0] * len(pairs)
        for t in range(length):
            d = (1.0 if t == 0 else 0.0) - sum(weight * state for (_, weight), state
                                               in zip(pairs, states))
            inverse[t] = d
            states = [theta * (state + d) for (theta, _), state in zip(pairs, states)]
        return np.cumsum(inverse)

    def prefix_variances(self, length: int) -> np.ndarray:
        """Var Z(t) / sigma^2 = sum_{k<t} b_k^2, t = 1..length."""
        return np.cumsum(self.decoder(length) ** 2)


@functools.lru_cache(maxsize=64)
def fit_square_root(length: int, buffers: int = BUFFERS) -> BufferedToeplitz:
    """The BLT decoder closest to the square root's c_1..c_{T-1} in relative error (module
    docstring). Deterministic given (length, buffers); budget.py stores the result, so every
    engine and every restart uses the very same decays and weights."""
    if length < 2:  # one step: B = C = [1], any decoder; one buffer of weight 0
        return BufferedToeplitz((0.5,), (0.0,))
    decays = 1.0 - np.geomspace(_SMALLEST_GAP / length, _LARGEST_GAP, buffers)
    target = square_root_coefficients(length)[1:]
    powers = np.exp(np.arange(1, length)[:, None] * np.log(decays)[None, :])
    weights, _ = nnls(powers / target[:, None], np.ones(length - 1))
    return BufferedToeplitz(tuple(decays), tuple(weights))


@dataclass(frozen=True)
class WindowFactor:
    """What runs over a window of `length` steps: the BLT decoder B with its encoder's columns
    normalised (module docstring, "Column normalisation"), B' = A E A^{-1} B and C' = C E^{-1},
    E = diag(gains). A pure function of the BLT and T, both pinned in the budget."""
    blt: BufferedToeplitz
    length: int

    @property
    def width(self) -> int:
        """States per stream between steps: the n buffers, Z(t - 1) and Z'(t - 1)."""
        return len(self.blt.decays) + 2

    @functools.cached_property
    def _toeplitz_column_norms(self) -> np.ndarray:
        """||C e_j|| = ||c_{0..T-j}||, j = 1..T (decreasing)."""
        return np.sqrt(np.cumsum(np.square(self.blt.encoder(self.length))))[::-1]

    @functools.cached_property
    def gains(self) -> np.ndarray:
        """e_j = ||c_{0..T-j}|| / ||c_{0..T-1}|| in (0, 1], j = 1..T (read only)."""
        gains = self._toeplitz_column_norms / self._toeplitz_column_norms[0]
        gains.flags.writeable = False
        return gains

    @functools.cached_property
    def decays(self) -> np.ndarray:
        """The buffers' decays theta_i, as the compiled recurrence takes them."""
        return np.array(self.blt.decays)

    @functools.cached_property
    def weights(self) -> np.ndarray:
        """The buffers' weights u_i, as the compiled recurrence takes them."""
        return np.array(self.blt.weights)

    @functools.cached_property
    def padded_gains(self) -> np.ndarray:
        """The gains, then e_T repeated over 2 T + 2 BLOCK steps past the window (which no
        caller reads: a stream's columns run at most BLOCK - 1 past its end, or, for a value
        stream replayed beside a farther one, on zeros, at most T + BLOCK)."""
        return np.concatenate([self.gains, np.full(2 * self.length + 2 * BLOCK,
                                                   self.gains[-1])])

    @functools.cached_property
    def sensitivity(self) -> float:
        """max_j ||C' e_j|| (one participation, weight 1): C' = C E^{-1}, so column j is C's
        divided by e_j; all equal s up to rounding, and the largest computed one counts."""
        return float(np.max(self._toeplitz_column_norms / self.gains))

    def prefix_variances(self, length: int) -> np.ndarray:
        """Var Z'(t) / sigma^2, t = 1..length: the covariance P of the states
        x = (S_1..S_n, Z(t - 1), Z'(t - 1)) propagated through one step, x <- M_t x + g_t z_t
        (S <- theta (S + z), Z <- z + u.S, Z' <- Z' + e_t (z + u.S - Z(t - 1))), P <- M P M' +
        g g'; O(length n^3) whatever T, in blt_kernel (the same bits on every CPU)."""
        return blt_kernel.prefix_variances(self.decays, self.weights, self.gains[:length],
                                           length)

    def decoder_matrix(self, length: int) -> np.ndarray:
        """B' over the first `length` steps, dense (length x length): A E (A^{-1} B), row t the
        running sum of e_j times B's row differences. For tests and the audit."""
        decoder = self.blt.decoder(length)
        differences = toeplitz(np.diff(decoder, prepend=0.0), np.zeros(length))
        return np.cumsum(self.gains[:length, None] * differences, axis=0)


def prefix_std(factor: WindowFactor, length: int, sigma: float) -> np.ndarray:
    """lambda_t, the standard deviation of Z'(t), t = 1..length."""
    return sigma * np.sqrt(factor.prefix_variances(length))


def _noise_paths(factor: WindowFactor, z: np.ndarray, starts: Optional[np.ndarray],
                 first_steps: np.ndarray,
                 columns: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """Z' over the columns of z (rows: streams; column k is step first_steps + k + 1) from the
    states `starts` (rows, n + 2) before the first column (None: step 1, all zero), and the
    states before the step of `columns` (per row, (rows, k), nondecreasing; None: none):
    (rows, k, n + 2). One compiled pass (blt_kernel.py, which says why its bits are those of
    the recurrences written out in numpy)."""
    noise_by_step, states, _ = _recurrences(factor, np.asarray(z).T, starts, first_steps,
                                            columns)
    return np.ascontiguousarray(noise_by_step.T), states


def _recurrences(factor: WindowFactor, z_by_step: np.ndarray, starts: Optional[np.ndarray],
                 first_steps: np.ndarray, columns: Optional[np.ndarray],
                 thresholds: Optional[np.ndarray] = None,
                 lengths: Optional[np.ndarray] = None) -> tuple:
    """_noise_paths with z and Z' transposed, (steps, rows): the kernel advances the streams
    together, streams innermost. With `thresholds` and the rows' `lengths`, the minima of R
    over each block of BLOCK steps instead of Z' (None, states, minima): the summaries of new
    selection streams, without writing their whole Z'."""
    z_by_step = np.ascontiguousarray(z_by_step, dtype=np.float64)
    steps, rows = z_by_step.shape
    starts = (np.zeros((rows, factor.width)) if starts is None
              else np.ascontiguousarray(starts, dtype=np.float64))
    at = (np.zeros((rows, 0), np.int64) if columns is None
          else np.ascontiguousarray(np.broadcast_to(columns, (rows, np.shape(columns)[-1])),
                                    dtype=np.int64))
    first_steps = np.ascontiguousarray(first_steps, dtype=np.int64)
    gains = factor.padded_gains
    # The compiled loop does not check its indices: refuse here what would read out of bounds.
    if starts.shape != (rows, factor.width) or first_steps.shape != (rows,):
        raise ValueError("noise paths need one row of states and one first step per stream "
                         "(an engine bug: the shapes do not match)")
    if rows and steps and (first_steps.min() < 0 or first_steps.max() + steps > len(gains)):
        raise ValueError(f"noise paths past the gains of a window of {factor.length} steps")
    if at.size and (at.min() < 0 or at.max() >= steps or (np.diff(at, axis=1) < 0).any()):
        raise ValueError(f"state columns must be nondecreasing in 0..{steps - 1}")
    states = np.empty(at.shape + (factor.width,))
    if thresholds is None:
        noise_by_step, minima = np.empty((steps, rows)), np.empty((0, 0))
        thresholds, lengths = np.empty(0), np.empty(0, np.int64)
    else:
        if steps % BLOCK or len(thresholds) == 0 or np.shape(lengths) != (rows,):
            raise ValueError("summaries need whole blocks, thresholds and each row's length")
        noise_by_step, minima = None, np.empty((rows, steps // BLOCK))
        thresholds = np.ascontiguousarray(thresholds, dtype=np.float64)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    blt_kernel.noise_paths(z_by_step, starts, factor.decays, factor.weights, gains,
                           first_steps, at,
                           np.empty((0, 0)) if noise_by_step is None else noise_by_step,
                           states, thresholds, lengths, BLOCK, minima)
    return noise_by_step, states, minima


@dataclass
class FactorizationIndex(TreeIndex):
    """TreeIndex's contract (rows are streams, first_crossing, noise_at, storage) with the
    factorization's noise Z' (module docstring, "Noise"). Selection streams (with thresholds):
    `bases` holds the n + 2 states at every block start, (rows, n_blocks, n + 2), and minima as
    the tree's. Value streams: `bases` holds the states before step `cursors` + 1, (rows, n + 2),
    where the caller has settled (it never asks about earlier steps again; if it does, the
    stream is replayed from step 0, whose state is 0)."""
    factor: Optional[WindowFactor] = field(default=None)
    cursors: Optional[np.ndarray] = field(default=None)

    @classmethod
    def empty(cls, sigma: float, max_length: int, thresholds: Optional[np.ndarray] = None,
              factor: Optional[WindowFactor] = None) -> "FactorizationIndex":
        n_blocks = -(-max_length // BLOCK)
        width = factor.width
        if thresholds is None:
            return cls(sigma, None, n_blocks, np.zeros(0, np.uint64), np.zeros(0, np.int64),
                       np.zeros((0, width)), None, factor=factor,
                       cursors=np.zeros(0, np.int64))
        return cls(sigma, np.asarray(thresholds, float), n_blocks, np.zeros(0, np.uint64),
                   np.zeros(0, np.int64), np.zeros((0, n_blocks, width)),
                   np.zeros((0, n_blocks)), factor=factor)

    def _reserve(self, extra: int) -> None:
        super()._reserve(extra)
        if self.cursors is not None and len(self.cursors) < len(self.tree_ids):
            cursors = np.zeros(len(self.tree_ids), np.int64)
            cursors[:self.size] = self.cursors[:self.size]
            self.cursors = cursors

    def _noise(self, noise: KeyedGaussian, tree_ids, first_step: np.ndarray,
               count: int) -> np.ndarray:
        """sigma z_t for t = first_step + 1 .. first_step + count of each stream (any first
        step: normal_rows starts at even counters, so an odd start drops one value)."""
        first_step = np.asarray(first_step, np.int64)
        odd = (first_step & 1).astype(bool)
        z = noise.normal_rows(tree_ids, (first_step - odd).astype(np.uint64), count + 1)
        # (All even, as every new stream's: the first `count`, without a copy.)
        z = np.where(odd[:, None], z[:, 1:], z[:, :count]) if odd.any() else z[:, :count]
        z *= self.sigma
        return z

    def _summarise(self, noise, rows, tree_ids, lengths, longest) -> None:
        if self.minima is None:  # a value stream: nothing to compute before its first release
            self.bases[rows] = 0.0
            self.cursors[rows] = 0
            return
        n_blocks = -(-longest // BLOCK)
        width = n_blocks * BLOCK
        z = self._noise(noise, tree_ids, np.zeros(len(rows), np.int64), width)
        _, states, minima = _recurrences(self.factor, z.T, None, np.zeros(len(rows), np.int64),
                                         np.arange(0, width, BLOCK), self.thresholds, lengths)
        bases = np.full((len(rows),) + self.bases.shape[1:], np.nan)
        bases[:, :n_blocks] = states
        self.bases[rows] = bases
        # _block_noise restarts the recurrences from these stored states: the same recurrence
        # from the same state gives the same bits, so the stored minima agree with a later scan.
        self._set_minima(rows, minima)

    def _block_noise(self, noise, rows, blocks, settled) -> np.ndarray:
        """Z'(b * BLOCK + r) for r = 1..BLOCK of block b of each row: (len(rows), BLOCK)."""
        rows, blocks = np.asarray(rows, np.int64), np.asarray(blocks, np.int64)
        if self.cursors is None:  # a selection stream: from the block's stored states
            z = self._noise(noise, self.tree_ids[rows], blocks * BLOCK, BLOCK)
            return _noise_paths(self.factor, z, self.bases[rows, blocks], blocks * BLOCK)[0]
        # A value stream: from its cursor (or step 0 if the cursor is past the block), every
        # row as far as its block's end: one keyed-noise call per group of rows, each its own
        # count (normal_ragged), run together (a row past its end runs on zeros, unread); the
        # cursor then moves to min(block start, settled) if that is later. A group holds the
        # counts of one power of two, so a row runs at most twice its own count: one stream
        # quiet for most of the window does not make every row of the call run as far (20,000
        # rows with one 960 steps behind: 262 ms and rows x T of memory in one call). Each row's
        # values depend on its own stream alone, so the groups give the same bits.
        starts = blocks * BLOCK
        behind = self.cursors[rows] > starts
        origins = np.where(behind, 0, self.cursors[rows])
        states = np.where(behind[:, None], 0.0, self.bases[rows])
        lead = starts - origins
        counts = lead + BLOCK
        keep = np.maximum(np.minimum(starts, np.asarray(settled, np.int64)), origins)
        out = np.empty((len(rows), BLOCK))
        kept = np.empty((len(rows), 1, self.factor.width))
        count_classes = np.frexp(counts.astype(np.float64))[1]  # 2^(e - 1) <= count < 2^e
        for count_class in np.unique(count_classes):
            group = np.flatnonzero(count_classes == count_class)
            z_by_step = self._ragged_noise(noise, self.tree_ids[rows[group]], origins[group],
                                           counts[group])
            noise_by_step, kept[group] = _recurrences(
                self.factor, z_by_step, states[group], origins[group],
                (keep[group] - origins[group])[:, None])[:2]
            out[group] = noise_by_step[lead[group][:, None] + np.arange(BLOCK),
                                       np.arange(len(group))[:, None]]
        forward = keep > self.cursors[rows]
        self.cursors[rows[forward]] = keep[forward]
        self.bases[rows[forward]] = kept[forward, 0]
        return out

    def _ragged_noise(self, noise: KeyedGaussian, tree_ids, first_step: np.ndarray,
                      counts: np.ndarray) -> np.ndarray:
        """_noise with a count per stream, transposed: (max count, rows), sigma z_t at
        [t - first_step - 1, row], zero past a row's count."""
        odd = first_step & 1  # normal_ragged starts at even counters: an odd start drops one
        values, starts = noise.normal_ragged(tree_ids, (first_step - odd).astype(np.uint64),
                                             counts + odd)
        z_by_step = np.zeros((int(counts.max()) if len(counts) else 0, len(counts)))
        blt_kernel.scaled_by_step(values, starts + odd, counts, self.sigma, z_by_step)
        return z_by_step

    def to_arrays(self) -> dict[str, np.ndarray]:
        arrays = super().to_arrays()
        if self.cursors is not None:
            arrays["cursors"] = self.cursors[:self.size]
        return arrays

    @classmethod
    def from_arrays(cls, sigma: float, max_length: int, thresholds: Optional[np.ndarray],
                    arrays: dict[str, np.ndarray],
                    factor: Optional[WindowFactor] = None) -> "FactorizationIndex":
        index = cls.empty(sigma, max_length, thresholds, factor)
        size = len(arrays["tree_ids"])
        index.tree_ids = np.array(arrays["tree_ids"], dtype=np.uint64)
        index.lengths = np.array(arrays["lengths"], dtype=np.int64)
        index.bases = np.array(arrays["bases"], dtype=np.float64).reshape(
            (size,) + index.bases.shape[1:])
        if thresholds is None:
            index.cursors = np.array(arrays["cursors"], dtype=np.int64)
        else:
            index.minima = np.array(arrays["minima"], dtype=np.float64).reshape(
                size, index.n_blocks)
        index.size = size
        return index


def prefix_noise(noise: KeyedGaussian, tree_ids, factor: WindowFactor, length: int,
                 sigma: float) -> np.ndarray:
    """Z'(t) for t = 1..length of each stream, in one pass: (len(tree_ids), length)."""
    tree_ids = np.asarray(tree_ids, dtype=np.uint64)
    z = noise.normal_rows(tree_ids, np.zeros(len(tree_ids), np.uint64), length) * sigma
    return _noise_paths(factor, z, None, np.zeros(len(tree_ids), np.int64))[0]
