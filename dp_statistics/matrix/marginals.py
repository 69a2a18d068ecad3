"""Weighted-marginal strategies: HDMM's OPT_M (McKenna, Miklau, Hay and Machanavajjhala,
"Optimizing error of high-dimensional statistical queries under differential privacy", PVLDB
11(10) 2018, §6), derived here for the Gaussian mechanism (L2 sensitivity).

The strategy
------------
Over d attributes of sizes n_1..n_d (N = prod n_i cells), the marginal on a subset a of the
attributes is M_a = (x)_i (I_{n_i} if i in a else 1^T): one count per combination of a's values.
A weighted-marginal strategy stacks all 2^d of them, A = [sqrt(u_a) M_a]_a, u >= 0 (u_a = 0 drops
M_a). Every cell lies in exactly one cell of each marginal, so each column of A holds sqrt(u_a)
once per a:

    ||A||_2^2 = sum_a u_a  (L2, Gaussian),      ||A||_1 = sum_a sqrt(u_a)  (L1, Laplace).

The marginal algebra
--------------------
A^T A = sum_a u_a C_a with C_a = M_a^T M_a = (x)_i (I if i in a else J), J = 1 1^T. Per attribute,
P0 = I - J/n_i (differences) and P1 = J/n_i (the mean) are orthogonal projections with
P0 + P1 = I, so the E_b = (x)_i (P0 if i in b else P1), b a subset of the attributes, are
orthogonal projections summing to the identity, and (I = P0 + P1, J = n_i P1)

    C_a = (prod_{i not in a} n_i) sum_{b subset of a} E_b,
    A^T A = sum_b lambda_b E_b,   lambda_b = N sum_{a superset of b} u_a / n_a   (n_a = prod_{i in a} n_i).

So (A^T A)^+ = sum_{lambda_b > 0} E_b / lambda_b, and for any workload that is a union of product
terms W_t = (x)_i B_ti (G_ti = B_ti^T B_ti), trace(W^T W E_b) = sum_t prod_i trace(G_ti P_{b_i})
=: omega_b, with trace(G P1) = 1^T G 1 / n and trace(G P0) = trace(G) - trace(G P1). Hence the
exact closed form (no approximation of W's Gram, unlike HDMM's MarginalsGram.approximate, which
is exact only for marginal workloads)

    trace(W^T W (A^T A)^+) = sum_b omega_b / lambda_b(u),

supported iff lambda_b > 0 wherever omega_b > 0. The superset sums over b and the subset sums of
the gradient are zeta transforms over the 2^d subsets, O(d 2^d) each: 14 attributes (Adult,
1.1e14 cells) is 16,384 weights, a few milliseconds per evaluation.

OPT_M for the Gaussian mechanism
--------------------------------
The error (error.py) is ||A||_2^2 trace(W^T W (A^T A)^+) = (1^T u) h(u), h(u) = sum_b omega_b /
lambda_b(u). h is convex (each lambda_b is linear in u, 1/x convex) and homogeneous of degree
-1, so the error is scale free and OPT_M is the CONVEX program min h(u) over the simplex
1^T u = 1, u >= 0. (HDMM parametrises by theta and is Laplace-first: for L1 the sensitivity^2 is
(sum_a sqrt(u_a))^2, not convex in u; its `approx=True` mode is this L2 objective, and its
published "marg" figures (hderror.csv) are in these units: sqrt of the error per query with unit
noise, our error.unit_rmse.)

This is an A-optimal design problem (the information matrix sum_a u_a C_a is linear in the
design weights u), and we solve it by the multiplicative algorithm of optimal design (Silvey,
Titterington and Torsney 1978): u_a <- u_a sqrt(-grad_a h(u)), renormalised to the simplex. By
homogeneity sum_a u_a (-grad_a h) = h, so its fixed points with u > 0 are exactly the points where
-grad_a h = h on the support, the KKT conditions. It needs no step size and is invariant to the
scale of each marginal (n_a spans 1 to 1.1e14 on Adult, which stalls L-BFGS-B on u: measured 0.17
relative gap after 42 s on Adult's 0-3-way marginals, against 8e-6 after 6 s here). We rely on no
convergence theorem: every result is certified. For convex h on the simplex,
h(v*) >= h(v) + min_a grad_a h(v) - grad h(v).v, and by homogeneity grad h(v).v = -h(v), so

    lower bound = 2 h(v) + min_a grad_a h(v)       (tight at the optimum, by the KKT conditions),

and ``duality_gap`` = (h(v) - bound) / h(v): the strategy is within that factor of the best
weighted-marginal strategy.

Answers: x_hat = (A^T A)^+ A^T y (least squares), computed in the algebra: A^T y = sum_a sqrt(u_a)
(y_a broadcast over the attributes outside a), then each E_b-component of it (per attribute a
mean or a difference from the mean) scaled by 1 / lambda_b. Per-query variances: for a term,
diag(W_t E_b W_t^T) = (x)_i diag(B_ti P_{b_i} B_ti^T), zero unless b lies in the attributes
where the term's block is not a total (diag(1^T P0 1) = 0).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from typing import Optional

import numpy as np

from sage_tfx.dp_statistics.matrix import cache
from sage_tfx.dp_statistics.matrix.strategy import (LinearStrategy, UnsupportedWorkload,
                                                    disk_cached)
from sage_tfx.dp_statistics.matrix.workload import DomainError, Workload

# omega_b below this fraction of the largest is rounding (a Gram's P0 trace of a total block).
_ZERO_OMEGA = 1e-12
# Weights below this fraction of the largest are dropped from the released strategy: they buy
# less than 1e-12 of the error and would add a whole marginal of rows each.
_NEGLIGIBLE_WEIGHT = 1e-12


def _subset_axes(values: np.ndarray, d: int) -> np.ndarray:
    """A copy of a length-2^d vector as an array of shape (2,)*d: axis i is attribute i (1: in
    the subset), the flat index the C-order one."""
    return np.array(values, dtype=np.float64).reshape((2,) * d if d else ())


def superset_sums(values: np.ndarray, d: int) -> np.ndarray:
    """s_b = sum_{a superset of b} values_a, for every subset b (flat, length 2^d)."""
    return _zeta(values, d, into=0)


def subset_sums(values: np.ndarray, d: int) -> np.ndarray:
    """s_a = sum_{b subset of a} values_b, for every subset a (flat, length 2^d)."""
    return _zeta(values, d, into=1)


def _zeta(values: np.ndarray, d: int, into: int) -> np.ndarray:
    """The zeta transform, attribute by attribute: the half of each axis with membership
    ``into`` gets the other half added (into=0: sums over supersets; 1: over subsets)."""
    table = _subset_axes(values, d)
    for axis in range(d):
        outside, inside = _halves(axis, d)
        target, source = (outside, inside) if into == 0 else (inside, outside)
        table[target] += table[source]
    return table.reshape(-1)


def _halves(axis: int, d: int):
    outside = [slice(None)] * d
    inside = [slice(None)] * d
    outside[axis], inside[axis] = 0, 1
    return tuple(outside), tuple(inside)


def subsets(d: int) -> np.ndarray:
    """Membership (2^d x d, bool): row b says which attributes subset b holds."""
    return np.array(list(itertools.product((False, True), repeat=d)), dtype=bool).reshape(-1, d)


def marginal_cells(sizes) -> np.ndarray:
    """n_a = prod_{i in a} n_i for every subset a."""
    return functools.reduce(np.multiply.outer, [np.array([1.0, s]) for s in sizes]).reshape(-1)


def workload_spectrum(workload: Workload) -> np.ndarray:
    """omega_b = trace(W^T W E_b) for every subset b (module docstring); product terms only."""
    if any(len(term) != len(workload.sizes) for term in workload.terms):
        raise UnsupportedWorkload("weighted marginals need a workload whose every term has one "
                                  "block per attribute")
    omega = np.zeros(2 ** len(workload.sizes))
    for term in workload.terms:
        per_attribute = []
        for block in term:
            gram = block.gram()
            mean_part = gram.sum() / block.size
            per_attribute.append(np.array([mean_part, max(np.trace(gram) - mean_part, 0.0)]))
        omega += functools.reduce(np.multiply.outer, per_attribute).reshape(-1)
    omega[omega < _ZERO_OMEGA * omega.max()] = 0.0
    return omega


@dataclasses.dataclass(frozen=True, eq=False)
class MarginalStrategy(LinearStrategy):
    """A = [sqrt(u_a) M_a] over the subsets a of the attributes with u_a > 0 (module
    docstring); ``weights`` is u, indexed by subset (C order of (2,)*d, 1 = attribute kept)."""
    sizes: tuple[int, ...]
    weights: np.ndarray = dataclasses.field(repr=False)
    name: str = "weighted marginals"
    selection_seconds: float = 0.0
    duality_gap: Optional[float] = None

    def __post_init__(self):
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        weights = np.array(self.weights, dtype=np.float64)
        if weights.shape != (2 ** len(self.sizes),) or not np.all(np.isfinite(weights)) \
                or np.any(weights < 0) or not np.any(weights > 0):
            raise ValueError(f"weighted marginals need 2^{len(self.sizes)} finite non-negative "
                             f"weights, not all zero; got shape {weights.shape}")
        weights.setflags(write=False)
        object.__setattr__(self, "weights", weights)

    @property
    def cell_shape(self) -> tuple[int, ...]:
        return self.sizes

    @property
    def kept(self) -> np.ndarray:
        """The subsets whose marginal is in the strategy."""
        return np.nonzero(self.weights > 0)[0]

    @property
    def query_count(self) -> int:
        return int(np.sum(marginal_cells(self.sizes)[self.kept]))

    @property
    def l2_sensitivity(self) -> float:
        return math.sqrt(float(np.sum(self.weights)))

    @property
    def l1_sensitivity(self) -> float:
        return float(np.sum(np.sqrt(self.weights)))

    @functools.cached_property
    def eigenvalues(self) -> np.ndarray:
        """lambda_b, the eigenvalue of A^T A on E_b, for every subset b."""
        cells = float(np.prod(self.sizes))
        return cells * superset_sums(self.weights / marginal_cells(self.sizes), len(self.sizes))

    @property
    def _inverse_eigenvalues(self) -> np.ndarray:
        lam = self.eigenvalues
        return np.divide(1.0, lam, out=np.zeros_like(lam), where=lam > 0)

    def _check_cells(self, workload: Workload) -> None:
        if tuple(workload.sizes) != self.sizes:
            raise DomainError(f"the strategy covers cells {self.sizes}; the workload's domain "
                              f"is {workload.sizes}")

    def require_support(self, workload: Workload) -> None:
        """Every query in A's row space: omega_b = 0 wherever lambda_b = 0."""
        self._check_cells(workload)
        missing = (workload_spectrum(workload) > 0) & (self.eigenvalues <= 0)
        if np.any(missing):
            raise UnsupportedWorkload(f"strategy {self.name!r} is singular for this workload: "
                                      f"{int(missing.sum())} of its components are not "
                                      f"measured by any kept marginal")

    def trace(self, workload: Workload) -> float:
        """trace(W^T W (A^T A)^+) = sum_b omega_b / lambda_b."""
        self._check_cells(workload)
        return float(np.sum(workload_spectrum(workload) * self._inverse_eigenvalues))

    def query_variances(self, workload: Workload) -> np.ndarray:
        """diag(W (A^T A)^+ W^T) in query order (module docstring)."""
        self._check_cells(workload)
        workload_spectrum(workload)  # refuses flat terms
        inverse = self._inverse_eigenvalues.reshape((2,) * len(self.sizes))
        variances = []
        for term in workload.terms:
            forms = []  # per attribute: (diag(B P1 B^T), diag(B P0 B^T))
            for block in term:
                mean = np.full((block.size, block.size), 1.0 / block.size)
                forms.append((block.quadratic_forms(mean),
                              block.quadratic_forms(np.eye(block.size) - mean)))
            active = [i for i, (_, differences) in enumerate(forms)
                      if np.any(np.abs(differences) > 1e-12 * max(1.0, np.abs(forms[i][0]).max()))]
            total = 0.0
            for chosen in itertools.product((0, 1), repeat=len(active)):
                index = [0] * len(self.sizes)
                for i, bit in zip(active, chosen):
                    index[i] = bit
                if inverse[tuple(index)] == 0.0:
                    continue
                total = total + inverse[tuple(index)] * functools.reduce(
                    np.multiply.outer, [f[index[i]] for i, f in enumerate(forms)])
            variances.append(np.broadcast_to(total, [b.query_count for b in term]).reshape(-1))
        return np.concatenate(variances)

    def _summed(self, values: np.ndarray, subset: int) -> np.ndarray:
        """The marginal of ``subset`` of a (sizes)-shaped array, kept dims of size 1 elsewhere."""
        membership = subsets(len(self.sizes))[subset]
        outside = tuple(i for i, kept in enumerate(membership) if not kept)
        return values.sum(axis=outside, keepdims=True) if outside else values

    def apply(self, data_vector: np.ndarray) -> np.ndarray:
        """A x: each kept marginal times sqrt(u_a), in subset order."""
        values = np.asarray(data_vector, dtype=np.float64).reshape(self.sizes)
        return np.concatenate([math.sqrt(self.weights[a]) * self._summed(values, a).reshape(-1)
                               for a in self.kept])

    def matrix(self) -> np.ndarray:
        """A, dense (tests, small domains)."""
        rows = []
        for a in self.kept:
            membership = subsets(len(self.sizes))[a]
            blocks = [np.eye(s) if kept else np.ones((1, s))
                      for s, kept in zip(self.sizes, membership)]
            rows.append(math.sqrt(self.weights[a]) * functools.reduce(np.kron, blocks))
        return np.vstack(rows)

    def reconstruct(self, answers: np.ndarray) -> np.ndarray:
        """x_hat = (A^T A)^+ A^T y, in the algebra (module docstring)."""
        answers = np.asarray(answers, dtype=np.float64)
        membership = subsets(len(self.sizes))
        back = np.zeros(self.sizes)
        offset = 0
        for a in self.kept:  # A^T y: each marginal's answers spread over its cells
            shape = [s if kept else 1 for s, kept in zip(self.sizes, membership[a])]
            count = int(np.prod(shape))
            back = back + math.sqrt(self.weights[a]) * answers[offset:offset + count].reshape(shape)
            offset += count
        # The E_b components, attribute by attribute: the mean along it (P1, kept as a size-1
        # axis) and the difference from that mean (P0).
        components = {(): back}
        for axis in range(len(self.sizes)):
            split = {}
            for bits, part in components.items():
                mean = part.mean(axis=axis, keepdims=True)
                split[bits + (0,)] = mean
                split[bits + (1,)] = part - mean
            components = split
        inverse = self._inverse_eigenvalues.reshape((2,) * len(self.sizes))
        estimate = np.zeros(self.sizes)
        for bits, part in components.items():
            if inverse[bits] != 0.0:
                estimate = estimate + inverse[bits] * part
        return estimate.reshape(-1)


def error_and_gradient(weights: np.ndarray, omega: np.ndarray, cells_of: np.ndarray, d: int):
    """h(u) = sum_b omega_b / lambda'_b(u), lambda'_b = sum_{a superset of b} u_a / n_a (the
    eigenvalues over N), and its gradient grad_a = -(1/n_a) sum_{b subset of a} omega_b /
    lambda'_b^2. Infinite where a measured component gets no weight."""
    scaled = superset_sums(weights / cells_of, d)
    measured = omega > 0
    if np.any(scaled[measured] <= 0):
        return math.inf, np.zeros_like(weights)
    ratio = np.zeros_like(omega)
    ratio[measured] = omega[measured] / scaled[measured]
    value = float(np.sum(ratio))
    pressure = np.zeros_like(omega)
    pressure[measured] = ratio[measured] / scaled[measured]
    return value, -subset_sums(pressure, d) / cells_of


def opt_marginals(workload: Workload, *, tolerance: float = 1e-6,
                  max_iterations: int = 20_000,
                  cache_dir: Optional[str] = None) -> MarginalStrategy:
    """OPT_M: the weighted-marginal strategy of least Gaussian error on ``workload`` (module
    docstring), with its certificate as ``duality_gap`` (at most ``tolerance`` unless the
    iterations ran out). Data independent, so cached per workload on disk (cache.py) as its
    weights: Adult's 0-3-way marginals take thousands of iterations (7 s), a load milliseconds
    (not in memory: a cache directory removed within the process is then written again)."""
    directory = cache.cache_directory(cache_dir)

    def rebuild(workload: Workload, stored: cache.Stored) -> MarginalStrategy:
        # MarginalStrategy refuses weights of the wrong length, negative or all zero
        return MarginalStrategy(tuple(workload.sizes), stored.arrays["weights"], stored.name,
                                stored.selection_seconds, stored.duality_gap)
    options = {"family": "OPT_M", "tolerance": tolerance, "max_iterations": max_iterations}
    return disk_cached(workload, options, directory,
                       lambda: _optimal_marginals(workload, tolerance, max_iterations),
                       encode=lambda strategy: {"weights": strategy.weights}, decode=rebuild)


def _optimal_marginals(workload: Workload, tolerance: float,
                       max_iterations: int) -> MarginalStrategy:
    start = time.perf_counter()
    d = len(workload.sizes)
    omega = workload_spectrum(workload)
    cells_of = marginal_cells(workload.sizes)
    # Start from the marginals over the components the workload measures, plus a little of
    # every other one: every component measured (a finite start), no weight exactly zero.
    weights = np.where(omega > 0, 1.0, 1e-3)
    weights /= weights.sum()
    gap = math.inf
    for iteration in range(max_iterations):
        value, gradient = error_and_gradient(weights, omega, cells_of, d)
        if iteration % 10 == 0:
            gap = (value - (2.0 * value + float(np.min(gradient)))) / value
            if gap <= tolerance:
                break
        weights = weights * np.sqrt(-gradient)
        weights /= weights.sum()
    pruned = np.where(weights < _NEGLIGIBLE_WEIGHT * weights.max(), 0.0, weights)
    if math.isfinite(error_and_gradient(pruned, omega, cells_of, d)[0]):
        weights = pruned / pruned.sum()
    value, gradient = error_and_gradient(weights, omega, cells_of, d)
    bound = 2.0 * value + float(np.min(gradient))
    return MarginalStrategy(tuple(workload.sizes), weights, "weighted marginals (OPT_M)",
                            time.perf_counter() - start, (value - bound) / value)
