"""AdaSSP: differentially private linear regression by sufficient-statistics perturbation
(Wang, "Revisiting differentially private linear regression", AISTATS 2018, Algorithm 2; the
linear-regression trainer of Sage Table 1).

Data: rows x_i in R^d (the trainer appends the intercept feature 1) scaled to
||x_i||_2 <= B_x, and labels clipped to |y_i| <= B_y; both bounds are public parameters.

Released, each with a Gaussian mechanism of noise multiplier sigma (std / sensitivity), under
add/remove-one (the ledger's relation):
  1. lambda_min(X^T X). Adding x x^T (PSD, spectral norm ||x||^2) moves every eigenvalue by at
     most B_x^2 (Weyl), so the sensitivity is B_x^2.
  2. X^T X, as its upper triangle (diagonal included), mirrored. The triangle of x x^T has L2
     norm <= ||x x^T||_F = ||x||^2 <= B_x^2.
  3. X^T y. ||x y||_2 <= B_x B_y.
The three compose to SelfComposedDpEvent(GaussianDpEvent(sigma), 3); each is drawn by
sage_tfx.mechanisms.gaussian_with_noise_multiplier (exact, floating-point-safe, OS-seeded), and
the result carries the ComposedDpEvent of the three events that ran. sigma comes from
dp-accounting's calibration with its RDP accountant at the grant's (epsilon, delta) (the PLD
accountant is tighter but its discretisation runs out of memory at the small sigma of large
epsilons). Wang states the noise as sqrt(log(6/delta)) / (epsilon/3) per release, a
looser per-mechanism bound with basic composition. The accountant gives a smaller sigma for the
same guarantee.

Ridge parameter, as in Wang's Algorithm 2 with his noise scale replaced by ours:
  lambda_min~ = max(0, lambda_min + sigma B_x^2 Z - sigma B_x^2 Phi^-1(1 - rho/2)), so
  lambda_min~ <= lambda_min with probability >= 1 - rho/2;
  lambda = max(0, sigma B_x^2 sqrt(d log(2 d^2 / rho)) - lambda_min~), Wang's bound on what it
  takes for X^T X + noise + lambda I to stay well conditioned with probability >= 1 - rho/2.
theta = (X^T X~ + lambda I)^-1 X^T y~. Everything after the three releases is post-processing,
so theta is (epsilon, delta)-DP. rho only affects accuracy, never privacy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import dp_accounting
import numpy as np
from dp_accounting import mechanism_calibration, rdp
from scipy import stats

from sage_tfx import mechanisms

RELEASES = 3


@dataclass(frozen=True)
class AdaSSPResult:
    weights: np.ndarray  # d coefficients, the intercept last
    noise_multiplier: float
    ridge: float
    event: Optional[dp_accounting.DpEvent] = None  # the three Gaussian releases that ran


def dp_event(noise_multiplier: float) -> dp_accounting.DpEvent:
    """What AdaSSP runs: three Gaussian releases at this noise multiplier (add-or-remove-one)."""
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier),
                                             RELEASES)


def planned_event(epsilon: float, delta: float) -> dp_accounting.DpEvent:
    """The event AdaSSP will run on an (epsilon, delta) share: public, before any data is read."""
    return dp_event(noise_multiplier(epsilon, delta))


def noise_multiplier(epsilon: float, delta: float) -> float:
    """sigma such that three Gaussian releases at noise multiplier sigma are (epsilon, delta)-DP."""
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"AdaSSP's Gaussian noise needs delta in (0, 1), got {delta}")
    return float(mechanism_calibration.calibrate_dp_mechanism(
        rdp.RdpAccountant, dp_event, epsilon, delta,
        bracket_interval=mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0)))


def clip_rows(features: np.ndarray, labels: np.ndarray, feature_bound: float,
              label_bound: float) -> tuple[np.ndarray, np.ndarray]:
    """[features, 1] scaled to norm <= feature_bound; labels clipped to [-label_bound, label_bound]."""
    design = np.hstack([np.asarray(features, dtype=np.float64),
                        np.ones((len(features), 1))])
    norms = np.linalg.norm(design, axis=1, keepdims=True)
    design *= np.minimum(1.0, feature_bound / np.maximum(norms, 1e-300))
    return design, np.clip(np.asarray(labels, dtype=np.float64), -label_bound, label_bound)


def adassp(features: np.ndarray, labels: np.ndarray, epsilon: float, delta: float,
           feature_bound: float, label_bound: float, rho: float = 0.05,
           label_offset: float = 0.0) -> AdaSSPResult:
    """DP linear regression y ~ features @ w + b; returns [w, b] (module docstring).

    The fit is on y - label_offset (clipped to +-label_bound), and the offset is added back to
    the intercept: the ridge then shrinks predictions toward the public `label_offset` (a prior
    guess at a typical label) instead of toward 0, which matters at small epsilon when labels
    are far from 0. Being public, the offset costs no privacy."""
    features = np.asarray(features, dtype=np.float64)
    # No rows is a dataset like any other: the Gram matrix and moment are 0 and the releases
    # are noise only (refusing it after the charge would tell 0 records from 1).
    if features.ndim != 2 or len(features) != len(labels):
        raise ValueError(f"need a 2-D feature matrix and one label per row; got "
                         f"features {features.shape}, {len(labels)} labels")
    if not (feature_bound > 0 and label_bound > 0):
        raise ValueError(f"the bounds must be positive, got feature_bound={feature_bound}, "
                         f"label_bound={label_bound}")
    if not 0.0 < rho < 1.0:
        raise ValueError(f"rho must be in (0, 1), got {rho}")
    sigma = noise_multiplier(epsilon, delta)
    design, targets = clip_rows(features, np.asarray(labels, dtype=np.float64) - label_offset,
                                feature_bound, label_bound)
    d = design.shape[1]
    gram_scale = sigma * feature_bound ** 2

    gram = design.T @ design
    min_eigenvalue = float(np.linalg.eigvalsh(gram)[0])
    eigenvalue = mechanisms.gaussian_with_noise_multiplier(
        min_eigenvalue, l2_sensitivity=feature_bound ** 2, noise_multiplier=sigma)
    noisy_min_eigenvalue = max(0.0, float(eigenvalue.value)
                               - gram_scale * stats.norm.ppf(1.0 - rho / 2.0))
    upper = np.triu_indices(d)
    triangle = mechanisms.gaussian_with_noise_multiplier(
        gram[upper], l2_sensitivity=feature_bound ** 2, noise_multiplier=sigma)
    noisy_gram = np.zeros((d, d))
    noisy_gram[upper] = triangle.value
    noisy_gram = noisy_gram + np.triu(noisy_gram, 1).T
    moment = mechanisms.gaussian_with_noise_multiplier(
        design.T @ targets, l2_sensitivity=feature_bound * label_bound, noise_multiplier=sigma)
    noisy_moment = moment.value

    ridge = max(0.0, gram_scale * math.sqrt(d * math.log(2.0 * d * d / rho)) - noisy_min_eigenvalue)
    weights = np.linalg.lstsq(noisy_gram + ridge * np.eye(d), noisy_moment, rcond=None)[0]
    weights[-1] += label_offset
    return AdaSSPResult(weights, sigma, ridge, dp_accounting.ComposedDpEvent(
        [eigenvalue.event, triangle.event, moment.event]))
