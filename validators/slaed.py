"""SLAed validation tests (Sage §3.3, Listing 2, Appendix B): ACCEPT / REJECT / RETRY with a DP
release and a statistical guarantee. numpy only; the noise comes from sage_tfx.mechanisms
(floating-point-safe Laplace, shared with the DP analyzers), which cannot be seeded.

Setting. The test set holds n i.i.d. draws from the data distribution D. A validator spends
`epsilon` (add/remove-one, the ledger's relation) on two Laplace releases made once and shared by
its Accept and Reject tests (everything after the releases is post-processing):
    n_dp = n + Lap(2 / epsilon)          (count, sensitivity 1, epsilon / 2)
    S_dp = S + Lap(2 R / epsilon)        (sum of values clipped to [0, R], sensitivity R, epsilon / 2)
With eta = (1 - confidence) / 2 per test, each test splits eta in three: a third for each
Laplace correction and a third for the concentration bound (union bound).

Laplace tails. For X ~ Lap(b): P[X > t] = exp(-t / b) / 2. So
    one-sided at probability p:  t = b ln(1 / (2p));  two-sided: t = b ln(1 / p).
Listing 2's "2 log(3 / (2 eta)) / epsilon" is the one-sided t at p = eta / 3 with b = 2 / epsilon.

Bernstein bounds for the mean mu of values in [0, R] (Shalev-Shwartz & Ben-David, Lemma B.10,
scaled from [0, 1] to [0, R]; the variance of such a value is at most R mu):
  upper:  mu <= m + sqrt(2 R m L / n) + 4 R L / n     with probability >= 1 - p, L = ln(1/p).
    Listing 2 writes the last term as 4 L / n: that is the [0, 1] form, and it is too small by a
    factor R when R > 1, so the test would over-accept. We use 4 R L / n.
  lower:  from Bernstein's inequality P[m - mu >= t] <= exp(-n t^2 / (2 R mu + 2 R t / 3)):
    with probability >= 1 - p, m <= mu + sqrt(2 R mu L / n) + 2 R L / (3 n). Solving for
    x = sqrt(mu): mu >= x_-^2 where x_- = (-a + sqrt(a^2 + 4 c)) / 2, a = sqrt(2 R L / n),
    c = max(0, m - 2 R L / (3 n)).
The upper bound grows with m and shrinks with n; the lower bound grows with m and with n. So
plugging a DP upper estimate of m (sum corrected up, count corrected down) into the upper
bound, or a DP lower estimate of m with the count corrected down into the lower bound, keeps
each bound valid on the event that the corrections hold.

Guarantees (each with probability >= 1 - eta over the test set and the noise):
  loss:      ACCEPT only if E_D[loss] <= target;  REJECT only if E_D[loss] > target.
  accuracy:  the loss test on the error indicator (R = 1) with target 1 - target accuracy.
  sum statistic (mean of values in [lo, hi]): ACCEPT only if |released DP mean - E_D[value]|
    <= target_abs_error. The error is (a) the DP error, |S_dp/n_dp - S/n| = |X n - S Y| /
    (n n_dp) <= (t_S + R t_n) / n_dp when |X| <= t_S, |Y| <= t_n (X, Y the sum and count noise,
    S <= R n), plus (b) the sampling error, Hoeffding: R sqrt(ln(2/p) / (2 n)), at n >= n_min.
    More data always shrinks this bound, so the test never REJECTs: RETRY means "more data".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from dp_accounting import dp_event

from sage_tfx import mechanisms
from sage_tfx.choices import Choice


class Outcome(Choice):
    """What a SLAed test decides (module docstring)."""
    ACCEPT = "ACCEPT"
    REJECT = "REJECT"
    RETRY = "RETRY"


ACCEPT, REJECT, RETRY = Outcome.ACCEPT, Outcome.REJECT, Outcome.RETRY


class Metric(Choice):
    """What SLAedValidator tests: the expected loss (loss_validator, needs a loss bound B) or
    the expected accuracy (accuracy_validator)."""
    LOSS = "loss"
    ACCURACY = "accuracy"


@dataclass(frozen=True)
class ValidationResult:
    outcome: Outcome
    dp_estimate: float  # the DP metric: S_dp / n_dp (as a mean of the metric)
    lower_bound: Optional[float]  # on the population metric (None if the test had no bound)
    upper_bound: Optional[float]
    target: float
    epsilon: float
    confidence: float
    dp_count: float
    details: dict = field(default_factory=dict)


def laplace_tail(scale: float, probability: float, two_sided: bool = False) -> float:
    """t with P[Lap(scale) > t] = probability (or P[|Lap(scale)| > t] when two_sided)."""
    return scale * math.log((1.0 if two_sided else 0.5) / probability)


def bernstein_upper(mean: float, n: float, probability: float, value_range: float) -> float:
    """Upper confidence bound on the population mean of values in [0, value_range]."""
    if n <= 0:
        return math.inf
    log_term = math.log(1.0 / probability)
    mean = max(mean, 0.0)
    return (mean + math.sqrt(2.0 * value_range * mean * log_term / n)
            + 4.0 * value_range * log_term / n)


def bernstein_lower(mean: float, n: float, probability: float, value_range: float) -> float:
    """Lower confidence bound on the population mean of values in [0, value_range]."""
    if n <= 0:
        return 0.0
    log_term = math.log(1.0 / probability)
    slope = math.sqrt(2.0 * value_range * log_term / n)
    excess = max(0.0, mean - 2.0 * value_range * log_term / (3.0 * n))
    root = (-slope + math.sqrt(slope * slope + 4.0 * excess)) / 2.0
    return root * root


def failure_probability(confidence: float) -> float:
    """eta = (1 - confidence) / 2: the probability that an ACCEPT, or a REJECT, of a test at
    `confidence` is wrong (the module docstring's guarantees)."""
    if not (isinstance(confidence, (int, float)) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return (1.0 - confidence) / 2.0


def iteration_confidence(run_confidence: float, iteration: int) -> float:
    """The confidence of the test of iteration k (1, 2, ...) of a privacy-adaptive run whose
    decisions must hold at `run_confidence` over the WHOLE run, however many iterations it has:
        confidence_k = 1 - (1 - run_confidence) 6 / (pi^2 k^2).

    Why. Let eta = failure_probability(run_confidence). Test k is then wrong with probability
    at most eta_k = (1 - confidence_k) / 2 = eta 6 / (pi^2 k^2), and sum_k 1/k^2 = pi^2 / 6, so
    sum_k eta_k = eta. The run stops at its first ACCEPT or REJECT, and iteration k runs only
    if iterations 1..k-1 all said RETRY. Picture the run continued to every k: iteration k
    would have a fixed window and epsilon (the policy's k-th, a function of k and of public
    ledger state, since RETRY is the only way to reach it) and a model m_k trained on the
    window's train split with fresh noise, so m_k is independent of the test split, whose
    records are i.i.d. draws of the data distribution (validators/slaed.py's setting). Let E_k
    be the event that test k's confidence bounds fail for m_k: P[E_k] <= eta_k, without
    conditioning on the earlier outcomes (windows may share blocks; the union bound needs no
    independence). A wrong decision of the run (an ACCEPT of a model that misses the target,
    or a REJECT of one that meets it) at iteration k implies E_k, so
        P[the run's decision is wrong] <= P[union_k E_k] <= sum_k eta_k = eta,
    the guarantee one test at `run_confidence` gives, now for the whole run. With the same
    confidence at every test (Sage's per-test guarantee), the bound grows as k eta.
    A test of iteration k costs only its confidence: its bounds widen by a term in
    log(k^2 pi^2 / 6) (Laplace tails and Bernstein's L)."""
    eta = failure_probability(run_confidence)
    if not (isinstance(iteration, int) and not isinstance(iteration, bool) and iteration >= 1):
        raise ValueError(f"the iteration must be an integer >= 1, got {iteration!r}")
    return 1.0 - 2.0 * eta * 6.0 / (math.pi ** 2 * iteration ** 2)


def _check_common(epsilon: float, confidence: float) -> float:
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a positive number, got {epsilon!r}")
    return failure_probability(confidence)


def _as_vector(values) -> np.ndarray:
    """The values as a flat float vector. Empty is a dataset of size 0, not an error: the
    release is then noise only (dp_count near 0, handled below), and refusing it after the
    charge would tell 0 records from 1."""
    return np.asarray(values, dtype=np.float64).reshape(-1)


@dataclass(frozen=True)
class DPMeanRelease:
    """The two Laplace releases every validator makes: count and clipped sum (values in
    [0, value_range]), by mechanisms.laplace_count_and_sum; `event` is what ran."""
    dp_count: float
    dp_sum: float
    value_range: float
    epsilon: float
    event: Optional[dp_event.DpEvent] = None

    @classmethod
    def of(cls, clipped: np.ndarray, value_range: float, epsilon: float) -> "DPMeanRelease":
        return cls.of_sum(clipped.size, float(clipped.sum()), value_range, epsilon)

    @classmethod
    def of_sum(cls, count: int, total: float, value_range: float,
               epsilon: float) -> "DPMeanRelease":
        """The releases of a count and of a sum that one record moves by at most value_range
        (adding a record moves the count by 1 and the sum within [0, value_range])."""
        release = mechanisms.laplace_count_and_sum(
            np.array([count], dtype=np.float64), np.array([total]),
            value_bound=value_range, epsilon=epsilon)
        (dp_count,), (dp_sum,) = release.value
        return cls(float(dp_count), float(dp_sum), value_range, epsilon, release.event)

    @property
    def count_scale(self) -> float:
        return 2.0 / self.epsilon

    @property
    def sum_scale(self) -> float:
        return 2.0 * self.value_range / self.epsilon

    @property
    def dp_mean(self) -> float:
        """S_dp / n_dp, kept in [0, value_range] (post-processing): with few records the noisy
        count can be at most 0, and a released metric must stay a finite number."""
        return min(max(self.dp_sum / max(self.dp_count, 1.0), 0.0), self.value_range)


def mean_upper_bound(release: DPMeanRelease, eta: float) -> float:
    """Accept side: with probability >= 1 - eta, >= the population mean (Listing 2, corrected)."""
    count_low = release.dp_count - laplace_tail(release.count_scale, eta / 3.0)
    sum_high = release.dp_sum + laplace_tail(release.sum_scale, eta / 3.0)
    if count_low <= 0:
        return math.inf
    return bernstein_upper(sum_high / count_low, count_low, eta / 3.0, release.value_range)


def mean_lower_bound(release: DPMeanRelease, eta: float) -> float:
    """Reject side: with probability >= 1 - eta, <= the population mean."""
    count_slack = laplace_tail(release.count_scale, eta / 3.0, two_sided=True)
    count_low, count_high = release.dp_count - count_slack, release.dp_count + count_slack
    sum_low = release.dp_sum - laplace_tail(release.sum_scale, eta / 3.0)
    if count_low <= 0:
        return 0.0
    return bernstein_lower(max(sum_low, 0.0) / count_high, count_low, eta / 3.0,
                           release.value_range)


def loss_decision(release: DPMeanRelease, target: float, eta: float
                  ) -> tuple[Outcome, float, float]:
    """(outcome, lower, upper) of the loss test on `release`: ACCEPT if the upper bound on the
    population mean is <= target, REJECT if the lower bound exceeds it, else RETRY; each bound
    fails with probability at most eta."""
    upper, lower = mean_upper_bound(release, eta), mean_lower_bound(release, eta)
    return (ACCEPT if upper <= target else REJECT if lower > target else RETRY), lower, upper


def _check_target(target: float, low: float, high: float, name: str) -> None:
    if not (isinstance(target, (int, float)) and low <= target <= high and math.isfinite(target)):
        raise ValueError(f"target {target!r} is outside the {name} range [{low}, {high}]")


def loss_validator(per_example_losses, target: float, epsilon: float, confidence: float = 0.95,
                   loss_bound: float = 1.0) -> ValidationResult:
    """ACCEPT only if the expected loss is <= target, REJECT only if it is > target, each with
    probability >= 1 - (1 - confidence) / 2. Losses are clipped to [0, loss_bound]; NaN or
    infinite losses (bad predictions) count as loss_bound."""
    eta = _check_common(epsilon, confidence)
    if not (isinstance(loss_bound, (int, float)) and math.isfinite(loss_bound) and loss_bound > 0):
        raise ValueError(f"loss_bound B must be a positive number, got {loss_bound!r}")
    _check_target(target, 0.0, loss_bound, Metric.LOSS)
    losses = _as_vector(per_example_losses)
    clipped = np.clip(np.where(np.isfinite(losses), losses, loss_bound), 0.0, loss_bound)
    release = DPMeanRelease.of(clipped, loss_bound, epsilon)
    outcome, lower, upper = loss_decision(release, target, eta)
    return ValidationResult(outcome, release.dp_mean, lower, upper, target, epsilon, confidence,
                            release.dp_count, {"loss_bound": loss_bound, "eta": eta})


def accuracy_validator(correct, target: float, epsilon: float, confidence: float = 0.95
                       ) -> ValidationResult:
    """ACCEPT only if the expected accuracy is >= target, REJECT only if it is < target, each
    with probability >= 1 - (1 - confidence) / 2: the loss test on the error indicator."""
    _check_target(target, 0.0, 1.0, Metric.ACCURACY)
    correct = _as_vector(correct)
    errors = np.where(np.isfinite(correct), 1.0 - np.clip(correct, 0.0, 1.0), 1.0)
    result = loss_validator(errors, 1.0 - target, epsilon, confidence, 1.0)
    # An error rate strictly above 1 - target is an accuracy strictly below target.
    return ValidationResult(result.outcome, 1.0 - result.dp_estimate, 1.0 - result.upper_bound,
                            1.0 - result.lower_bound, target, epsilon, confidence,
                            result.dp_count, result.details)


def sum_statistic_validator(values, target_abs_error: float, epsilon: float,
                            confidence: float = 0.95, value_range: tuple[float, float] = (0.0, 1.0)
                            ) -> ValidationResult:
    """Releases the DP mean of `values` (clipped to value_range) and ACCEPTs only if its
    absolute error against the population mean is <= target_abs_error, with probability
    >= 1 - (1 - confidence) / 2; otherwise RETRY (module docstring). For a variance, pass the
    squared deviations from a public centre; for a proportion (a count over n), 0/1 values.
    The released estimate is clamped into value_range, which only moves it towards the
    population mean, so the bound still holds."""
    eta = _check_common(epsilon, confidence)
    low, high = (float(v) for v in value_range)
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"value_range must be finite with low < high, got {value_range!r}")
    width = high - low
    _check_target(target_abs_error, 0.0, width, "absolute error")
    values = _as_vector(values)
    # A non-finite value counts as the range's midpoint (mechanisms.bounded, as in the DP
    # analyzers): whether the test runs must not depend on one value.
    release = DPMeanRelease.of(mechanisms.bounded(values, low, high) - low, width, epsilon)
    sum_slack = laplace_tail(release.sum_scale, eta / 3.0, two_sided=True)
    count_slack = laplace_tail(release.count_scale, eta / 3.0, two_sided=True)
    count_low = release.dp_count - count_slack
    if count_low <= 0:
        error_bound = math.inf
    else:
        dp_error = (sum_slack + width * count_slack) / release.dp_count
        sampling_error = width * math.sqrt(math.log(2.0 / (eta / 3.0)) / (2.0 * count_low))
        error_bound = dp_error + sampling_error
    estimate = low + release.dp_mean  # already in [0, width]
    outcome = ACCEPT if error_bound <= target_abs_error else RETRY
    return ValidationResult(outcome, estimate, estimate - error_bound, estimate + error_bound,
                            target_abs_error, epsilon, confidence, release.dp_count,
                            {"error_bound": error_bound, "value_range": (low, high), "eta": eta})


def _bounded_losses(losses, loss_bound: float) -> np.ndarray:
    """Losses clipped to [0, B], a NaN or infinite one counted as B (a bad prediction)."""
    losses = np.asarray(losses, dtype=np.float64)
    return np.clip(np.where(np.isfinite(losses), losses, loss_bound), 0.0, loss_bound)


def baseline_gap_sum(model: np.ndarray, baselines: np.ndarray, loss_bound: float) -> float:
    """S = min_c sum_i l_c(i) - sum_i l_model(i) + n B of bounded losses (baseline_gap_validator):
    adding a record moves it by [0, 2B]."""
    return float(baselines.sum(axis=0).min()) - float(model.sum()) + len(model) * loss_bound


def baseline_gap_validator(model_losses, baseline_losses, margin: float, epsilon: float,
                           confidence: float = 0.95, loss_bound: float = 1.0
                           ) -> ValidationResult:
    """ACCEPT only if the model's expected loss is below every baseline's by more than
    `margin`, with probability >= 1 - (1 - confidence) / 2; otherwise RETRY (never REJECT).

    `model_losses` (n,) are the model's per-example losses and `baseline_losses` (n, k) those of
    k public baselines on the same examples: each constant prediction of a public candidate set
    (every class: the majority class is one of them; a grid of constants for a regression), and
    a previously blessed model. Losses are clipped to [0, B], a NaN counts as B; for accuracy,
    the error indicator with B = 1. The gap is g = min_c L_c - L_model (population losses).

    The statistic. D = min_c sum_i l_c(i) - sum_i l_model(i): adding a record moves each sum by
    [0, B], so their minimum by [0, B] and D by [-B, B]; S = D + n B moves by [0, 2B]. S and the
    count are released as one DPMeanRelease of range 2B (sensitivity 2B, Laplace, epsilon), and
    nothing else about the baselines leaves: which candidate is the best is never released.
    The bound. For c* the population's best baseline, T = sum_i (l_c*(i) - l_model(i) + B) is a
    sum of n i.i.d. values in [0, 2B] with mean g + B, and S <= T (the minimum is at most the
    sum at c*). mean_lower_bound is increasing in the sum, so on the events that the Laplace
    corrections and Bernstein's lower bound hold for T (probability >= 1 - eta), the bound
    computed from S is <= the one from T <= g + B. ACCEPT when that bound minus B exceeds
    `margin`. The empirical minimum is biased low (E min <= min E), so S cannot bound g from
    above: the test never REJECTs, and a model that does not beat its baselines stays at RETRY.
    """
    eta = _check_common(epsilon, confidence)
    if not (isinstance(loss_bound, (int, float)) and math.isfinite(loss_bound) and loss_bound > 0):
        raise ValueError(f"loss_bound B must be a positive number, got {loss_bound!r}")
    if not (isinstance(margin, (int, float)) and 0.0 <= margin < loss_bound):
        raise ValueError(f"the baseline margin must be in [0, B={loss_bound}), got {margin!r}")
    model = _bounded_losses(_as_vector(model_losses), loss_bound)
    baselines = _bounded_losses(np.asarray(baseline_losses, dtype=np.float64).reshape(
        len(model), -1), loss_bound)
    if baselines.shape[1] == 0:
        raise ValueError("the baseline test needs at least one baseline")
    release = DPMeanRelease.of_sum(len(model), baseline_gap_sum(model, baselines, loss_bound),
                                   2.0 * loss_bound, epsilon)
    lower = mean_lower_bound(release, eta) - loss_bound
    outcome = ACCEPT if lower > margin else RETRY
    return ValidationResult(outcome, release.dp_mean - loss_bound, lower, None, margin, epsilon,
                            confidence, release.dp_count,
                            {"loss_bound": loss_bound, "eta": eta,
                             "baselines": baselines.shape[1]})
