"""How the sampling that ran is accounted for, with dp-accounting's events.

The descriptor says what ran. This module turns it, plus the trainer's Gaussian noise
multiplier sigma (noise std / clipping norm C), into a DpEvent and an (epsilon, delta).

The size. Nothing here uses the exact number n of granted records: a count of the data is
not DP, and storing or branching on it (descriptor, steps, logs) would release it. The data is
brought to a size N that is public (a bound the user declares: `public_size`) or a function of
a DP count n_hat = n + Z, Z ~ DiscreteLaplace(1 / eps_count), released by ObliviousSampleGen
as its own step of the grant ("sampling_count", pure eps_count, sensitivity 1 under
add/remove). `sized_for` maps n_hat to N. Everything stored or printed is then a function of
public values and n_hat. The whole release is the count's (eps_count, 0) composed with
training's (eps, delta) (basic composition; each is paid from its own share of the grant).

Neighbouring relations. The ledger accounts in add-or-remove-one (Sage §4).
* SWO and shuffling run on exactly N rows (sampling.to_size): n < N rows are padded with null
  records, which contribute a zero gradient; n > N rows are cut to a uniformly random subset
  of N. Fix N (it is released, so we may condition on it) and let D' = D + {x}. Then the
  sized data of D and of D' are replace-one neighbours of size N, or equal, under a coupling:
  - n + 1 <= N: D' has x where D has a null (x <-> null).
  - n >= N: draw D''s subset S'. If x is not in S', S' is a uniform N-subset of D; if it is,
    swapping x for a uniform record of D outside S' gives a uniform N-subset of D. Either way
    the subsets of D and D' are equal or differ by one replacement.
  A mechanism that is (eps, delta)-DP under replace-one is therefore (eps, delta)-DP for D vs
  D' after sizing: average its guarantee over the coupling (P[M(A) in E] = E[P[M(a) in E]]
  <= e^eps E[P[M(b) in E]] + delta). dp-accounting analyses SampledWithoutReplacementDpEvent
  (Wang, Balle & Kasiviswanathan 2019) only under REPLACE_ONE, with sample size m out of N.
  Under replace-one a clipped sum has sensitivity 2C (x <-> y; open issue
  google/differential-privacy#378, STACK.md). The Gaussian in the event is therefore given
  noise multiplier sigma / 2, which also covers x <-> null (sensitivity C).
* Shuffling (shuffle-and-split): in each epoch the batches partition the N rows, so a replaced
  record touches exactly one batch. By parallel composition an epoch costs one Gaussian of
  sensitivity 2C: epochs x GaussianDpEvent(sigma / 2), under REPLACE_ONE.
* Poisson needs no size to sample: each row is in a sample with probability gamma, so null
  rows change no gradient and padding is invisible to the analysis, which stays add/remove
  (PoissonSampledDpEvent, sensitivity C, noise multiplier sigma). The layout needs a size: the
  unit width w (sampling.poisson_width) and the normaliser gamma * N. N = n_hat + t, with t
  chosen so that P[Z < -t] <= SIZE_TRUNCATION_PROBABILITY: the data is cut (to N random
  records) only when n > N, an event of at most that probability for every dataset.

Truncation (Poisson). A sample larger than w keeps w records, with probability <= t per epoch
(union bound over the epoch's samples), and the data is cut with probability <= tau once per
run (above). The mechanism that ran differs from the exact one only on those events, of total
probability E * t + tau for every dataset.

Routing overflow (all schemes). Each oblivious routing pass stops the run with RouteOverflow
with probability at most p_o = 2^-40 (melbourne.OVERFLOW_PROBABILITY), under every dataset. For
the cut pass of to_size the plan is built from the exact n, so that probability depends on the
data; the stop is an observable output. A run makes at most P routing passes: one per epoch
for SWO and Poisson (the samples; shuffling copies without routing), plus the cut pass, counted
whether or not it runs (it runs only when n > N, which is private). By a union bound the run
stops with probability at most P * p_o for every dataset.

Both are events of probability at most T = E * t + tau + P * p_o under every dataset, on which
alone the mechanism that ran (M') differs from the exact one (M), under a coupling on the same
randomness. For any output set S: P[M'(D) in S] <= P[M(D) in S] + T
<= e^eps P[M(D') in S] + delta + T <= e^eps (P[M'(D') in S] + T) + delta + T. So an
(eps, delta) guarantee for M gives (eps, delta + (1 + e^eps) T) for M'. (Adding only T is not
enough when the event is correlated with the output: if M(D') gives `a` with probability
q e^-eps exactly on its overflow event and M(D) gives `a` with probability q, M'(D') never gives
`a`, and delta must cover q = e^eps T.) `epsilon` reserves the whole term out of delta.
"""
from __future__ import annotations

import math
from typing import Optional

import dp_accounting
from dp_accounting import rdp

from sage_tfx.components.oblivious_sample_gen.descriptor import SamplingDescriptor, Scheme
from sage_tfx.components.oblivious_sample_gen.melbourne import OVERFLOW_PROBABILITY

# P[the DP count undershoots by more than Poisson's size slack]: below 1e-18 of delta.
SIZE_TRUNCATION_PROBABILITY = 2.0 ** -60
# The grant step that pays for the DP count of the records (ObliviousSampleGen).
COUNT_STEP = "sampling_count"

RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
                   + [64, 80, 96, 128, 192, 256, 512])


def neighboring_relation(descriptor: SamplingDescriptor) -> dp_accounting.NeighboringRelation:
    if descriptor.scheme == Scheme.POISSON:
        return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    return dp_accounting.NeighboringRelation.REPLACE_ONE


def dp_event(descriptor: SamplingDescriptor, noise_multiplier: float) -> dp_accounting.DpEvent:
    """The DpEvent of DP-SGD with this sampling, for `descriptor.steps` noisy steps."""
    if noise_multiplier <= 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
    if descriptor.scheme == Scheme.POISSON:
        step = dp_accounting.PoissonSampledDpEvent(
            descriptor.gamma, dp_accounting.GaussianDpEvent(noise_multiplier))
        return dp_accounting.SelfComposedDpEvent(step, descriptor.steps)
    # Replace-one: a clipped sum moves by up to 2C (module docstring).
    replace_one_gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2.0)
    if descriptor.scheme == Scheme.SWO:
        step = dp_accounting.SampledWithoutReplacementDpEvent(
            descriptor.n, descriptor.sample_size, replace_one_gaussian)
        return dp_accounting.SelfComposedDpEvent(step, descriptor.steps)
    return dp_accounting.SelfComposedDpEvent(replace_one_gaussian, descriptor.epochs)


def rdp_epsilon(descriptor: SamplingDescriptor, noise_multiplier: float, delta: float) -> float:
    """Epsilon at `delta` of the exact (untruncated) mechanism, with the RDP accountant."""
    accountant = rdp.RdpAccountant(list(RDP_ORDERS), neighboring_relation(descriptor))
    accountant.compose(dp_event(descriptor, noise_multiplier))
    return float(accountant.get_epsilon(delta))


def routing_passes(descriptor: SamplingDescriptor) -> int:
    """The most oblivious routing passes a run makes (module docstring): one per epoch for SWO
    and Poisson, plus to_size's cut pass, counted whether or not n > N."""
    return (descriptor.epochs if descriptor.scheme in (Scheme.SWO, Scheme.POISSON) else 0) + 1


def truncation_delta(descriptor: SamplingDescriptor, epsilon_cap: float) -> float:
    """The delta that pays for Poisson truncation and routing overflow when epsilon is at most
    `epsilon_cap`: (1 + e^eps) * (E * t + tau + P * 2^-40) (module docstring)."""
    truncation = (descriptor.epochs * descriptor.truncation_probability
                  + descriptor.size_truncation_probability
                  + routing_passes(descriptor) * OVERFLOW_PROBABILITY)
    return (1.0 + math.exp(min(epsilon_cap, 700.0))) * truncation


def epsilon(descriptor: SamplingDescriptor, noise_multiplier: float, delta: float,
            epsilon_cap: Optional[float] = None) -> float:
    """The epsilon at `delta` of DP-SGD that ran with this sampling (RDP accountant).

    Part of delta pays for Poisson truncation and routing overflow: epsilon is computed at
    delta' = delta - truncation_delta(epsilon_cap). That is sound whenever the result is at most
    the cap, which is checked. The default cap is the epsilon at delta / 2, which bounds the
    result as long as delta' >= delta / 2. Calibration passes its target epsilon as the cap."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if epsilon_cap is None:
        epsilon_cap = rdp_epsilon(descriptor, noise_multiplier, delta / 2.0)
    reserved = truncation_delta(descriptor, epsilon_cap)
    if reserved > delta / 2.0:
        raise ValueError(f"delta={delta} is too small to cover Poisson truncation and "
                         f"routing overflow ({reserved:.3g}); use a larger delta")
    result = rdp_epsilon(descriptor, noise_multiplier, delta - reserved)
    if result > epsilon_cap:
        raise ValueError(f"epsilon {result} exceeds the cap {epsilon_cap} its truncation "
                         "reserve was computed for")
    return result


def sized_for(scheme: str, count: int, count_epsilon: float,
              sample_size: Optional[int] = None) -> tuple[int, float]:
    """(N, tau): the size the data is brought to from the DP count n_hat = `count`, and the
    probability (over the count's noise, for every dataset) that real records are cut where
    the accountant does not cover it (module docstring).

    SWO and shuffling: N = max(n_hat, m) (at least one sample); cutting is covered by the
    replace-one coupling, tau = 0. Poisson: N = max(n_hat, 1) + t with t + 1 =
    ceil(ln(1 / tau) / eps_count), so P[n > N] <= P[Z <= -(t + 1)] <= e^{-eps_count (t + 1)}
    <= tau for the discrete Laplace of scale 1 / eps_count.

    A count n_hat <= 0 (few or no records, negative noise) is clamped to the smallest valid
    size: m rows (one sample) or 1 row plus the slack. N is a function of n_hat and public
    parameters only, so the clamp is post-processing of the DP count and costs nothing."""
    if not (math.isfinite(count_epsilon) and count_epsilon > 0):
        raise ValueError(f"the count's epsilon must be positive, got {count_epsilon}")
    if scheme != Scheme.POISSON:
        return max(int(count), int(sample_size or 1)), 0.0
    slack = math.ceil(math.log(1.0 / SIZE_TRUNCATION_PROBABILITY) / count_epsilon) - 1
    return max(int(count), 1) + slack, SIZE_TRUNCATION_PROBABILITY
