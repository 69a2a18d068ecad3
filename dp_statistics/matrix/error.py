"""The expected error of a strategy on a workload, and the SVD lower bound (closed forms).

Gaussian ((epsilon, delta)-DP, add-or-remove-one record). The mechanism releases y = A x + z,
z ~ N(0, sigma^2 I) with sigma = gaussian_sigma(l2_sensitivity=||A||_2, epsilon, delta) (the
analytic Gaussian, Balle & Wang 2018; ||A||_2 = max column norm, the change of A x when one
record enters or leaves one cell). The answers W x_hat = W A^+ y are unbiased when A supports W,
with covariance sigma^2 W (A^T A)^+ W^T, so query q's RMSE is sigma sqrt(w_q (A^T A)^+ w_q^T) and

    expected_rmse = sigma * sqrt(trace(W (A^T A)^+ W^T) / m)       (root mean over m queries).

The paper (Prop. 4) uses the classical sigma = ||A||_2 sqrt(2 ln(2/delta)) / epsilon; the
analytic sigma is smaller and exact, and it is linear in the sensitivity (the Gaussian's privacy
profile depends on sensitivity / sigma only), so every ratio between strategies is the paper's.

Laplace (pure epsilon): z_i ~ Laplace(b), b = ||A||_1 / epsilon (max column L1 norm), variance
2 b^2, so laplace_expected_rmse = sqrt(2) ||A||_1 / epsilon * sqrt(trace(...) / m). Eigen-Design
optimises the L2 objective; for Laplace it is a heuristic (paper §3.5), not an optimum.

SVD bound (paper Thm. 2; derivation in strategy.py): every strategy has
||A||_2^2 trace(W^T W (A^T A)^+) >= (sum_i sqrt(lambda_i(W^T W)))^2 / n, hence

    expected_rmse >= gaussian_sigma(1, epsilon, delta) * sqrt((sum_i sqrt(lambda_i))^2 / (n m)).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from sage_tfx import mechanisms
from sage_tfx.dp_statistics.matrix.strategy import LinearStrategy, as_strategy, as_workload
from sage_tfx.dp_statistics.matrix.workload import Workload


def _checked(workload, strategy) -> tuple[Workload, LinearStrategy]:
    workload, strategy = as_workload(workload), as_strategy(strategy)
    strategy.require_support(workload)
    return workload, strategy


def unit_rmse(workload, strategy) -> float:
    """||A||_2 sqrt(trace(W^T W (A^T A)^+) / m): the RMSE per unit of noise multiplier."""
    workload, strategy = _checked(workload, strategy)
    return strategy.l2_sensitivity * math.sqrt(strategy.trace(workload) / workload.query_count)


def expected_rmse(workload, strategy, epsilon: float, delta: float) -> float:
    """Root mean squared error per query of the Gaussian matrix mechanism (module docstring)."""
    return mechanisms.gaussian_sigma(l2_sensitivity=1.0, epsilon=epsilon,
                                     delta=delta) * unit_rmse(workload, strategy)


def laplace_expected_rmse(workload, strategy, epsilon: float) -> float:
    """Root mean squared error per query of the Laplace (pure epsilon) matrix mechanism."""
    workload, strategy = _checked(workload, strategy)
    return (math.sqrt(2.0) * strategy.l1_sensitivity / float(epsilon)
            * math.sqrt(strategy.trace(workload) / workload.query_count))


def query_rmse(workload, strategy, noise_scale: float) -> np.ndarray:
    """Each query's RMSE when the strategy's answers get noise of standard deviation
    ``noise_scale`` (sigma for the Gaussian, sqrt(2) b for Laplace), in query order."""
    workload, strategy = _checked(workload, strategy)
    return noise_scale * np.sqrt(np.maximum(strategy.query_variances(workload), 0.0))


def _commuting_eigenvalues(workload: Workload) -> np.ndarray:
    """Eigenvalues of sum_t (x)_i G_ti when, per attribute, the G_ti commute (identity, total,
    any one block...): one orthogonal basis diagonalises them all, found from a generic
    combination, and the eigenvalues are sum_t (x)_i diag(Q_i^T G_ti Q_i)."""
    rng = np.random.default_rng(0)  # a generic combination, not privacy randomness
    per_term = [[block.gram() for block in term] for term in workload.terms]
    diagonals = [[] for _ in per_term]
    for i in range(len(workload.sizes)):
        grams = [term[i] for term in per_term]
        for a in grams:
            for b in grams:
                if not np.allclose(a @ b, b @ a, atol=1e-9 * max(1.0, np.abs(a).max())):
                    raise ValueError("the SVD bound of this workload needs its n x n Gram "
                                     f"({workload.cells} cells is too many)")
        basis = np.linalg.eigh(sum(rng.uniform(1, 2) * g for g in grams))[1]
        for t, gram in enumerate(grams):
            diagonals[t].append(np.einsum("ji,jk,ki->i", basis, gram, basis))
    return sum(functools.reduce(lambda a, b: np.multiply.outer(a, b).reshape(-1), d)
               for d in diagonals)


def svd_bound_unit_rmse(workload) -> float:
    """sqrt((sum_i sqrt(lambda_i(W^T W)))^2 / (n m)): the bound per unit noise multiplier."""
    workload = as_workload(workload)
    if workload.cells <= 8192:
        eigenvalues = np.linalg.eigvalsh(workload.gram())
    else:
        eigenvalues = _commuting_eigenvalues(workload)
    root_sum = np.sum(np.sqrt(np.maximum(eigenvalues, 0.0)))
    return float(root_sum / math.sqrt(workload.cells * workload.query_count))


def svd_lower_bound_rmse(workload, epsilon: float, delta: float) -> float:
    """No strategy's expected_rmse on ``workload`` is below this (module docstring)."""
    return mechanisms.gaussian_sigma(l2_sensitivity=1.0, epsilon=epsilon,
                                     delta=delta) * svd_bound_unit_rmse(workload)
