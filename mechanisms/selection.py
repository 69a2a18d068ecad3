"""Partition selection: which partitions (GROUP BY keys) a DP release may show at all.

The setting (issue 18, DP SQL §4.2.3). ``unit_counts[i]`` is the number of distinct privacy units
(users) in partition i, after contribution bounding: each unit counts at most once in a
partition and appears in at most ``C = max_partitions_per_unit`` partitions. Adding or removing
one unit changes at most C counts, each by 1; some of those partitions may exist only because of
that unit (count 1). Those must not show up except with a small probability delta: that is the
job of the selection, and the reason it costs a delta that no additive-noise event describes.

The weighted Gaussian (Gopi et al. 2020) reads, instead of counts, each partition's sum of unit
weights: a unit in k <= C kept partitions gives each 1 / sqrt(k), so its whole weight vector has
L2 norm 1 and its own partitions weigh 1 / sqrt(k) each (:func:`weighted_gaussian_selection`).

Each function returns a :class:`Release` whose value is a :class:`Selection` (a keep mask over
the input partitions, and for the thresholding rules the noisy unit counts of the kept ones).
The caller may publish the keys where ``keep`` is True and nothing about the others; everything
it publishes must be computed from the Selection, not from ``unit_counts``.

Why ``(event, additional_delta)`` is a sound description (the Release contract)
--------------------------------------------------------------------------------
Thresholding (Laplace, Gaussian). Split the partitions of the larger dataset D' into those that
exist in D and the <= C new ones, which hold only the added unit (count 1). The noise is
independent per partition, so the output is the pair (output on the old partitions, output on
the new ones). The first is a post-processing (threshold) of additive noise whose change is
described exactly by ``event``; the second is "nothing" under D and "nothing" with probability
>= 1 - additional_delta under D', i.e. (0, additional_delta)-DP in both directions. Basic
composition of independent parts adds the deltas at every epsilon, so the release is
(eps, delta_event(eps) + additional_delta) for all eps, and so is any composition with it.

Truncated geometric (keep with a probability that depends only on the count). For one partition
the keep bit under counts (n - 1, n) is an (eps, delta)-DP pair of Bernoullis, hence (Kairouz,
Oh & Viswanath 2015) a post-processing of the canonical pair "with probability delta reveal
which dataset it is, otherwise eps-randomized response". By joint convexity of the hockey-stick
divergence the mixture costs the randomized response's profile + delta in any composition. The
privacy loss of eps-randomized response is +-eps, exactly that of the discrete Laplace mechanism
with parameter eps at sensitivity 1 (P_0(z) / P_1(z) = e^eps for z <= 0 and e^-eps for z >= 1),
which dp_accounting supports under add-or-remove (its RandomizedResponseDpEvent is
replace-one only). With C partitions per unit each partition runs at (eps / C, delta / C) and
the event is the C-fold composition.

Floating point. Noise is OpenDP's exact samplers (package docstring), except the weighted
Gaussian's, which releases keep bits only (:func:`weighted_gaussian_selection` says why). Keep coins are drawn by
OpenDP's exact Bernoulli (``make_randomized_response_bitvec`` flips each bit with probability
exactly f / 2 for the double f), and the keep probabilities it realises are checked against
the DP constraints in exact rational arithmetic before any coin is drawn.

OpenDP's own ``make_laplace_threshold`` / ``make_gaussian_threshold`` are not used: in 0.16.0
their privacy maps omit the mass at the threshold (they keep noisy >= threshold but bound
P[noise > threshold - 1]; opendp/opendp#2922). Reproduced here: scale 1, threshold 3, count 1:
map delta 0.036, measured keep rate 0.098 over 50,000 partitions.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from fractions import Fraction
from typing import Optional

import numpy as np
from dp_accounting import dp_event
from opendp import domains, measurements, metrics  # not the prelude: additive.py says why
from opendp.mod import enable_features

from sage_tfx.mechanisms.additive import (_delta, _integers, _positive, discrete_laplace,
                                          gaussian_lattice, gaussian_sigma,
                                          gaussian_with_noise_multiplier)
from sage_tfx.mechanisms.keyed import KeyedGaussian
from sage_tfx.mechanisms.release import Release

enable_features("contrib")


@dataclasses.dataclass(frozen=True)
class Selection:
    """``keep[i]``: partition i may be released. ``noisy_unit_counts``: the noisy counts of the
    kept partitions, in input order (None for the truncated geometric, which draws no count)."""
    keep: np.ndarray
    noisy_unit_counts: Optional[np.ndarray] = None


def _unit_counts(unit_counts, rule: str) -> np.ndarray:
    counts = _integers(unit_counts, rule)
    if counts.ndim != 1 or np.any(counts < 0):
        raise ValueError(f"{rule}: unit_counts must be a 1-D array of counts >= 0")
    return counts


def _partitions_per_unit(max_partitions_per_unit) -> int:
    if int(max_partitions_per_unit) != max_partitions_per_unit or max_partitions_per_unit < 1:
        raise ValueError("max_partitions_per_unit must be a positive integer, got "
                         f"{max_partitions_per_unit!r}")
    return int(max_partitions_per_unit)


def per_partition_delta(delta: float, max_partitions_per_unit: int) -> float:
    """delta_1 = 1 - (1 - delta)^(1/C): if each of a unit's C partitions of its own is kept
    independently with probability <= delta_1, at least one is kept with probability <= delta."""
    return -math.expm1(math.log1p(-delta) / max_partitions_per_unit)


# --- Laplace thresholding --------------------------------------------------------------------

def laplace_threshold_tau(*, max_partitions_per_unit: int, epsilon: float, delta: float) -> int:
    """The integer tau of :func:`laplace_threshold`.

    DP SQL §4.2.3 (Wilson et al. 2020), reconstructed: each of the C counts gets Laplace noise of
    scale C / eps (the vector of counts has L1 sensitivity C). A partition holding one unit is
    kept when 1 + noise >= tau, with probability p = exp(-(tau - 1) eps / C) / 2; the unit's C
    partitions are independent, so some is kept with probability 1 - (1 - p)^C <= delta iff
        tau >= 1 - (C / eps) ln(2 - 2 (1 - delta)^(1/C))           (the paper's threshold).
    Counts are integers, so we add the discrete Laplace P(z) = tanh(a/2) e^(-a|z|), a = eps / C
    (exact, no lattice): P(Z >= m) = e^(-a m) / (1 + e^(-a)) for m >= 1, and the condition
    becomes e^(-a (tau - 1)) / (1 + e^(-a)) <= delta_1 = 1 - (1 - delta)^(1/C):
        tau = 1 + ceil(ln(1 / ((1 + e^(-a)) delta_1)) / a),
    never above the paper's tau rounded up, since 1 + e^(-a) < 2."""
    partitions = _partitions_per_unit(max_partitions_per_unit)
    a = _positive("epsilon", epsilon) / partitions
    delta_1 = per_partition_delta(_delta(delta), partitions)

    def single_unit_keep(tau: int) -> float:
        return math.exp(-a * (tau - 1)) / (1.0 + math.exp(-a))

    tau = 1 + max(1, math.ceil(math.log(1.0 / ((1.0 + math.exp(-a)) * delta_1)) / a))
    while single_unit_keep(tau) > delta_1:  # a ceil that floating point put one short
        tau += 1
    return tau


def laplace_threshold(unit_counts, *, max_partitions_per_unit: int, epsilon: float,
                      delta: float) -> Release:
    """Keep partition i when unit_counts[i] + Z_i >= tau, Z_i discrete Laplace of scale C / eps
    (tau from :func:`laplace_threshold_tau`). Value: Selection(keep, kept noisy counts). Event:
    DiscreteLaplaceDpEvent(eps / C, sensitivity C), eps-DP; additional_delta: delta."""
    counts = _unit_counts(unit_counts, "laplace_threshold")
    partitions = _partitions_per_unit(max_partitions_per_unit)
    tau = laplace_threshold_tau(max_partitions_per_unit=partitions, epsilon=epsilon, delta=delta)
    noisy = discrete_laplace(counts, l1_sensitivity=partitions, epsilon=epsilon)
    keep = noisy.value >= tau
    return Release(Selection(keep, noisy.value[keep]), noisy.event, additional_delta=delta)


# --- Gaussian thresholding -------------------------------------------------------------------

def gaussian_threshold_tau(*, sigma: float, lattice_exponent: int, max_partitions_per_unit: int,
                           threshold_delta: float) -> float:
    """The tau of :func:`gaussian_threshold`: 1 + 2**k + sigma * Phi^-1(1 - delta_1).

    A unit's partition of its own (count 1) is kept when 1 + noise > tau. OpenDP's noise is
    h * Z, h = 2**k, Z discrete Gaussian with parameter s = sigma / h. Its tail is at most the
    continuous one a lattice step earlier: for m >= 1, sum_{z >= m} e^(-z^2 / 2s^2) <=
    integral_{m-1}^inf e^(-x^2 / 2s^2) dx (the summand decreases), and the normaliser
    sum_z e^(-z^2 / 2s^2) >= s sqrt(2 pi) (Poisson summation: s sqrt(2 pi) sum_j e^(-2 pi^2 s^2
    j^2), all terms positive). So P(hZ >= t) <= 1 - Phi((t - h) / sigma), and the keep
    probability is <= 1 - Phi((tau - 1 - h) / sigma) = delta_1 at this tau; with C independent
    partitions, some is kept with probability <= 1 - (1 - delta_1)^C = threshold_delta."""
    delta_1 = per_partition_delta(_delta(threshold_delta),
                                  _partitions_per_unit(max_partitions_per_unit))
    return 1.0 + 2.0 ** lattice_exponent + _positive("sigma", sigma) * -statistics.NormalDist().inv_cdf(delta_1)


def _gaussian_threshold_calibration(partitions: int, epsilon: float, delta: float,
                                    size: int) -> tuple[float, float]:
    """(noise multiplier, tau) of :func:`gaussian_threshold` on ``size`` partitions."""
    multiplier = gaussian_sigma(l2_sensitivity=1.0, epsilon=epsilon, delta=delta / 2.0)
    sigma, k = gaussian_lattice(l2_sensitivity=math.sqrt(partitions), size=size,
                                noise_multiplier=multiplier)
    return multiplier, gaussian_threshold_tau(sigma=sigma, lattice_exponent=k,
                                              max_partitions_per_unit=partitions,
                                              threshold_delta=delta / 2.0)


def gaussian_threshold(unit_counts, *, max_partitions_per_unit: int, epsilon: float,
                       delta: float) -> Release:
    """Keep partition i when unit_counts[i] + N(0, sigma^2) > tau. The counts vector has L2
    sensitivity sqrt(C); delta is split in half: sigma is the analytic Gaussian's for
    (eps, delta / 2) at that sensitivity, and tau (:func:`gaussian_threshold_tau`) keeps a
    unit's own partitions with probability <= delta / 2. Value: Selection(keep, kept noisy
    counts). Event: GaussianDpEvent(noise multiplier); additional_delta: delta / 2."""
    counts = _unit_counts(unit_counts, "gaussian_threshold")
    partitions = _partitions_per_unit(max_partitions_per_unit)
    delta = _delta(delta)
    multiplier, tau = _gaussian_threshold_calibration(partitions, epsilon, delta, counts.size)
    noisy = gaussian_with_noise_multiplier(counts.astype(np.float64),
                                           l2_sensitivity=math.sqrt(partitions),
                                           noise_multiplier=multiplier)
    # A double above tau came from a lattice value above tau (rounding is monotone), so the
    # bound on the lattice tail covers this comparison.
    keep = noisy.value > tau
    return Release(Selection(keep, noisy.value[keep]), noisy.event, additional_delta=delta / 2.0)


# --- Truncated geometric (Desfontaines, Voss, Gipson & Mandayam 2022) ------------------------

# The keep probabilities are designed for delta * (1 - 2**-10) so that their rounding to doubles
# stays inside delta; the exact check below verifies it.
_DELTA_MARGIN = 2.0 ** -10


def truncated_geometric_keep_probability(unit_counts, *, epsilon: float,
                                         delta: float) -> np.ndarray:
    """pi(n), the largest keep probability that is (eps, delta)-DP between counts n - 1 and n
    (DVGM 2022, Theorem 1): pi(0) = 0 and
        pi(n) = min(e^eps pi(n-1) + delta, 1 - e^-eps (1 - delta - pi(n-1)), 1).
    The first branch is the smaller while pi(n-1) <= (1 - delta) / (1 + e^eps), which gives
        pi(n) = delta (e^(n eps) - 1) / (e^eps - 1)                    for n <= n1,
        n1 = 1 + floor(ln((e^eps + 2 delta - 1) / ((e^eps + 1) delta)) / eps),
    then 1 - pi follows q(n) = e^-eps (q(n-1) - delta), whose fixed point is -c, c = delta /
    (e^eps - 1):  1 - pi(n) = e^(-(n - n1) eps) (1 - pi(n1) + c) - c, clipped at 0."""
    epsilon = _positive("epsilon", epsilon)
    delta = _delta(delta)
    n = np.asarray(unit_counts, dtype=np.float64)
    n1 = 1 + math.floor(math.log((math.exp(epsilon) + 2 * delta - 1)
                                 / ((math.exp(epsilon) + 1) * delta)) / epsilon)
    c = delta / math.expm1(epsilon)
    p_n1 = c * math.expm1(n1 * epsilon)
    rising = c * np.expm1(np.minimum(n, n1) * epsilon)
    settling = 1.0 - (np.exp(-(np.maximum(n, n1) - n1) * epsilon) * (1.0 - p_n1 + c) - c)
    return np.clip(np.where(n <= n1, rising, settling), 0.0, 1.0)


def _checked_keep_probabilities(epsilon: float, delta: Fraction,
                                design_delta: float) -> np.ndarray:
    """The doubles pi(1..N) designed at ``design_delta``, N the first count kept surely
    (pi(N) = 1), after verifying in exact rational arithmetic that they meet both DP constraints
    at ``delta``. The coins are drawn with exactly these doubles."""
    e_eps_low = Fraction(math.exp(epsilon)) * (1 - Fraction(1, 2 ** 50))  # <= e^eps
    size = 64
    while True:
        probabilities = truncated_geometric_keep_probability(
            np.arange(1, size + 1), epsilon=epsilon, delta=design_delta)
        if probabilities[-1] == 1.0:
            break
        size *= 2
    probabilities = probabilities[:int(np.argmax(probabilities == 1.0)) + 1]
    previous = Fraction(0)
    for probability in probabilities.tolist():
        current = Fraction(probability)
        if (current > e_eps_low * previous + delta
                or 1 - previous > e_eps_low * (1 - current) + delta):
            raise ValueError(f"truncated geometric: delta {float(delta)!r} per partition is too "
                             "small for keep probabilities in double precision")
        previous = current
    return probabilities


def _exact_bernoulli(probability: float, size: int) -> np.ndarray:
    """``size`` independent Bernoulli(probability) bits from OpenDP's exact sampler. It flips
    each bit with probability exactly f / 2: zeros with f = 2p give Bernoulli(p) for p <= 1/2;
    ones with f = 2 (1 - p) (exact for p >= 1/2, Sterbenz) give Bernoulli(p) above."""
    ones = probability > 0.5
    flip = 2.0 * (1.0 - probability if ones else probability)
    measurement = measurements.make_randomized_response_bitvec(
        domains.bitvector_domain(max_weight=size), metrics.discrete_distance(), f=flip)
    bits = np.full(size, ones, dtype=bool)
    noisy = np.frombuffer(measurement(np.packbits(bits).tobytes()), dtype=np.uint8)
    return np.unpackbits(noisy)[:size].astype(bool)


def _truncated_geometric_calibration(partitions: int, epsilon: float,
                                     delta: float) -> tuple[float, np.ndarray]:
    """(eps / C, the checked keep probabilities pi(1..N)) of
    :func:`truncated_geometric_selection`: what its coins are drawn with."""
    epsilon_1 = _positive("epsilon", epsilon) / partitions
    delta_1 = Fraction(_delta(delta)) / partitions
    design_delta = float(delta_1) * (1.0 - _DELTA_MARGIN)
    return epsilon_1, _checked_keep_probabilities(epsilon_1, delta_1, design_delta)


def truncated_geometric_selection(unit_counts, *, max_partitions_per_unit: int, epsilon: float,
                                  delta: float) -> Release:
    """Keep partition i with probability pi(unit_counts[i]) at (eps / C, delta / C) (basic
    composition over a unit's C partitions: each changes by one unit). Value: Selection(keep).
    Event: C-fold DiscreteLaplaceDpEvent(eps / C, sensitivity 1), the randomized response that
    dominates each keep bit (module docstring); additional_delta: delta."""
    counts = _unit_counts(unit_counts, "truncated_geometric_selection")
    partitions = _partitions_per_unit(max_partitions_per_unit)
    epsilon_1, probabilities = _truncated_geometric_calibration(partitions, epsilon, delta)
    keep = counts >= probabilities.size  # pi(n) = 1 from n = N on
    for count in np.unique(counts[(counts > 0) & (counts < probabilities.size)]):
        where = np.flatnonzero(counts == count)
        keep[where] = _exact_bernoulli(float(probabilities[count - 1]), where.size)
    event = dp_event.DiscreteLaplaceDpEvent(noise_parameter=epsilon_1, sensitivity=1)
    if partitions > 1:
        event = dp_event.SelfComposedDpEvent(event, partitions)
    return Release(Selection(keep), event, additional_delta=float(delta))


# --- Weighted Gaussian (Gopi, Gulhane, Kulkarni, Shen, Shokouhi & Yekhanin 2020) --------------

def unit_weight(partitions_of_unit) -> np.ndarray:
    """The weight a unit gives each of its k kept partitions: 1 / sqrt(k), so that its weight
    vector has L2 norm exactly 1 however many partitions it is in (Gopi et al.'s uniform
    policy). A count gives each partition 1, an L2 norm of sqrt(k) <= sqrt(C): a unit in one
    partition then carries sqrt(C) times more weight here than a count lets it."""
    partitions = np.asarray(partitions_of_unit, dtype=np.float64)
    if np.any(partitions < 1):
        raise ValueError("a unit's number of kept partitions must be >= 1")
    return 1.0 / np.sqrt(partitions)


def weighted_gaussian_tau(*, sigma: float, max_partitions_per_unit: int,
                          threshold_delta: float) -> float:
    """The tau of :func:`weighted_gaussian_selection`:
        tau = max over t = 1..C of (1 / sqrt(t) + sigma Phi^-1((1 - threshold_delta)^(1/t)))
    (Gopi et al.'s threshold).

    Why. A unit in k <= C partitions has t <= k partitions that exist only because of it, each
    of weight 1 / sqrt(k) <= 1 / sqrt(t). Each of the t is kept (weight + N(0, sigma^2) > tau)
    with probability at most p_t = 1 - Phi((tau - 1 / sqrt(t)) / sigma), independently, so
    some is kept with probability 1 - (1 - p_t)^t <= threshold_delta at this tau, for every
    t <= C. Phi^-1(1 - p) is computed as -Phi^-1(p) with p = per_partition_delta (log1p and
    expm1): (1 - threshold_delta)^(1/t) rounds to the double next to 1 at small delta, which
    gave a tau whose tail was 2% above its claim at delta 1e-14 and no tau below 1e-15."""
    sigma = _positive("sigma", sigma)
    threshold_delta = _delta(threshold_delta)
    normal = statistics.NormalDist()
    return max(
        1.0 / math.sqrt(t) - sigma * normal.inv_cdf(per_partition_delta(threshold_delta, t))
        for t in range(1, _partitions_per_unit(max_partitions_per_unit) + 1))


def _weighted_gaussian_calibration(partitions: int, epsilon: float,
                                   delta: float) -> tuple[float, float]:
    """(sigma, tau) of :func:`weighted_gaussian_selection`."""
    sigma = gaussian_sigma(l2_sensitivity=1.0, epsilon=epsilon, delta=delta / 2.0)
    return sigma, weighted_gaussian_tau(sigma=sigma, max_partitions_per_unit=partitions,
                                        threshold_delta=delta / 2.0)


# The sampler's error on one partition's keep bit (weighted_gaussian_selection's docstring): its
# 52-bit uniforms on a 2^-51 grid, the rounding of the polar transform, of the weights' sum and
# of the comparison, and the tail beyond the polar method's largest normal (1e-32).
WEIGHTED_GAUSSIAN_ETA = 2.0 ** -49


def weighted_gaussian_rounding_delta(*, release_epsilon: float,
                                     max_partitions_per_unit: int) -> float:
    """The delta that :func:`weighted_gaussian_selection`'s floating-point sampler adds to a
    release that is (release_epsilon, delta)-DP by the exact analysis:
    (1 + e^release_epsilon) C eta, C = ``max_partitions_per_unit``, eta = 2^-49.

    Derivation (coupling). Run the exact Gaussian and this sampler on the same randomness: only
    a partition whose keep bit the sampler gets wrong differs, each with probability <= eta; the
    other partitions have the same law under D and D', so on neighbours the keep bits that can
    differ are a unit's own C partitions: TV(real(D), exact(D)) <= C eta for the whole release
    (everything else it releases is drawn apart, from the keep bits only). For any set S,
    P_real(D)[S] <= P_exact(D)[S] + C eta <= e^eps P_exact(D')[S] + delta + C eta
    <= e^eps P_real(D')[S] + delta + (1 + e^eps) C eta, eps being the epsilon the whole release
    is stated at (the grant's). The plan charges it as additional delta (dp_statistics/
    aggregation/budget.py)."""
    partitions = _partitions_per_unit(max_partitions_per_unit)
    return (1.0 + math.exp(_positive("release_epsilon", release_epsilon))) * partitions \
        * WEIGHTED_GAUSSIAN_ETA


def weighted_gaussian_selection(partition_weights, *, max_partitions_per_unit: int,
                                epsilon: float, delta: float) -> Release:
    """Keep partition i when W_i + N(0, sigma^2) > tau, where W_i = sum of
    :func:`unit_weight` over the units in partition i, each unit in at most C =
    ``max_partitions_per_unit`` partitions (the caller bounds contributions first; the weights
    are a function of the unit's own kept partitions only).

    Sensitivity: adding or removing one unit changes W by its own weight vector, 1 / sqrt(k) on
    its k partitions and nothing elsewhere (no other unit's weight depends on it): L2 norm 1,
    against sqrt(C) for the counts of :func:`gaussian_threshold`, so the same noise buys
    sqrt(C / k) times more signal per unit. delta is split in half as there: sigma is the
    analytic Gaussian's for (epsilon, delta / 2) at sensitivity 1, and tau
    (:func:`weighted_gaussian_tau`) keeps a unit's own partitions with probability <= delta / 2.
    The pair (event, additional_delta) is sound by the module docstring's argument: on the
    partitions of D the output is a threshold of the Gaussian mechanism, on the new ones it is
    "nothing" except with probability delta / 2. Value: Selection(keep) (the noisy weights are
    not counts and are not published). Event: GaussianDpEvent(sigma); additional_delta:
    delta / 2.

    Noise: continuous N(0, sigma^2) from sage_tfx.mechanisms.keyed (AES under a fresh key from
    the OS CSPRNG, used for this call only and never stored; Marsaglia's polar method), not
    OpenDP's exact lattice sampler, which costs ~35 us per partition (0.6 s of a 10^6-row
    query's 2 s, for 17,000 partitions; AES: 3 ms). This is the one place outside
    mechanisms/additive.py where the aggregation draws noise, and it is sound because of what
    leaves:

    * Only keep bits. The noisy weights W + sigma N are compared with tau here and dropped:
      the Selection carries ``keep`` and no noisy value (``noisy_unit_counts`` None). Every
      value the DP SQL operator releases for a kept partition is drawn afterwards, apart, by
      the OpenDP-based mechanisms (aggregators._noisy -> mechanisms.laplace / gaussian on the
      partition's accumulators); COUNT(DISTINCT unit) is post-processed from the selection
      only under the thresholding rules, whose counts are OpenDP's (budget.derived_from:
      under this rule it is a step of its own); the nothing-released message states the
      plan's public tau, never a weight. So a function of these normals reaches the output
      only as the set of partitions kept.
    * A keep bit has no low-order bits. Mironov's attack (2012) reads the set of doubles a
      released noisy value can take, which depends on the input; here the output is the
      event {sigma N > tau - W}, whose probability is the exact Gaussian tail
      1 - Phi((tau - W) / sigma) up to the sampler's error on a tail event (its 52-bit
      uniforms on a 2^-51 grid, the rounding of the polar transform, of W's sum and of the
      comparison): an additive eta of the order of 2^-49 per partition, and a tail beyond
      the polar method's largest normal (~12 sigma) of 1e-32. Coupled with the exact
      mechanism, a unit's C own partitions differ with probability <= C eta (the others have
      the same law on both sides), so a release that is (epsilon, delta)-DP by the exact
      analysis is (epsilon, delta + (1 + e^epsilon) C eta)-DP, epsilon the whole release's:
      about 1.5e-13 at the defaults (C = 4) up to epsilon 3, 4e-8 at C = 2^10 and epsilon 10,
      3.9e-6 at C = 100,000 and epsilon 10 (:func:`weighted_gaussian_rounding_delta`). This
      function cannot know the release's epsilon: the DP SQL plan charges that delta out of
      the selection's share, as additional delta, and refuses a query where it would take half
      the share or more (dp_statistics/aggregation/budget.py). (keyed.py makes the same
      argument for the streaming operator's thresholds.) An additive value drawn from these
      normals would not be covered by it.
    """
    weights = np.asarray(partition_weights, dtype=np.float64)
    if weights.ndim != 1 or not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError("weighted_gaussian_selection: partition_weights must be a 1-D array of "
                         "finite weights >= 0")
    delta = _delta(delta)
    sigma, tau = _weighted_gaussian_calibration(_partitions_per_unit(max_partitions_per_unit),
                                                epsilon, delta)
    noise = KeyedGaussian.fresh().normals(0, np.arange(weights.size, dtype=np.uint64))
    keep = weights + sigma * noise > tau
    return Release(Selection(keep), dp_event.GaussianDpEvent(noise_multiplier=sigma),
                   additional_delta=delta / 2.0)


# --- What each rule keeps, for the front ends -------------------------------------------------

def units_kept_half_the_time(mechanism, *, max_partitions_per_unit: int, epsilon: float,
                             delta: float) -> int:
    """The number n of units from which ``mechanism`` (one of this module's four selection
    functions, with the arguments it would run with) keeps a partition that they alone are in
    with probability at least 1/2: about the smallest group a release shows. Public: a
    function of the rule's calibration only. Read from the same calibration the mechanism
    runs (so there is one derivation of each rule's threshold):

    * :func:`laplace_threshold`: kept when n + Z >= tau, Z symmetric: n = tau.
    * :func:`gaussian_threshold`: kept when n + Z > tau: n = ceil(tau), tau on one partition
      (its sigma does not depend on the number of partitions: additive.MAX_COORDINATES).
    * :func:`truncated_geometric_selection`: the first n whose keep probability pi(n), as its
      coins draw it, is >= 1/2.
    * :func:`weighted_gaussian_selection`: n units alone in the partition weigh n (1 each):
      kept when n + N(0, sigma^2) > tau, n = ceil(tau)."""
    partitions = _partitions_per_unit(max_partitions_per_unit)
    if mechanism is laplace_threshold:
        return laplace_threshold_tau(max_partitions_per_unit=partitions, epsilon=epsilon,
                                     delta=delta)
    if mechanism is gaussian_threshold:
        return math.ceil(_gaussian_threshold_calibration(partitions, epsilon, _delta(delta), 1)[1])
    if mechanism is truncated_geometric_selection:
        probabilities = _truncated_geometric_calibration(partitions, epsilon, delta)[1]
        return int(np.argmax(probabilities >= 0.5)) + 1  # pi(N) = 1: always found
    if mechanism is weighted_gaussian_selection:
        return math.ceil(_weighted_gaussian_calibration(partitions, epsilon, _delta(delta))[1])
    raise ValueError(f"{getattr(mechanism, '__name__', mechanism)!r} is not a selection rule of "
                     "this module")
