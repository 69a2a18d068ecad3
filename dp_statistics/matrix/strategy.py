"""Strategies (the queries that get the noise) and their selection: Eigen-Design (Li & Miklau,
"An Adaptive Mechanism for Accurate Query Answering under Differential Privacy", PVLDB 2012).

A strategy is a matrix A (p x n) whose columns cover the cells; it is stored as Kronecker factors
A = A_1 (x) ... (x) A_k, one per attribute, or as one factor over all n cells. With X = (A^T A)^+,
the least-squares estimate x_hat = A^+ (A x + z) answers every query of W as W x_hat, and

    error^2 of W = sigma^2 trace(W X W^T) = sigma^2 trace(W^T W X)          (paper Prop. 4)

when W's rows lie in A's row space (otherwise A does not support W: refused). For Kronecker
factors, column norms, pseudo-inverses and traces factor:
||A||_col = prod_i ||A_i||_col, X = (x)_i X_i and trace((x)_i G_i X_i) = prod_i trace(G_i X_i).

Eigen-Design (paper §3, reconstructed)
--------------------------------------
Program 1 (optimal weighting of design queries). Let W^T W = Q^T D Q (eigen-queries: the rows q_i
of Q, eigenvalues c_i > 0). The strategy A = diag(sqrt(u)) Q has A^T A = Q^T diag(u) Q, so

    trace(W^T W (A^T A)^-1) = sum_i c_i / u_i,    ||A||_col^2 = max_j sum_i u_i Q_ij^2.

The error is homogeneous in u (degree 0 after the sensitivity), so fix the sensitivity at 1:

    minimise sum_i c_i / u_i   subject to   S^T u <= 1,  u >= 0,   S = Q o Q (entrywise squares),

which is the paper's SDP (the 2x2 constraint [[u_i, 1], [1, v_i]] >= 0 is v_i >= 1 / u_i). We
solve its Lagrange dual with scipy's L-BFGS-B (bound-constrained quasi-Newton; not a hand-rolled
solver). The Lagrangian sum_i (c_i / u_i + u_i (S mu)_i) - 1^T mu is minimised by
u_i = sqrt(c_i / (S mu)_i), giving the concave dual

    g(mu) = 2 sum_i sqrt(c_i (S mu)_i) - 1^T mu,   mu >= 0,   grad g = S^T u(mu) - 1,

(the gradient is the constraint's slack). Slater holds (small u is strictly feasible), so
max g = min of Program 1. We rescale u(mu*) to be exactly feasible (max_j (S^T u)_j = 1): the
returned strategy is valid whatever the solver's accuracy, and g(mu*) is a certificate: the
primal value is within ``duality_gap`` of the optimum over these design queries.

Program 2 (completion). A' = diag(sqrt(u)) Q may have columns shorter than its sensitivity;
adding the rows sqrt(max_j m_j - m_i) e_i (m_i the squared column norms) raises no column above
the maximum and only adds information, so the error cannot grow.

Speed-ups (paper §4.2), both instances of the same weighted problem over GROUPS of eigen-queries
(a group shares one scale t_g: cost c_g = sum_{i in g} c_i / u_i, column load sum_{i in g} u_i S_i):
* eigen-query separation: eigen-queries in eigenvalue order, groups of ``separation_group``;
  Program 1 within each group (the others' eigenvalues set to 0), then Program 1 over the groups;
* principal vectors: the largest ``k`` eigen-queries get their own weight, the others share one.

The SVD lower bound (paper Thm. 2): for any A, ||A||_col^2 >= trace(A^T A) / n and
min_X trace(X) trace(G X^-1) = (trace G^{1/2})^2 (Cauchy-Schwarz in the eigenbasis), so
||A||_col^2 trace(G (A^T A)^+) >= (sum_i sqrt(c_i))^2 / n for every strategy supporting W.

Kronecker product workloads (beyond the paper; HDMM's OPT_(x), McKenna et al. VLDB 2018): for a
union of product terms W_t = (x)_i B_ti and a product strategy, the objective is
prod_i ||A_i||^2 * sum_t prod_i trace(G_ti X_i). With all factors but i fixed it is, up to a
constant, ||A_i||^2 trace((sum_t c_t G_ti) X_i) with c_t = prod_{k != i} trace(G_tk X_k): an
Eigen-Design problem on one attribute. We cycle over the attributes and keep the best iterate.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Optional, Sequence

import numpy as np
import scipy.optimize

from sage_tfx.dp_statistics.matrix import cache
from sage_tfx.dp_statistics.matrix.workload import Block, DomainError, Workload, explicit

# Eigenvalues below this fraction of the largest are zero (rank-deficient workloads, §4.1).
_ZERO_EIGENVALUE = 1e-10
_SUPPORT_TOLERANCE = 1e-7
_NEGLIGIBLE_COMPLETION = 1e-3
# Eigenvalues of A_i^T A_i below this fraction of the largest are rounding noise (pinv cut-off).
_PINV_CUTOFF = 1e-10


class UnsupportedWorkload(ValueError):
    """The strategy's row space misses some query of the workload (a singular strategy)."""


class LinearStrategy:
    """What the mechanism and the error need of a strategy A (p x n), whatever its structure:
    ``name``, ``l2_sensitivity`` / ``l1_sensitivity`` (max column norms), ``apply`` (A x),
    ``require_support``, ``trace`` (trace(W^T W X) for the strategy's estimator covariance X),
    ``query_variances`` and ``answer`` (the workload's answers from noisy strategy answers)."""
    name: str

    def answer(self, workload: Workload, noisy: np.ndarray):
        """(W x_hat, x_hat) with x_hat = A^+ y, the least-squares estimate: every answer is W
        times one vector, so the answers are consistent."""
        estimate = self.reconstruct(noisy)
        return workload.answer(estimate), estimate


@dataclasses.dataclass(frozen=True, eq=False)
class Strategy(LinearStrategy):
    """A = (x)_i factors[i]: one factor per attribute, or one factor over all cells.

    ``name`` says how it was chosen; ``selection_seconds`` and ``duality_gap`` (Eigen-Design's
    certificate, relative) describe the selection."""
    factors: tuple[np.ndarray, ...] = dataclasses.field(repr=False)
    name: str = ""
    selection_seconds: float = 0.0
    duality_gap: Optional[float] = None

    def __post_init__(self):
        factors = []
        for factor in self.factors:
            factor = np.array(factor, dtype=np.float64)
            if factor.ndim != 2 or not np.all(np.isfinite(factor)):
                raise ValueError(f"a strategy factor must be a finite matrix, got {factor.shape}")
            factor.setflags(write=False)
            factors.append(factor)
        object.__setattr__(self, "factors", tuple(factors))

    @property
    def cell_shape(self) -> tuple[int, ...]:
        return tuple(f.shape[1] for f in self.factors)

    @property
    def query_count(self) -> int:
        return int(np.prod([f.shape[0] for f in self.factors]))

    @property
    def l2_sensitivity(self) -> float:
        """max_j ||A e_j||_2: adding or removing one record moves one cell of x by 1."""
        return float(np.prod([np.sqrt(np.max(np.sum(f ** 2, axis=0))) for f in self.factors]))

    @property
    def l1_sensitivity(self) -> float:
        """max_j ||A e_j||_1 (the Laplace variant)."""
        return float(np.prod([np.max(np.sum(np.abs(f), axis=0)) for f in self.factors]))

    def matrix(self) -> np.ndarray:
        return functools.reduce(np.kron, self.factors)

    @functools.cached_property
    def covariances(self) -> tuple[np.ndarray, ...]:
        """X_i = (A_i^T A_i)^+ per factor (X = (x)_i X_i)."""
        return tuple(np.linalg.pinv(f.T @ f, rcond=_PINV_CUTOFF, hermitian=True)
                     for f in self.factors)

    @functools.cached_property
    def _pseudo_inverses(self) -> tuple[np.ndarray, ...]:
        return tuple(np.linalg.pinv(f) for f in self.factors)

    def _check_cells(self, workload: Workload) -> None:
        if self.cell_shape not in (workload.sizes, (workload.cells,)):
            raise DomainError(f"the strategy covers cells {self.cell_shape}; the workload's "
                              f"domain is {workload.sizes}")

    def apply(self, data_vector: np.ndarray) -> np.ndarray:
        """A x (flat), x a flat vector over the strategy's cells."""
        values = np.asarray(data_vector, dtype=np.float64).reshape(self.cell_shape)
        for axis, factor in enumerate(self.factors):
            values = np.moveaxis(np.tensordot(factor, values, axes=(1, axis)), 0, axis)
        return values.reshape(-1)

    def reconstruct(self, answers: np.ndarray) -> np.ndarray:
        """x_hat = A^+ y, the least-squares (minimum-norm) estimate of the cells;
        (x)_i A_i^+ is the pseudo-inverse of (x)_i A_i."""
        values = np.asarray(answers, dtype=np.float64).reshape([f.shape[0] for f in self.factors])
        for axis, inverse in enumerate(self._pseudo_inverses):
            values = np.moveaxis(np.tensordot(inverse, values, axes=(1, axis)), 0, axis)
        return values.reshape(-1)

    def require_support(self, workload: Workload) -> None:
        """Refuse (UnsupportedWorkload) unless every query of W lies in A's row space, i.e.
        G (I - X A^T A) = 0 for each term's Gram G (each is PSD, so the union is supported iff
        every term is; for factored terms, iff every factor is)."""
        self._check_cells(workload)
        for index, term in enumerate(workload.terms):
            grams = self._term_factors(workload, term, [b.gram() for b in term])
            for gram, projector in zip(grams, self._row_space_projectors):
                residual = np.linalg.norm(gram - gram @ projector)
                if residual > _SUPPORT_TOLERANCE * max(1.0, np.linalg.norm(gram)):
                    raise UnsupportedWorkload(
                        f"strategy {self.name!r} is singular for this workload: term {index}'s "
                        f"queries are not in its row space (residual {residual:.3g}); its "
                        f"answers cannot be derived from the strategy's")

    @functools.cached_property
    def _row_space_projectors(self) -> tuple[np.ndarray, ...]:
        """X_i A_i^T A_i per factor: the projector onto A_i's row space."""
        return tuple(x @ (f.T @ f) for x, f in zip(self.covariances, self.factors))

    def _term_factors(self, workload: Workload, term: tuple[Block, ...], per_block: list):
        """A term's per-block matrices, combined to match the strategy's factors."""
        if len(self.factors) == len(term):
            return per_block
        if len(self.factors) == 1:
            return [functools.reduce(np.kron, per_block)]
        raise DomainError(f"strategy {self.name!r} is a product over attributes; a flat term "
                          f"over all {workload.cells} cells needs a flat strategy")

    def trace(self, workload: Workload) -> float:
        """trace(W^T W (A^T A)^+) = sum_t prod_i trace(G_ti X_i)."""
        total = 0.0
        for term in workload.terms:
            grams = self._term_factors(workload, term, [b.gram() for b in term])
            total += float(np.prod([np.sum(g * x) for g, x in zip(grams, self.covariances)]))
        return total

    def query_variances(self, workload: Workload) -> np.ndarray:
        """diag(W X W^T) in query order (each query's error variance per unit sigma^2)."""
        variances = []
        for term in workload.terms:
            if len(self.factors) == len(term):
                forms = [b.quadratic_forms(x) for b, x in zip(term, self.covariances)]
                variances.append(functools.reduce(np.multiply.outer, forms).reshape(-1))
            else:
                rows = functools.reduce(np.kron, [b.dense() for b in term])
                covariance = functools.reduce(np.kron, self.covariances)
                variances.append(np.einsum("ij,jk,ik->i", rows, covariance, rows))
        return np.concatenate(variances)


def as_strategy(strategy, name: str = "explicit") -> LinearStrategy:
    """A strategy, or a numpy matrix (p x n) taken as one factor over all cells."""
    if isinstance(strategy, LinearStrategy):
        return strategy
    return Strategy((np.asarray(strategy, dtype=np.float64),), name)


# --- the competitors: identity, the workload itself, hierarchical, wavelet ---

def _per_attribute(workload: Workload, build, name: str) -> Strategy:
    return Strategy(tuple(build(size) for size in workload.sizes), name)


def identity(workload: Workload) -> Strategy:
    """Every cell once (the Gaussian mechanism on the histogram)."""
    return _per_attribute(workload, np.eye, "identity")


def workload_as_strategy(workload: Workload) -> Strategy:
    """W itself as the strategy (the Gaussian mechanism on the workload's answers)."""
    if len(workload.terms) == 1 and len(workload.terms[0]) == len(workload.sizes):
        return Strategy(tuple(b.dense() for b in workload.terms[0]), "workload")
    return Strategy((workload.dense(),), "workload")


def haar(size: int) -> np.ndarray:
    """The (unnormalised) Haar wavelet of paper Fig. 2: the total, then per node of the dyadic
    tree +1 on its left half and -1 on its right. A size that is not a power of two is padded
    to one and the padding columns dropped (rows left empty are removed)."""
    padded = 1 << max(0, math.ceil(math.log2(size)))
    rows = [np.ones(padded)]
    width = padded
    while width > 1:
        for start in range(0, padded, width):
            row = np.zeros(padded)
            row[start:start + width // 2] = 1.0
            row[start + width // 2:start + width] = -1.0
            rows.append(row)
        width //= 2
    matrix = np.array(rows)[:, :size]
    return matrix[np.any(matrix != 0, axis=1)]


def hierarchy(size: int, branching: int = 2) -> np.ndarray:
    """Hay et al.'s H_b: the sum of every node of a b-ary tree over the cells (root = total,
    each node split into ``branching`` near-equal parts down to single cells)."""
    if branching < 2:
        raise ValueError(f"a hierarchy needs branching >= 2, got {branching}")
    rows = []

    def split(start: int, stop: int) -> None:
        row = np.zeros(size)
        row[start:stop] = 1.0
        rows.append(row)
        if stop - start > 1:
            bounds = np.linspace(start, stop, min(branching, stop - start) + 1).round()
            for low, high in zip(bounds[:-1], bounds[1:]):
                split(int(low), int(high))
    split(0, size)
    return np.array(rows)


def wavelet(workload: Workload) -> Strategy:
    """Haar wavelet on each attribute (Xiao et al.'s Privelet, multi-dimensional by product)."""
    return _per_attribute(workload, haar, "wavelet")


def hierarchical(workload: Workload, branching: int = 2) -> Strategy:
    """H_b on each attribute (multi-dimensional by product, as the paper adapts it)."""
    return _per_attribute(workload, functools.partial(hierarchy, branching=branching),
                          f"hierarchical(b={branching})")


# --- Program 1 over groups of design queries, by its dual ---

@dataclasses.dataclass(frozen=True)
class Weights:
    scales: np.ndarray      # t_g, exactly feasible: max_j sum_g t_g loads[g, j] == 1
    primal: float           # sum_g costs[g] / t_g at those scales
    dual: float             # g(mu*) <= the optimum: the certificate

    @property
    def duality_gap(self) -> float:
        return (self.primal - self.dual) / self.primal


def optimal_weights(costs: np.ndarray, loads: np.ndarray) -> Weights:
    """min sum_g costs[g] / t_g s.t. loads^T t <= 1, t >= 0 (Program 1; module docstring),
    via the concave dual maximised by scipy's L-BFGS-B. costs > 0; loads (groups x cells) >= 0
    with every group loading some cell."""
    costs = np.asarray(costs, dtype=np.float64)
    loads = np.asarray(loads, dtype=np.float64)

    def negative_dual(mu):
        load = np.maximum(loads @ mu, 1e-300)
        scales = np.sqrt(costs / load)
        return -(2.0 * np.sum(np.sqrt(costs * load)) - mu.sum()), -(loads.T @ scales - 1.0)

    cells = loads.shape[1]
    # Start at the optimum's scale: g(t mu) is maximised over t where 1^T mu = g(mu), and with
    # uniform column loads the optimum is (sum_g sqrt(costs_g))^2 / cells (the SVD bound).
    start = np.full(cells, np.sum(np.sqrt(costs)) ** 2 / cells ** 2)
    result = scipy.optimize.minimize(
        negative_dual, start, jac=True, method="L-BFGS-B",
        bounds=[(0.0, None)] * cells,
        # A relative dual gap near 1e-4 in trace terms is 5e-5 in RMSE; tighter tolerances
        # cost 4x the iterations at 2048 cells (measured 6 s against 26 s).
        options={"maxiter": 20_000, "maxcor": 30, "ftol": 1e-10, "gtol": 1e-7})
    load = np.maximum(loads @ result.x, 1e-300)
    scales = np.sqrt(costs / load)
    scales /= np.max(loads.T @ scales)
    return Weights(scales, float(np.sum(costs / scales)), float(-result.fun))


def _eigen_queries(gram: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(eigenvalues c_i > 0, eigen-queries as rows), largest first."""
    values, vectors = np.linalg.eigh(gram)
    keep = values > _ZERO_EIGENVALUE * max(values.max(), 1e-300)
    order = np.argsort(values[keep])[::-1]
    return values[keep][order], vectors[:, keep][:, order].T


def _grouped_weights(costs, loads, groups: Sequence[np.ndarray]) -> tuple[np.ndarray, Weights]:
    """Per-eigen-query weights when each group of eigen-queries shares one scale on top of
    ``within`` weights (1 unless set by the group's own Program 1)."""
    within = np.ones(costs.size)
    for group in groups:
        if group.size > 1:
            within[group] = optimal_weights(costs[group], loads[group]).scales
    group_costs = np.array([np.sum(costs[g] / within[g]) for g in groups])
    group_loads = np.array([within[g] @ loads[g] for g in groups])
    combined = optimal_weights(group_costs, group_loads)
    weights = np.empty(costs.size)
    for group, scale in zip(groups, combined.scales):
        weights[group] = scale * within[group]
    return weights, combined


def eigen_design_matrix(gram: np.ndarray, *, separation_group: Optional[int] = None,
                        principal_count: Optional[int] = None) -> tuple[np.ndarray, Weights]:
    """Program 2 on a Gram matrix W^T W: (strategy A, Program 1's weights and certificate)."""
    if separation_group is not None and principal_count is not None:
        raise ValueError("choose eigen-query separation or principal vectors, not both")
    costs, queries = _eigen_queries(gram)
    loads = queries ** 2
    if separation_group is not None:
        groups = [np.arange(s, min(s + separation_group, costs.size))
                  for s in range(0, costs.size, separation_group)]
        weights, certificate = _grouped_weights(costs, loads, groups)
    elif principal_count is not None and principal_count < costs.size:
        # Principal singletons, then one group for the rest with within-weights 1 (one weight).
        groups = [np.array([i]) for i in range(principal_count)]
        groups.append(np.arange(principal_count, costs.size))
        weights, certificate = _grouped_weights(costs, loads, groups)
    else:
        certificate = optimal_weights(costs, loads)
        weights = certificate.scales
    # u = 1 is feasible (Q is orthogonal: every column's load is 1) and is the identity
    # rotated; keeping the better of it makes "never worse than identity" exact, whatever the
    # solver's tolerance.
    if np.sum(costs) <= np.sum(costs / weights):
        weights = np.ones_like(costs)
    designed = np.sqrt(weights)[:, None] * queries
    column_loads = np.sum(designed ** 2, axis=0)
    completion = np.sqrt(np.maximum(column_loads.max() - column_loads, 0.0))
    # A completion row adds completion^2 of information; below 1e-6 of the sensitivity^2 it is
    # negligible, and it would only make (A^T A)^+ ill-conditioned.
    extra = np.nonzero(completion > _NEGLIGIBLE_COMPLETION * np.sqrt(column_loads.max()))[0]
    completed = np.zeros((extra.size, gram.shape[0]))
    completed[np.arange(extra.size), extra] = completion[extra]
    return np.vstack([designed, completed]), certificate


def _kronecker_eigen_design(workload: Workload, rounds: int, **options) -> Strategy:
    """OPT_(x) by block coordinate descent over the attributes (module docstring)."""
    grams = [[block.gram() for block in term] for term in workload.terms]
    attributes = range(len(workload.sizes))
    factors = [eigen_design_matrix(sum(g[i] for g in grams), **options)[0] for i in attributes]

    def objective(factors):
        strategy = Strategy(tuple(factors), "candidate")
        return strategy.l2_sensitivity ** 2 * strategy.trace(workload)

    best, best_value = list(factors), objective(factors)
    for _ in range(rounds):
        for i in attributes:
            covariances = Strategy(tuple(factors), "candidate").covariances
            weighted = sum(
                np.prod([np.sum(g[k] * covariances[k]) for k in attributes if k != i]) * g[i]
                for g in grams)
            factors[i] = eigen_design_matrix(weighted, **options)[0]
        value = objective(factors)
        if value < best_value * (1 - 1e-9):
            best, best_value = list(factors), value
        else:
            break
    return Strategy(tuple(best), "eigen-design (kronecker)")


def eigen_design(workload, *, separation_group: Optional[int] = None,
                 principal_fraction: Optional[float] = None,
                 kronecker: Optional[bool] = None, rounds: int = 4,
                 cache_dir: Optional[str] = None) -> Strategy:
    """The Eigen-Design strategy for ``workload`` (paper Program 2; module docstring).

    Data independent (it reads only the queries), so it is cached per workload and options: in
    memory (the Workload's fingerprint is its hash) and on disk (cache.py: ``cache_dir``, else
    $SAGE_TFX_CACHE/strategies or ~/.cache/sage-tfx/strategies), so a pipeline's components and
    CLI calls, each a fresh process, pay the optimisation once.

    separation_group: eigen-query separation with groups of that size (§4.2);
    principal_fraction: principal vectors, that fraction of the eigen-queries weighted alone;
    kronecker: a product of per-attribute strategies (default: for product workloads of more
    than 4096 cells, where the n x n Gram would not fit), cycling ``rounds`` times."""
    return _cached_eigen_design(as_workload(workload), separation_group, principal_fraction,
                                kronecker, rounds, cache.cache_directory(cache_dir))


@functools.lru_cache(maxsize=32)
def _cached_eigen_design(workload: Workload, separation_group, principal_fraction, kronecker,
                         rounds, directory: Optional[str]) -> Strategy:
    options = {"separation_group": separation_group, "principal_fraction": principal_fraction,
               "kronecker": kronecker, "rounds": rounds}
    return disk_cached(workload, options, directory, lambda: _eigen_design(
        workload, separation_group, principal_fraction, kronecker, rounds))


def _factor_arrays(strategy: Strategy) -> dict:
    return {f"factor_{i}": factor for i, factor in enumerate(strategy.factors)}


def _factor_strategy(workload: Workload, stored: cache.Stored) -> Strategy:
    factors = [stored.arrays[f"factor_{i}"] for i in range(len(stored.arrays))]
    cells = tuple(f.shape[1] if f.ndim == 2 else -1 for f in factors)
    if cells not in (workload.sizes, (workload.cells,)) or any(
            f.ndim != 2 or f.shape[0] == 0 for f in factors):
        raise ValueError(f"cached factors over {cells} cells do not fit {workload.sizes}")
    return Strategy(tuple(factors), stored.name, stored.selection_seconds, stored.duality_gap)


def disk_cached(workload: Workload, options: dict, directory: Optional[str], build, *,
                encode=_factor_arrays, decode=_factor_strategy):
    """The strategy cached on disk for (workload, options) (cache.py), else ``build()``'s,
    stored; no disk cache when ``directory`` is None. ``encode`` gives the arrays a strategy is
    kept as and ``decode(workload, stored)`` rebuilds it, raising ValueError (or KeyError) when
    the arrays do not fit the workload (then it is recomputed); the defaults keep a product's
    factors."""
    stored = cache.load(directory, workload, options) if directory else None
    if stored is not None:
        try:
            return decode(workload, stored)
        except (KeyError, ValueError):  # arrays that are not this family's or do not fit
            pass
    strategy = build()
    if directory:
        cache.store(directory, workload, options, encode(strategy), strategy)
    return strategy


def _eigen_design(workload: Workload, separation_group, principal_fraction, kronecker,
                  rounds) -> Strategy:
    start = time.perf_counter()
    options = {"separation_group": separation_group}
    if principal_fraction is not None:
        if not 0 < principal_fraction <= 1:
            raise ValueError(f"principal_fraction must lie in (0, 1], got {principal_fraction}")
        if separation_group is not None:
            raise ValueError("choose eigen-query separation or principal vectors, not both")
        options = {"principal_count": None}
    if kronecker is None:
        kronecker = workload.is_product() and workload.cells > 4096
    if kronecker:
        if not workload.is_product():
            raise ValueError("a Kronecker strategy needs a product workload (one block per "
                             "attribute in every term)")
        if principal_fraction is not None:
            raise ValueError("principal vectors are not combined with Kronecker strategies")
        strategy = _kronecker_eigen_design(workload, rounds, **options)
        gap = None
    else:
        if workload.cells > 8192:
            raise ValueError(f"{workload.cells} cells: a dense Eigen-Design would need an "
                             f"n x n eigendecomposition; use a product workload (kronecker)")
        gram = workload.gram()
        if principal_fraction is not None:
            rank = _eigen_queries(gram)[0].size
            options["principal_count"] = max(1, round(principal_fraction * rank))
        matrix, certificate = eigen_design_matrix(gram, **options)
        strategy = Strategy((matrix,), "eigen-design")
        gap = certificate.duality_gap
    return dataclasses.replace(strategy, selection_seconds=time.perf_counter() - start,
                               duality_gap=gap)


def online_square_root(workload) -> Strategy:
    """The online square-root factorization for prefix and range workloads in a stream
    (online.py): lower-triangular, so each answer needs only the steps so far."""
    from sage_tfx.dp_statistics.matrix.online import square_root_strategy
    return square_root_strategy(as_workload(workload))


def as_workload(workload) -> Workload:
    """A Workload, or a numpy query matrix (m x n) over one attribute of n cells."""
    return workload if isinstance(workload, Workload) else explicit(workload)
