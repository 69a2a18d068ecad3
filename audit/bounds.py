"""An empirical privacy auditor: a statistically sound LOWER bound on a mechanism's epsilon.

Derivation. A mechanism M is (eps, delta)-DP for a neighbouring pair (D, D') (add-or-remove-one,
the ledger's relation) iff its hockey-stick divergence is small in both directions:
    sup_S  P[M(D) in S] - e^eps P[M(D') in S]  <=  delta,   and the same with D, D' swapped.
So for EVERY event S with P[M(D) in S] > delta,
    eps  >=  ln( (P[M(D) in S] - delta) / P[M(D') in S] ).                             (1)
We do not know the two probabilities, but we run M many times on D and on D' and count how often
the output falls in S. A one-sided Clopper-Pearson interval (exact for a binomial count, via
scipy.stats.beta) gives p_low <= P[M(D) in S] and p_high >= P[M(D') in S], each failing with
probability at most a; on the event that both hold, (1) with p_low in the numerator and p_high in
the denominator is still <= eps, because (1) grows with the first and shrinks with the second.

Choosing S. The events are threshold sets: for a scalar output {x > t} or {x < t}; for a
low-dimensional output the orthant {s_1 x_1 > t_1, ..., s_k x_k > t_k} (signs s from the mean
difference). Thresholds come from quantiles of the outputs. Choosing the best S on the same
outputs that then estimate its probabilities would bias the bound upwards, so each side's runs
are split in two independent parts: the first `selection_fraction` (30%) scores every candidate
(its bound (1), at the level that would hold for all candidates at once, so that a tail event
that was lucky there rarely wins) and picks the best `events_per_direction` events per
direction; only those are evaluated on the held-out rest. The selected events are a function of
the first part alone, so on the held-out part they are fixed events and the intervals above
hold. (30% for selection measured best among 10-50% on Gaussian and Laplace shifts.)

Confidence. Both directions (D against D', and D' against D) are audited. With m events
evaluated on the held-out part (m = 2 * events_per_direction) and two intervals per event, each
interval fails with probability at most a = (1 - confidence) / (2 m) (Bonferroni). Hence, for a
mechanism that IS (eps, delta)-DP, P[epsilon_lower_bound > eps] <= 1 - confidence: a test that
fails when the lower bound exceeds the claim has false-failure rate at most 1 - confidence.
The bound is reported as max(0, max over evaluated events); 0 means "no evidence of leakage".

A lower bound is only as strong as the neighbouring pair and the events: each adapter in
`sage_tfx.audit.mechanisms` uses the worst-case pair (a record at the clipping bound) so that a
mechanism whose noise is too small for its claim shows a bound above the claim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

DEFAULT_CONFIDENCE = 0.95


@dataclass(frozen=True)
class AuditResult:
    """What `sage-tfx audit` prints (as a dict via `as_dict`)."""
    mechanism: str
    claimed_epsilon: float
    claimed_delta: float
    epsilon_lower_bound: float
    confidence: float
    trials: int  # runs of the mechanism on EACH of the two neighbouring inputs

    def as_dict(self) -> dict:
        return {"mechanism": self.mechanism, "claimed_epsilon": self.claimed_epsilon,
                "claimed_delta": self.claimed_delta,
                "epsilon_lower_bound": self.epsilon_lower_bound,
                "confidence": self.confidence, "trials": self.trials}


def clopper_pearson_lower(successes, trials: int, alpha: float) -> np.ndarray:
    """p with P[Binomial(trials, p) >= successes] = alpha: a one-sided (1 - alpha) lower bound."""
    successes = np.asarray(successes, dtype=np.float64)
    safe = np.maximum(successes, 1.0)
    return np.where(successes > 0, stats.beta.ppf(alpha, safe, trials - safe + 1.0), 0.0)


def clopper_pearson_upper(successes, trials: int, alpha: float) -> np.ndarray:
    """A one-sided (1 - alpha) upper bound on a binomial probability."""
    successes = np.asarray(successes, dtype=np.float64)
    safe = np.minimum(successes, trials - 1.0)
    return np.where(successes < trials, stats.beta.ppf(1.0 - alpha, safe + 1.0, trials - safe),
                    1.0)


def _epsilon_bounds(hits_first, hits_second, trials: int, delta: float,
                    alpha: float) -> np.ndarray:
    """(1) for every event, from counts of outputs in S on each input (outputs on the first
    input raise its probability, those on the second lower the other): -inf where p_low <= delta."""
    p_low = clopper_pearson_lower(hits_first, trials, alpha)
    p_high = clopper_pearson_upper(hits_second, trials, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(p_low > delta, np.log(np.maximum(p_low - delta, 1e-300) / p_high),
                        -np.inf)


def _as_matrix(outputs, name: str) -> np.ndarray:
    array = np.asarray(outputs, dtype=np.float64)
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2 or array.shape[1] > 3 or array.shape[0] < 4:
        raise ValueError(f"{name}: need at least 4 runs of a scalar or at most 3-dimensional "
                         f"output, got shape {np.shape(outputs)}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name}: the mechanism produced non-finite outputs")
    return array


class _Orthants:
    """Every orthant event {s_i x_i > t_i for all i} over a quantile grid of thresholds.

    Outputs are binned per coordinate (after the sign flip) and the joint histogram is summed
    from the top in each axis, so counts[j_1, ..., j_k] = #{x : s_i x_i >= edge_i[j_i]}."""

    def __init__(self, reference: np.ndarray, signs: np.ndarray, thresholds_per_axis: int):
        flipped = reference * signs
        quantiles = np.linspace(0.0, 1.0, thresholds_per_axis + 2)[1:-1]
        self.signs = signs
        self.edges = [self._edges(column, quantiles) for column in flipped.T]

    @staticmethod
    def _edges(column: np.ndarray, quantiles: np.ndarray) -> np.ndarray:
        """Quantiles of the outputs; for an output with few distinct values (a keep decision,
        a number of kept partitions) every value but the smallest, so that a value rarer than
        the first quantile (a keep of probability ~delta) still makes an event {x >= v}."""
        values = np.unique(column)
        if values.size <= quantiles.size + 1:
            return values[1:] if values.size > 1 else values  # a constant: the trivial event
        return np.unique(np.quantile(column, quantiles))

    def counts(self, outputs: np.ndarray) -> np.ndarray:
        flipped = outputs * self.signs
        # Bin j of axis i holds edge_i[j-1] <= x < edge_i[j] (bin 0: below every edge).
        index = tuple(np.searchsorted(edge, column, side="right")
                      for edge, column in zip(self.edges, flipped.T))
        shape = tuple(len(edge) + 1 for edge in self.edges)
        histogram = np.zeros(shape, dtype=np.int64)
        np.add.at(histogram, index, 1)
        for axis in range(histogram.ndim):
            histogram = np.flip(np.cumsum(np.flip(histogram, axis), axis), axis)
        # Drop bin 0 of each axis ("x >= -inf", the trivial threshold).
        return histogram[tuple(slice(1, None) for _ in shape)]


def epsilon_lower_bound(outputs_d, outputs_d_prime, *, delta: float = 0.0,
                        confidence: float = DEFAULT_CONFIDENCE, events_per_direction: int = 1,
                        thresholds_per_axis: int | None = None,
                        selection_fraction: float = 0.3) -> float:
    """A (confidence)-level lower bound on the epsilon of a mechanism from its outputs on two
    neighbouring inputs (module docstring). `outputs_*`: shape [trials] or [trials, k<=3],
    the same number of independent runs on each input."""
    first, second = _as_matrix(outputs_d, "outputs_d"), _as_matrix(outputs_d_prime,
                                                                     "outputs_d_prime")
    if first.shape != second.shape:
        raise ValueError(f"need the same number of runs and output shape on both inputs, got "
                         f"{first.shape} and {second.shape}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")
    dims = first.shape[1]
    if thresholds_per_axis is None:
        thresholds_per_axis = {1: 100, 2: 40, 3: 12}[dims]
    chosen_on = max(2, round(selection_fraction * first.shape[0]))
    held_out = first.shape[0] - chosen_on
    select_d, estimate_d = first[:chosen_on], first[chosen_on:]
    select_d_prime, estimate_d_prime = second[:chosen_on], second[chosen_on:]
    alpha = (1.0 - confidence) / (2 * (2 * events_per_direction))

    best = 0.0
    mean_difference = select_d.mean(axis=0) - select_d_prime.mean(axis=0)
    signs = np.where(mean_difference >= 0, 1.0, -1.0)
    for towards, away, held_towards, held_away, direction in (
            (select_d, select_d_prime, estimate_d, estimate_d_prime, signs),
            (select_d_prime, select_d, estimate_d_prime, estimate_d, -signs)):
        # Events where the outputs on `towards` are more frequent: thresholds on the side the
        # mean moved to.
        orthants = _Orthants(np.vstack([towards, away]), direction, thresholds_per_axis)
        counts_towards, counts_away = orthants.counts(towards), orthants.counts(away)
        # Scored at the level that would hold for all candidates at once (winner's curse).
        scores = _epsilon_bounds(counts_towards, counts_away, chosen_on, delta,
                                 alpha / counts_towards.size).ravel()
        chosen = np.argsort(scores)[::-1][:events_per_direction]
        held_bounds = _epsilon_bounds(orthants.counts(held_towards).ravel()[chosen],
                                      orthants.counts(held_away).ravel()[chosen], held_out,
                                      delta, alpha)
        best = max(best, float(np.max(held_bounds)))
    return best if math.isfinite(best) else 0.0
