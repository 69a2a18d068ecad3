"""How noisy each released value is: its noise standard deviation and a 95% interval, derived
from the noise that ran (issue 33). Post-processing only: every input is a released noisy value
or a public parameter (the noise law's scale comes from the step's dp-accounting event and the
aggregate's sensitivity), so stating accuracy costs no budget.

What the interval covers: the value the noise was added to, i.e. the aggregate of the rows the
operator read AFTER contribution bounding (at most C_u groups per unit, m rows per group,
values clamped into the bounds; NULLs skipped), not the unbounded population statistic.

Method per aggregate (confidence 1 - alpha, alpha = 0.05):

* COUNT, COUNT(col), COUNT(DISTINCT unit), SUM: value +- the noise law's two-sided 1 - alpha
  quantile (Laplace of scale b: b ln(1/alpha); Gaussian sigma: z sigma; the selection's
  discrete Laplace: its exact integer tail). Exact coverage. A count that partition selection
  kept is conditioned on passing the selection, which biases small counts upward; the interval
  is of the noise law alone.
* a row-scoped SUM derived from an AVG (mid N + S): each noise within its 1 - alpha/2 interval
  (union bound), so |error| <= |mid| w_N + w_S with probability >= 1 - alpha.
* AVG: the noisy count N and centred sum S each within their 1 - alpha/2 intervals (union
  bound, probability >= 1 - alpha); the interval is the range of mid + s / n over that box,
  clamped into [L, U] ([L, U] itself when the box reaches n <= 0), widened to the released
  mean where its estimator (pooled over the groups, or shrunk towards the midpoint) took it
  outside. Conservative (coverage >= 95%, whatever the estimator: the box is of the group's own
  noisy sums). Its "stddev" is the error its estimator states (aggregators.mean_estimate):
  with 10 or more groups the pooled predictor's, sqrt(t_i v_i + (1 - t_i)^2 / sum w), under its
  model of the groups' spread; with fewer the midpoint shrinkage's bound sqrt(t v) / N,
  v = sd_S^2 + h^2 sd_N^2 (aggregators.mean_shrinkage: to first order, whatever the true mean in
  [L, U]); capped at h = (U - L) / 2.
* VAR, STDDEV: the same box over (N, S, Q) at 1 - alpha/3 each, the range of
  Q/n + h^2/2 - (s/n)^2 over it (the extremes lie at the corners, at s = 0, or at the
  stationary point n = 2 s^2 / Q), clamped into [0, h^2] (STDDEV: its square root).
  Conservative. Stddev: the delta method, approximate.
* quantiles (a descent of the noisy quantile tree, aggregators.quantile_from_tree): the
  released quantile sits where the noisy rank C(x) reaches q T (T the noisy total, the sum of
  the level-1 counts). At a leaf edge, C(x) - q T is a signed sum of at most
  R = b + (H - 1)(b - 1) node counts with coefficients in [-1, 1] (the b level-1 counts, and
  at most b - 1 left siblings per lower level: aggregators.QUANTILE_RANK_TERMS, 10 for the
  4-way, 3-level tree), so its noise has standard deviation <= sqrt(R) sd_node. The interval
  maps the fractions q +- z sqrt(R) sd_node / T through the same descent of the released tree
  (a fraction at or beyond 0 or 1 gives the bound L or U itself), and the stddev is its
  half-width / z. Approximate (a normal approximation of the summed
  noise; the descent renormalises at each level by the children's own noisy total rather than
  its parent's count, and reads negative counts as 0; the leaf bucketing error (U - L) / b^H
  not counted): the measured coverage of the noiseless value is in
  tests/dp_statistics/aggregation/test_sql_semantics.py.

Every computation here is total: a value near spec.MAX_MAGNITUDE gives an infinite width,
never an error after the charge (numpy's overflow warnings silenced: `_total`).
"""
from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist
from typing import Sequence

import numpy as np
from dp_accounting import dp_event

CONFIDENCE = 0.95
ALPHA = 1.0 - CONFIDENCE
SUFFIXES = ("_stddev", "_ci_low", "_ci_high")


@dataclasses.dataclass(frozen=True)
class NoiseLaw:
    """The noise added to each coordinate of one noisy sum: Laplace of scale `scale`, Gaussian
    of standard deviation `scale`, or discrete Laplace P(z) ~ exp(-a |z|) with a = 1 / scale."""
    kind: str  # "laplace" | "gaussian" | "discrete_laplace"
    scale: float

    @classmethod
    def of(cls, event: dp_event.DpEvent, sensitivity: float) -> "NoiseLaw":
        """The law a mechanism ran, from its event (noise multiplier = scale per unit of
        sensitivity) and the sensitivity it was calibrated to (L1 for Laplace, L2 for
        Gaussian). The mechanisms round the sensitivity up by at most 2^-20 of it for their
        lattice: the stated scale is the calibration's, within that factor."""
        if isinstance(event, dp_event.SelfComposedDpEvent):
            event = event.event
        if isinstance(event, dp_event.NoOpDpEvent):  # no noise ran (a test's noiseless run)
            return cls("laplace", 0.0)
        if isinstance(event, dp_event.LaplaceDpEvent):
            return cls("laplace", event.noise_multiplier * sensitivity)
        if isinstance(event, dp_event.GaussianDpEvent):
            return cls("gaussian", event.noise_multiplier * sensitivity)
        if isinstance(event, dp_event.DiscreteLaplaceDpEvent):
            return cls("discrete_laplace", 1.0 / event.noise_parameter)
        raise TypeError(f"no noise law for {type(event).__name__}")

    @property
    def stddev(self) -> float:
        if self.kind == "laplace":
            return math.sqrt(2.0) * self.scale
        if self.kind == "gaussian":
            return self.scale
        a = 1.0 / self.scale  # two-sided geometric: variance 2 e^-a / (1 - e^-a)^2
        return math.sqrt(2.0 * math.exp(-a)) / -math.expm1(-a)

    def half_width(self, alpha: float) -> float:
        """w with P(|noise| > w) <= alpha."""
        if self.kind == "laplace":
            return self.scale * math.log(1.0 / alpha)
        if self.kind == "gaussian":
            return self.scale * NormalDist().inv_cdf(1.0 - alpha / 2.0)
        # P(|Z| >= k) = 2 e^(-a k) / (1 + e^-a): the smallest integer w with P(|Z| > w) <= alpha
        a = 1.0 / self.scale
        return max(0.0, math.ceil(math.log(2.0 / (alpha * (1.0 + math.exp(-a)))) / a) - 1.0)


# Each stated-accuracy function runs under this: overflow to inf is an answer, not a warning.
_total = np.errstate(over="ignore", invalid="ignore", divide="ignore")


def _columns(stddev, low, high, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.broadcast_to(np.asarray(x, dtype=np.float64), (size,)).copy()
                 for x in (stddev, low, high))


@_total
def additive(values: np.ndarray, laws: Sequence[tuple[float, NoiseLaw]]):
    """A value that is a linear combination sum c_i X_i of noisy sums (one term: the noisy sum
    itself): stddev sqrt(sum c_i^2 sd_i^2), interval value +- sum |c_i| w_i(alpha / k)."""
    alpha = ALPHA / len(laws)
    stddev = math.hypot(*(c * law.stddev for c, law in laws))  # inf, never an overflow error
    width = sum(abs(c) * law.half_width(alpha) for c, law in laws)
    return _columns(stddev, values - width, values + width, len(values))


def _box(value: np.ndarray, law: NoiseLaw, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    width = law.half_width(alpha)
    return value - width, value + width


@_total
def mean(estimate: np.ndarray, error: np.ndarray, rows: np.ndarray, centred: np.ndarray,
         mid: float, low: float, high: float, rows_law: NoiseLaw, sum_law: NoiseLaw):
    """AVG's stddev and interval (module docstring); ``estimate`` the released mean, ``error``
    its root mean squared error as its estimator states it (aggregators.mean_estimate)."""
    n_low, n_high = _box(rows, rows_law, ALPHA / 2)
    s_low, s_high = _box(centred, sum_law, ALPHA / 2)
    positive = n_low > 0
    safe_low, safe_high = np.where(positive, n_low, 1.0), np.where(positive, n_high, 1.0)
    corners = np.stack([s / n for s in (s_low, s_high) for n in (safe_low, safe_high)])
    # widened to the estimate where the shrinkage took it outside: a superset still covers
    ci_low = np.minimum(np.where(positive, np.clip(mid + corners.min(axis=0), low, high), low),
                        estimate)
    ci_high = np.maximum(np.where(positive, np.clip(mid + corners.max(axis=0), low, high), high),
                         estimate)
    return _columns(np.minimum(error, (high - low) / 2.0), ci_low, ci_high, len(rows))


@_total
def variance(rows: np.ndarray, centred: np.ndarray, squares: np.ndarray, half: float,
             laws: Sequence[NoiseLaw], root: bool):
    """VAR's (STDDEV's with `root`) stddev and interval (module docstring). `squares`: the
    noisy sum of (clamp(x) - mid)^2 - h^2 / 2."""
    rows_law, sum_law, squares_law = laws
    n_low, n_high = _box(rows, rows_law, ALPHA / 3)
    s_low, s_high = _box(centred, sum_law, ALPHA / 3)
    q_low, q_high = _box(squares, squares_law, ALPHA / 3)
    # var = g(q, s, n) + h^2 / 2 with g = q / n - (s / n)^2, q the shifted squares' sum.
    positive = n_low > 0
    n_low_safe, n_high_safe = np.where(positive, n_low, 1.0), np.where(positive, n_high, 1.0)
    s_candidates = [s_low, s_high, np.where((s_low < 0) & (s_high > 0), 0.0, s_low)]
    values = []
    for q in (q_low, q_high):
        for s in s_candidates:
            stationary = np.where(q > 0, 2.0 * s ** 2 / np.where(q > 0, q, 1.0), n_low_safe)
            for n in (n_low_safe, n_high_safe, np.clip(stationary, n_low_safe, n_high_safe)):
                values.append(q / n - (s / n) ** 2 + half ** 2 / 2.0)
    values = np.stack(values)
    top = half ** 2
    ci_low = np.where(positive, np.clip(values.min(axis=0), 0.0, top), 0.0)
    ci_high = np.where(positive, np.clip(values.max(axis=0), 0.0, top), top)
    count = np.maximum(rows, 1.0)
    gradient_n = -squares / count ** 2 + 2.0 * centred ** 2 / count ** 3
    stddev = np.sqrt((squares_law.stddev / count) ** 2
                     + (2.0 * centred * sum_law.stddev / count ** 2) ** 2
                     + (gradient_n * rows_law.stddev) ** 2)
    if not root:
        return _columns(np.minimum(stddev, top), ci_low, ci_high, len(rows))
    estimate = np.sqrt(np.clip(squares / count + top / 2.0 - (centred / count) ** 2, 0.0, top))
    root_stddev = np.where(estimate > 0, stddev / (2.0 * np.where(estimate > 0, estimate, 1.0)),
                           half)
    return _columns(np.minimum(root_stddev, half), np.sqrt(ci_low), np.sqrt(ci_high), len(rows))


@_total
def quantile(total: np.ndarray, rank_terms: int, q: float, law: NoiseLaw, value_at,
             low: float, high: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A quantile's stddev and interval (module docstring): ``total`` the noisy total per
    partition, ``rank_terms`` the R node counts a rank sums, ``law`` each node's noise,
    ``value_at(fractions)`` the released post-processing read at one fraction per
    partition."""
    z = NormalDist().inv_cdf(1.0 - ALPHA / 2.0)
    rank_width = z * math.sqrt(rank_terms) * law.stddev
    safe_total = np.where(total > 0, total, 1.0)
    below, above = q - rank_width / safe_total, q + rank_width / safe_total
    # A fraction beyond [0, 1] puts the end at the bound itself: the descent read at 0 (or 1)
    # stops at the first (last) positive count, which noise can put anywhere.
    ci_low = np.where((total > 0) & (below > 0), value_at(np.clip(below, 0.0, 1.0)), low)
    ci_high = np.where((total > 0) & (above < 1), value_at(np.clip(above, 0.0, 1.0)), high)
    return _columns((ci_high - ci_low) / (2.0 * z), ci_low, ci_high, len(total))


def monotone(values: np.ndarray) -> np.ndarray:
    """Quantiles of one column in order of q, as a (partitions, k) array, sorted per partition
    (post-processing). Sorting the lower and the upper interval ends the same way keeps
    simultaneous coverage: if lo_i <= t_i for every i with t sorted, the i-th smallest lo is at
    most t_i."""
    return np.sort(values, axis=1)


def interval_columns(name: str) -> list[str]:
    return [name + suffix for suffix in SUFFIXES]

