"""How the sampling that ran is accounted for, with dp-accounting's events.

The descriptor says what ran. This module turns it, plus the trainer's Gaussian noise
multiplier sigma (noise std / clipping norm C), into a DpEvent and an (epsilon, delta).

Neighbouring relations. The ledger accounts in add-or-remove-one (Sage §4).
* Poisson: PoissonSampledDpEvent is analysed in add/remove directly. A clipped sum has
  sensitivity C, so the Gaussian's noise multiplier is sigma. The number of steps,
  floor(1/gamma) * epochs, does not depend on n.
* SWO and shuffling: the number of steps n // m depends on n, so these schemes treat the size
  of the granted data as public. A person's record is then present or replaced by a null record
  that contributes a zero gradient. Adding or removing it is a replacement (x <-> null), which
  the replace-one analysis covers. dp-accounting analyses SampledWithoutReplacementDpEvent
  (Wang, Balle & Kasiviswanathan 2019) only under REPLACE_ONE. Under replace-one a clipped sum
  has sensitivity 2C (open issue google/differential-privacy#378, STACK.md). The Gaussian in
  the event is therefore given noise multiplier sigma / 2, which also covers x <-> null
  (sensitivity C).
* Shuffling (shuffle-and-split): in each epoch the batches partition the data, so a replaced
  record touches exactly one batch. By parallel composition an epoch costs one Gaussian of
  sensitivity 2C: epochs x GaussianDpEvent(sigma / 2), under REPLACE_ONE.

Poisson truncation. An epoch's layout has L slots. With probability <= t per epoch
(sampling.poisson_layout) the k samples do not all fit, and those that do not are run as empty
steps. The truncated mechanism differs from the exact one only on that event. Over E epochs
each output probability therefore moves by at most E * t, so an (eps, delta) guarantee for the
exact mechanism gives (eps, delta + (1 + e^eps) * E * t) for the one that ran. `epsilon`
reserves that term out of delta.
"""
from __future__ import annotations

import math
from typing import Optional

import dp_accounting
from dp_accounting import rdp

from sage_tfx.components.oblivious_sample_gen.descriptor import SamplingDescriptor

RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
                   + [64, 80, 96, 128, 192, 256, 512])


def neighboring_relation(descriptor: SamplingDescriptor) -> dp_accounting.NeighboringRelation:
    if descriptor.scheme == "poisson":
        return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    return dp_accounting.NeighboringRelation.REPLACE_ONE


def dp_event(descriptor: SamplingDescriptor, noise_multiplier: float) -> dp_accounting.DpEvent:
    """The DpEvent of DP-SGD with this sampling, for `descriptor.steps` noisy steps."""
    if noise_multiplier <= 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
    if descriptor.scheme == "poisson":
        step = dp_accounting.PoissonSampledDpEvent(
            descriptor.gamma, dp_accounting.GaussianDpEvent(noise_multiplier))
        return dp_accounting.SelfComposedDpEvent(step, descriptor.steps)
    # Replace-one: a clipped sum moves by up to 2C (module docstring).
    replace_one_gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2.0)
    if descriptor.scheme == "swo":
        step = dp_accounting.SampledWithoutReplacementDpEvent(
            descriptor.n, descriptor.sample_size, replace_one_gaussian)
        return dp_accounting.SelfComposedDpEvent(step, descriptor.steps)
    return dp_accounting.SelfComposedDpEvent(replace_one_gaussian, descriptor.epochs)


def rdp_epsilon(descriptor: SamplingDescriptor, noise_multiplier: float, delta: float) -> float:
    """Epsilon at `delta` of the exact (untruncated) mechanism, with the RDP accountant."""
    accountant = rdp.RdpAccountant(list(RDP_ORDERS), neighboring_relation(descriptor))
    accountant.compose(dp_event(descriptor, noise_multiplier))
    return float(accountant.get_epsilon(delta))


def truncation_delta(descriptor: SamplingDescriptor, epsilon_cap: float) -> float:
    """The delta that pays for Poisson truncation when epsilon is at most `epsilon_cap`:
    (1 + e^eps) * E * t (module docstring); 0 for schemes that never truncate."""
    truncation = descriptor.epochs * descriptor.truncation_probability
    return 0.0 if truncation == 0.0 else (1.0 + math.exp(min(epsilon_cap, 700.0))) * truncation


def epsilon(descriptor: SamplingDescriptor, noise_multiplier: float, delta: float,
            epsilon_cap: Optional[float] = None) -> float:
    """The epsilon at `delta` of DP-SGD that ran with this sampling (RDP accountant).

    Part of delta pays for Poisson truncation: epsilon is computed at
    delta' = delta - truncation_delta(epsilon_cap). That is sound whenever the result is at most
    the cap, which is checked. The default cap is the epsilon at delta / 2, which bounds the
    result as long as delta' >= delta / 2. Calibration passes its target epsilon as the cap."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if descriptor.truncation_probability == 0.0:
        return rdp_epsilon(descriptor, noise_multiplier, delta)
    if epsilon_cap is None:
        epsilon_cap = rdp_epsilon(descriptor, noise_multiplier, delta / 2.0)
    reserved = truncation_delta(descriptor, epsilon_cap)
    if reserved > delta / 2.0:
        raise ValueError(f"delta={delta} is too small to cover Poisson truncation "
                         f"({reserved:.3g}); use a larger delta")
    result = rdp_epsilon(descriptor, noise_multiplier, delta - reserved)
    if result > epsilon_cap:
        raise ValueError(f"epsilon {result} exceeds the cap {epsilon_cap} its truncation "
                         "reserve was computed for")
    return result
