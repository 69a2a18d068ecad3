"""Workload-optimal counting queries: the (adaptive) matrix mechanism (Li & Miklau, PVLDB 2012).

    workload = workload.all_ranges(64)                  # queries as a (structured) matrix
    strategy = best_strategy(workload).strategy         # data independent; .family says which
    expected_rmse(workload, strategy, epsilon, delta)   # closed form (error.py)
    answer_workload(workload, strategy, histogram, epsilon=..., delta=...)   # the release

workload.py: the frozen workload spec (blocks, Kronecker terms, constructors); strategy.py:
strategies and Eigen-Design (Programs 1 and 2, speed-ups, Kronecker products) with their
derivations; marginals.py: weighted-marginal strategies (HDMM's OPT_M) in closed form; union.py:
unions of product strategies (OPT_+); convex.py: the convex optimum for up to 512 cells;
online.py: the online square-root strategy (DP-SQLP's BLT encoder) for a stream's prefixes
and ranges; selection.py: the family of least expected error per workload (best_strategy);
cache.py: the durable strategy cache; error.py: expected error and the SVD lower bound;
mechanism.py: the release.
"""
from sage_tfx.dp_statistics.matrix import workload
from sage_tfx.dp_statistics.matrix.error import (expected_rmse, laplace_expected_rmse,
                                                 query_rmse, svd_lower_bound_rmse)
from sage_tfx.dp_statistics.matrix.marginals import MarginalStrategy, opt_marginals
from sage_tfx.dp_statistics.matrix.mechanism import Noise, WorkloadRelease, answer_workload
from sage_tfx.dp_statistics.matrix.selection import CANDIDATES, Candidate, best_strategy
from sage_tfx.dp_statistics.matrix.strategy import (LinearStrategy, Strategy,
                                                    UnsupportedWorkload, eigen_design,
                                                    hierarchical, identity, online_square_root,
                                                    wavelet,
                                                    workload_as_strategy)
from sage_tfx.dp_statistics.matrix.workload import Block, BlockKind, DomainError, Workload

__all__ = ["workload", "expected_rmse", "laplace_expected_rmse", "query_rmse",
           "svd_lower_bound_rmse", "MarginalStrategy", "opt_marginals", "LinearStrategy",
           "CANDIDATES", "Candidate", "best_strategy", "Noise", "WorkloadRelease",
           "answer_workload", "Strategy", "UnsupportedWorkload", "eigen_design", "hierarchical",
           "identity", "online_square_root", "wavelet", "workload_as_strategy", "Block",
           "BlockKind", "DomainError", "Workload"]
