"""Workload-optimal counting queries: the (adaptive) matrix mechanism (Li & Miklau, PVLDB 2012).

    workload = workload.all_ranges(64)                  # queries as a (structured) matrix
    strategy = eigen_design(workload)                   # data independent, cached (cache.py)
    expected_rmse(workload, strategy, epsilon, delta)   # closed form (error.py)
    answer_workload(workload, strategy, histogram, epsilon=..., delta=...)   # the release

workload.py: the frozen workload spec (blocks, Kronecker terms, constructors); strategy.py:
strategies and Eigen-Design (Programs 1 and 2, speed-ups, Kronecker products) with their
derivations; cache.py: the durable strategy cache; error.py: expected error and the SVD
lower bound; mechanism.py: the release.
"""
from sage_tfx.dp_statistics.matrix import workload
from sage_tfx.dp_statistics.matrix.error import (expected_rmse, laplace_expected_rmse,
                                                 query_rmse, svd_lower_bound_rmse)
from sage_tfx.dp_statistics.matrix.mechanism import Noise, WorkloadRelease, answer_workload
from sage_tfx.dp_statistics.matrix.strategy import (Strategy, UnsupportedWorkload, eigen_design,
                                                    hierarchical, identity, online_square_root,
                                                    wavelet,
                                                    workload_as_strategy)
from sage_tfx.dp_statistics.matrix.workload import Block, BlockKind, DomainError, Workload

__all__ = ["workload", "expected_rmse", "laplace_expected_rmse", "query_rmse",
           "svd_lower_bound_rmse", "Noise", "WorkloadRelease", "answer_workload", "Strategy",
           "UnsupportedWorkload", "eigen_design", "hierarchical", "identity", "online_square_root",
           "wavelet", "workload_as_strategy", "Block", "BlockKind", "DomainError", "Workload"]
