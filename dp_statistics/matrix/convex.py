"""The optimal strategy of the Gaussian matrix mechanism for a workload of up to a few hundred
cells: the convex program over the strategy's Gram matrix (Yuan, Yang, Zhang and Hao, "Convex
optimization for linear query processing under approximate differential privacy", KDD 2016).

Program. Every strategy A enters the Gaussian error (error.py) only through X = A^T A:
||A||_2^2 = max_j X_jj and trace(G (A^T A)^+), G = W^T W. The error is scale free, so fix the
sensitivity at 1:

    minimise trace(G X^-1)   subject to   diag(X) <= 1,  X positive definite,

convex (X -> X^-1 is matrix convex), and every feasible X is a strategy (A = X^{1/2}, column
norms sqrt(X_jj) <= 1). Eigen-Design (strategy.py) is the same program with X restricted to
G's eigenbasis; the restriction costs 20-24% on the CDF (docs/matrix-mechanism.md).

Dual (the same route as strategy.py's Program 1). With multipliers mu > 0, D = diag(mu), the
Lagrangian trace(G X^-1) + trace(D X) - 1^T mu is minimised over X > 0 where X D X = G, i.e. at

    X(mu) = D^{-1/2} (D^{1/2} G D^{1/2})^{1/2} D^{-1/2},   trace(G X^-1) = trace(D X)
          = trace((D^{1/2} G D^{1/2})^{1/2}),

so the dual function is concave (a minimum of affine functions of mu):

    g(mu) = 2 trace((D^{1/2} G D^{1/2})^{1/2}) - 1^T mu,   grad_j g = X(mu)_jj - 1

(Danskin: the gradient is the constraint's slack at the minimiser). Slater holds (X = I/2), so
max g = the optimum. We compute everything from the SVD of B = G^{1/2} D^{1/2} = U S V^T (more
accurate than an eigendecomposition of B^T B when mu spans many orders): (B^T B)^{1/2} = V S V^T,
so trace(...) = sum S, X(mu) = D^{-1/2} V S V^T D^{-1/2}, and the strategy A = S^{1/2} V^T D^{-1/2}
has A^T A = X(mu) (rank-deficient G: S has zeros, and A's row space is G's range, which supports
W). We maximise g with scipy's L-BFGS-B (one SVD per evaluation), then scale A to be exactly
feasible (max_j X_jj = 1): its error sum(S) max_j X_jj is a valid strategy's whatever the
solver's accuracy, and g(mu*) is a lower bound on every strategy's, so ``duality_gap`` certifies
the result.

Cost: O(n^3) per evaluation and a few dozen L-BFGS-B iterations: 4 s at 128 cells, 13 s at 256,
50 s at 512 on 2 shared cores (measured on the CDF). Cached on disk like Eigen-Design.
"""
from __future__ import annotations

import functools
import time
from typing import Optional

import numpy as np
import scipy.optimize

from sage_tfx.dp_statistics.matrix import cache
from sage_tfx.dp_statistics.matrix.strategy import Strategy, as_workload, disk_cached
from sage_tfx.dp_statistics.matrix.workload import Workload

# The largest domain the convex program is solved for (O(n^3) per evaluation).
MAX_CELLS = 512


def _gram_root(gram: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh(gram)
    return (vectors * np.sqrt(np.maximum(values, 0.0))) @ vectors.T


def _dual_point(root: np.ndarray, mu: np.ndarray):
    """(trace((D^1/2 G D^1/2)^1/2), diag X(mu), S, V^T) from the SVD of G^1/2 D^1/2."""
    _, singular, right = np.linalg.svd(root * np.sqrt(mu), full_matrices=False)
    diagonal = np.sum(right.T ** 2 * singular, axis=1) / mu
    return float(np.sum(singular)), diagonal, singular, right


def optimal_gram_strategy(gram: np.ndarray) -> tuple[np.ndarray, float]:
    """(A, relative duality gap): the convex optimum for the Gram W^T W (module docstring)."""
    gram = np.asarray(gram, dtype=np.float64)
    cells = gram.shape[0]
    root = _gram_root(gram)

    def negative_dual(mu):
        root_trace, diagonal, _, _ = _dual_point(root, mu)
        return -(2.0 * root_trace - mu.sum()), -(diagonal - 1.0)

    # Start at the optimum's scale (as strategy.optimal_weights): the SVD bound's multiplier.
    # Multipliers stay positive (X(mu) needs D^{-1/2}); any mu > 0 gives a valid dual bound.
    start = np.full(cells, np.trace(root) ** 2 / cells ** 2)
    result = scipy.optimize.minimize(
        negative_dual, start, jac=True, method="L-BFGS-B",
        bounds=[(1e-12 * start[0], None)] * cells,
        options={"maxiter": 5_000, "maxcor": 30, "ftol": 1e-12, "gtol": 1e-9})
    root_trace, diagonal, singular, right = _dual_point(root, result.x)
    scale = float(diagonal.max())
    primal = root_trace * scale
    strategy = np.sqrt(singular)[:, None] * right / np.sqrt(result.x * scale)
    return strategy, (primal - (-result.fun)) / primal


def convex_optimum(workload, *, cache_dir: Optional[str] = None) -> Strategy:
    """The optimal Gaussian strategy for ``workload`` (dense; up to MAX_CELLS cells), cached
    per workload in memory and on disk (cache.py)."""
    workload = as_workload(workload)
    if workload.cells > MAX_CELLS:
        raise ValueError(f"{workload.cells} cells: the convex program is solved up to "
                         f"{MAX_CELLS} cells (an n x n eigendecomposition per step)")
    return _cached_convex_optimum(workload, cache.cache_directory(cache_dir))


@functools.lru_cache(maxsize=32)
def _cached_convex_optimum(workload: Workload, directory: Optional[str]) -> Strategy:
    def build() -> Strategy:
        start = time.perf_counter()
        matrix, gap = optimal_gram_strategy(workload.gram())
        return Strategy((matrix,), "convex optimum", time.perf_counter() - start, gap)
    return disk_cached(workload, {"family": "convex optimum"}, directory, build)
