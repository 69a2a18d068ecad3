"""Online strategies: prefix (CDF) and range workloads answered as the stream arrives (issue 34).

The matrix mechanism answers a workload W from noisy strategy answers A x + z. When the cells
are the steps of a stream (x_t = what arrived at step t) and A is LOWER-TRIANGULAR, answer t
depends only on x_1..x_t, and so does the least-squares estimate's prefix (A^{-1} is lower
triangular too): every prefix [1, t] and every range [a, t] can be released at step t, with no
later noise changing it. That is the online setting, where the offline optima (Eigen-Design, the
convex optimum) do not apply: their strategies mix future cells into early answers.

The strategy here is the encoder of DP-SQLP's BLT square-root factorization
(dp_statistics/continual/factorization.py, which derives it): A = C = B^{-1} P with P the
prefix-sum matrix and B the buffered-Toeplitz decoder fitted to the square root P^{1/2}. Then
the CDF estimate is P C^{-1} (C x + z) = P x + B z: each prefix's noise is the decoder's, made
with O(buffers) memory in a stream, and ||C||_col = ||c|| (the first column: C is Toeplitz).
Per unit sigma the CDF's total variance is sum_t sum_{k<t} b_k^2, within a few tenths of a per
cent of the exact square root's (factorization.py's fit); the least-squares machinery of
strategy.Strategy then answers prefixes, ranges or any other query of the same cells.
"""
from __future__ import annotations

from scipy.linalg import toeplitz

from sage_tfx.dp_statistics.continual import factorization
from sage_tfx.dp_statistics.matrix.workload import DomainError, Workload


def square_root_strategy(workload: Workload):
    """The online square-root strategy over the one ordered attribute of `workload` (its cells
    are the stream's steps, in order)."""
    from sage_tfx.dp_statistics.matrix.strategy import Strategy  # strategy.py registers us
    if len(workload.sizes) != 1:
        raise DomainError(f"an online strategy runs over one ordered attribute (the stream's "
                          f"steps); the workload has {len(workload.sizes)} attributes")
    steps = workload.sizes[0]
    fitted = factorization.fit_square_root(steps)
    encoder = fitted.encoder(steps)
    return Strategy((toeplitz(encoder, 0.0 * encoder),),
                    f"online square root (BLT, {len(fitted.decays)} buffers)")
