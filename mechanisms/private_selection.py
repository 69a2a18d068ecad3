"""Private selection for tuning: run a DP trial a random number of times and release only the
best (Liu & Talwar, STOC 2019; Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential
Privacy", ICLR 2022, arXiv:2110.03620).

Training K models and keeping the best leaks through the choice: the best of a FIXED K trials
can be about K times less private than one trial (the best of K Laplace scores has privacy
loss K epsilon on the event "every score is low"). Papernot and Steinke draw K at random and
keep it secret; then selection costs a small factor over one trial, whatever K turns out to be.

The mechanism A. A trial Q picks a candidate uniformly at random (from `rng`) and runs
`run_trial(candidate)`, a DP mechanism whose Release holds the candidate's score; Q's output is
(score, candidate). A draws K from `law`, runs Q K times on the same data with fresh randomness
and releases the best output only: the largest score, ties to the smaller candidate index (a
total order on outputs, as the theorems need). Every trial is the same mechanism Q: the
candidate is drawn inside the trial, so trials are i.i.d., which the theorems assume (cycling
through the candidates would not be). With the Poisson law K may be 0: A then releases None, a
value that does not depend on the data.

What must stay secret: K, and everything about the trials other than the best output (the
other scores and candidates, how many trials ran, how long they took). Released with K, the
best of K is the fixed-K mechanism above. This module releases none of it; a component built
on it must log and store none of it either (its duration is the timing channel
docs/privacy-guarantee.md leaves open for every release).

The laws of K (Papernot-Steinke Definition 1 and Section 3.3):
* truncated negative binomial D_{eta, gamma}, shape eta >= 0, gamma in (0, 1), K >= 1:
      P[K = k] = (1 - gamma)^k / (gamma^-eta - 1) * prod_{l=0}^{k-1} (l + eta) / (l + 1),
  for eta = 0 the logarithmic law P[K = k] = (1 - gamma)^k / (k ln(1 / gamma)); eta = 1 is the
  geometric law. E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta)), or
  (1 - gamma) / (gamma ln(1 / gamma)) for eta = 0.
* Poisson(mu), K >= 0, E[K] = mu.

The guarantee (Papernot-Steinke). Let Q be (lambda, epsilon)-RDP and (lambda_hat,
epsilon_hat)-RDP (lambda > 1, lambda_hat >= 1).
* Theorem 2 (truncated negative binomial): A is (lambda, epsilon')-RDP with
      epsilon' = epsilon + (1 + eta) (1 - 1/lambda_hat) epsilon_hat
                 + (1 + eta) ln(1 / gamma) / lambda_hat + ln(E[K]) / (lambda - 1).
* Theorem 6 (Poisson): if Q is also (epsilon_hat, delta_hat)-DP with
  e^epsilon_hat <= 1 + 1 / (lambda - 1), A is (lambda, epsilon + mu delta_hat + ln(mu) /
  (lambda - 1))-RDP.
Both hold for any neighbouring relation under which Q's RDP holds (the ledger's is
add-or-remove-one) and for any lambda_hat, so one trial's RDP curve gives A's.

Accounting. dp_accounting's RepeatAndSelectDpEvent(trial event, mean, shape) (shape = eta, or
infinity for Poisson) is this mechanism, and its RdpAccountant evaluates exactly these bounds on
its orders (checked against the formulas in tests/mechanisms/test_private_selection.py):
Theorem 2 at every order lambda with lambda_hat minimised over the same orders, then RDP's
monotonicity in the order; Theorem 6 with delta_hat from the trial curve's conversion at
epsilon_hat = ln(1 + 1 / (lambda - 1)). So the ledger's rdp accountant charges the curve of
`Release.event` (accounting.rdp_curve_of) like any other step's. It is given (mean, shape) and
inverts mean -> gamma by bisection, keeping the smaller end; we give it E[K] rounded up
(`mean_for_accounting`), so its gamma is at most ours and its E[K] at least ours: every term of
Theorem 2 can only grow, and the curve stays valid for the law we sample.

Sampling. K and the candidates are sampling, not noise: they come from
sage_tfx.randomness.secret_rng (OS-seeded; a seed for tests only). The truncated negative
binomial is drawn by inverting its CDF with the pmf's recursion P[k+1] / P[k] =
(1 - gamma) (k + eta) / (k + 1), in E[K] steps on average; in doubles, its pmf is within a
relative 1e-13 of the law's (changing the RDP bound by about as much), and a walk that
exhausts the doubles (probability below 1e-300) stops where the pmf underflows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np
from dp_accounting import dp_event

from sage_tfx.mechanisms.release import Release
from sage_tfx.randomness import secret_rng

# E[K] as given to the accountant: rounded up by far more than the few ulps of error in
# computing it (module docstring: a larger mean only loosens the bound).
_MEAN_ROUNDING_UP = 1e-12


@dataclass(frozen=True)
class TruncatedNegativeBinomial:
    """D_{eta, gamma} (module docstring): shape eta >= 0 (0: logarithmic, 1: geometric),
    gamma in (0, 1); K >= 1."""
    shape: float
    gamma: float

    def __post_init__(self):
        if not (isinstance(self.shape, (int, float)) and math.isfinite(self.shape)
                and self.shape >= 0):
            raise ValueError(f"the shape eta must be a finite number >= 0, got {self.shape!r}")
        if not (isinstance(self.gamma, (int, float)) and 0.0 < self.gamma < 1.0):
            raise ValueError(f"gamma must lie in (0, 1), got {self.gamma!r}")

    def probability(self, k: int) -> float:
        """P[K = k] for k >= 1 (module docstring)."""
        eta, gamma = float(self.shape), float(self.gamma)
        log_inverse = -math.log(gamma)
        # P[K = 1] = (1 - gamma) eta / (gamma^-eta - 1), whose eta -> 0 limit is logarithmic.
        first = (1.0 - gamma) * (eta / math.expm1(eta * log_inverse) if eta > 0
                                 else 1.0 / log_inverse)
        probability = first
        for j in range(1, k):
            probability *= self._ratio(j)
        return probability if k >= 1 else 0.0

    def _ratio(self, k: int) -> float:
        """P[K = k + 1] / P[K = k]."""
        return (1.0 - self.gamma) * (k + self.shape) / (k + 1)

    @property
    def mean(self) -> float:
        """E[K] (module docstring)."""
        eta, gamma = float(self.shape), float(self.gamma)
        if eta == 0:
            return (1.0 - gamma) / (gamma * -math.log(gamma))
        return eta * (1.0 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))

    def draw(self, rng: np.random.Generator) -> int:
        """K by inverting the CDF: the smallest k with P[K <= k] > U."""
        uniform = rng.random()
        k, probability = 1, self.probability(1)
        cumulative = probability
        while cumulative <= uniform and probability > 0:
            probability *= self._ratio(k)
            k += 1
            cumulative += probability
        return k

    def selection_event(self, trial_event: dp_event.DpEvent) -> dp_event.DpEvent:
        return dp_event.RepeatAndSelectDpEvent(trial_event, mean_for_accounting(self.mean),
                                               float(self.shape))


@dataclass(frozen=True)
class PoissonTrials:
    """K ~ Poisson(mean); K = 0 releases None (Theorem 6)."""
    mean: float

    def __post_init__(self):
        if not (isinstance(self.mean, (int, float)) and math.isfinite(self.mean)
                and self.mean > 0):
            raise ValueError(f"the Poisson mean must be a positive finite number, "
                             f"got {self.mean!r}")

    def draw(self, rng: np.random.Generator) -> int:
        return int(rng.poisson(self.mean))

    def selection_event(self, trial_event: dp_event.DpEvent) -> dp_event.DpEvent:
        return dp_event.RepeatAndSelectDpEvent(trial_event, float(self.mean), math.inf)


TrialCount = Union[TruncatedNegativeBinomial, PoissonTrials]


def mean_for_accounting(mean: float) -> float:
    """E[K] rounded up for the accountant (module docstring, "Accounting")."""
    return mean * (1.0 + _MEAN_ROUNDING_UP)


@dataclass(frozen=True)
class Selected:
    """What private selection releases: the best trial's DP score and its candidate index."""
    score: float
    candidate: int


def _rank(score: float, candidate: int) -> tuple[float, int]:
    """The total order on outputs: larger score first, then the smaller candidate (a NaN
    score, which a DP score should never be, ranks below every other)."""
    return (-math.inf if math.isnan(score) else score, -candidate)


def private_selection(candidates: int, run_trial: Callable[[int], Release],
                      trial_event: dp_event.DpEvent, law: TrialCount,
                      rng: Optional[np.random.Generator] = None) -> Release:
    """Runs K ~ `law` trials, each on a candidate drawn uniformly from range(`candidates`), and
    releases the best (module docstring). `run_trial(candidate)` must return a Release of the
    candidate's DP score (a float) whose event is `trial_event`, the same for every candidate.
    Returns Release(Selected(score, candidate), or None when K = 0, event
    RepeatAndSelectDpEvent(trial_event, E[K], shape)). `rng` (sampling only: K and the
    candidates) defaults to a fresh secret_rng.

    A trial whose event is not `trial_event`, or that spends delta outside it, stops the
    selection with an error and nothing released (the accountant must match what ran)."""
    if not (isinstance(candidates, int) and not isinstance(candidates, bool)
            and candidates >= 1):
        raise ValueError(f"candidates must be a positive integer, got {candidates!r}")
    if not isinstance(law, (TruncatedNegativeBinomial, PoissonTrials)):
        raise ValueError(f"the number of trials must follow TruncatedNegativeBinomial or "
                         f"PoissonTrials, got {law!r}")
    rng = secret_rng() if rng is None else rng
    event = law.selection_event(trial_event)
    best: Optional[Selected] = None
    for _ in range(law.draw(rng)):
        candidate = int(rng.integers(candidates))
        trial = run_trial(candidate)
        if trial.event != trial_event or trial.additional_delta:
            # (delta spent outside the event has no RDP curve for the theorems to use)
            raise RuntimeError(f"a trial ran {trial.event} with additional delta "
                               f"{trial.additional_delta:g}, not the accounted {trial_event}; "
                               "nothing was released")
        score = float(np.asarray(trial.value).reshape(()))
        if best is None or _rank(score, candidate) > _rank(best.score, best.candidate):
            best = Selected(score, candidate)
    return Release(best, event)
