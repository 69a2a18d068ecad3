"""The strategy family per workload: every candidate that applies is built and scored by its
expected error, and the lowest wins; the chosen strategy's ``name`` says which family it is.

Choosing costs no privacy: every candidate and its score (error.unit_rmse, the RMSE per query at
unit noise, so the ranking is the same for every (epsilon, delta)) depend on the workload only.

A new family registers by appending one Candidate to CANDIDATES (a name, when it applies, how
it is built). Ties keep the earlier candidate (relative 1e-9).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from sage_tfx.dp_statistics.matrix import convex, error
from sage_tfx.dp_statistics.matrix.marginals import opt_marginals
from sage_tfx.dp_statistics.matrix.strategy import (LinearStrategy, UnsupportedWorkload,
                                                    as_workload, eigen_design,
                                                    online_square_root)
from sage_tfx.dp_statistics.matrix.union import opt_union
from sage_tfx.dp_statistics.matrix.workload import Workload

# Beyond this many terms OPT_+ costs more than it can win (one product strategy per term).
_UNION_MAX_TERMS = 512
# Eigen-Design's dense limit (strategy._eigen_design) for workloads with no product structure.
_DENSE_MAX_CELLS = 8192
# The online strategy's factor is a dense n x n Toeplitz matrix.
_ONLINE_MAX_CELLS = 1024


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A strategy family: ``applies(workload)`` says when it can be built (cheaply enough),
    ``build(workload, cache_dir)`` builds it."""
    family: str
    applies: Callable[[Workload], bool]
    build: Callable[[Workload, Optional[str]], LinearStrategy]


def _all_product_terms(workload: Workload) -> bool:
    return all(len(term) == len(workload.sizes) for term in workload.terms)


CANDIDATES: list[Candidate] = [
    Candidate("eigen-design",
              lambda w: w.cells <= _DENSE_MAX_CELLS or w.is_product(),
              lambda w, cache_dir: eigen_design(w, cache_dir=cache_dir)),
    Candidate("eigen-design (kronecker)",
              lambda w: w.is_product() and w.cells <= 4096,  # larger: the default above is it
              lambda w, cache_dir: eigen_design(w, kronecker=True, cache_dir=cache_dir)),
    Candidate("weighted marginals (OPT_M)", _all_product_terms,
              lambda w, cache_dir: opt_marginals(w, cache_dir=cache_dir)),
    Candidate("union of products (OPT_+)",
              lambda w: _all_product_terms(w) and 2 <= len(w.terms) <= _UNION_MAX_TERMS,
              lambda w, cache_dir: opt_union(w, cache_dir=cache_dir)),
    Candidate("convex optimum", lambda w: w.cells <= convex.MAX_CELLS,
              lambda w, cache_dir: convex.convex_optimum(w, cache_dir=cache_dir)),
    # Lower-triangular, so it also answers in a stream; offline it wins on large CDFs, where
    # the convex optimum is out of reach (1,024 cells: 13.14 against Eigen-Design's 15.63).
    Candidate("online square root", lambda w: len(w.sizes) == 1 and w.cells <= _ONLINE_MAX_CELLS,
              lambda w, cache_dir: online_square_root(w)),
]


@dataclasses.dataclass(frozen=True)
class Selection:
    """The chosen strategy and every candidate's RMSE per query at unit noise, by family."""
    strategy: LinearStrategy
    family: str
    unit_rmse: dict[str, float]


def best_strategy(workload, *, cache_dir: Optional[str] = None,
                  candidates: Optional[list[Candidate]] = None) -> Selection:
    """The candidate of least expected error on ``workload`` (module docstring)."""
    workload = as_workload(workload)
    scores, best, best_family = {}, None, None
    for candidate in CANDIDATES if candidates is None else candidates:
        if not candidate.applies(workload):
            continue
        try:
            built = candidate.build(workload, cache_dir)
            score = error.unit_rmse(workload, built)
        except ValueError:  # UnsupportedWorkload, DomainError, a domain too large for it
            continue        # a family that cannot answer this workload is no candidate
        scores[candidate.family] = score
        if best is None or score < scores[best_family] * (1 - 1e-9):
            best, best_family = built, candidate.family
    if best is None:
        raise UnsupportedWorkload("no strategy family applies to this workload")
    return Selection(best, best_family, scores)
