"""Weighted-marginal strategies (OPT_M, dp_statistics/matrix/marginals.py) and unions of
products (OPT_+, union.py) against brute force, and the picker (selection.py): the least
expected error wins and the release says which family.

The oracle is the dense strategy matrix A (its rows built here from np.kron of identities and
rows of ones, not by the module's algebra): sensitivities are its max column norms, the error
trace is trace(W^T W pinv(A^T A)), per-query variances diag(W pinv(A^T A) W^T) and the estimate
pinv(A) y. OPT_M's optimum is checked against a dense optimiser of the same objective (scipy's
SLSQP on the simplex) on a small domain. Deterministic linear algebra: no false failures beyond
rounding.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import scipy.optimize

from sage_tfx.dp_statistics.matrix import (Candidate, UnsupportedWorkload, answer_workload,
                                           best_strategy, error, strategy, workload)
from sage_tfx.dp_statistics.matrix.marginals import MarginalStrategy, opt_marginals
from sage_tfx.dp_statistics.matrix.union import opt_union
from sage_tfx.dp_statistics.matrix.workload import Block, BlockKind, Workload

SIZES = (3, 4, 2)


def dense_marginals(sizes, weights) -> np.ndarray:
    """A by brute force: subset a (C order of (2,)*d) -> sqrt(u_a) times its marginal rows."""
    rows = []
    for a, membership in enumerate(itertools.product((False, True), repeat=len(sizes))):
        if weights[a] > 0:
            blocks = [np.eye(n) if kept else np.ones((1, n)) for n, kept in zip(sizes, membership)]
            rows.append(np.sqrt(weights[a]) * functools.reduce(np.kron, blocks))
    return np.vstack(rows)


def mixed_workload() -> Workload:
    """Marginals, prefixes and ranges in product terms: the closed forms must hold for any
    union of products, not just marginals."""
    terms = workload.marginals(("a", "b", "c"), SIZES, (1, 2)).terms + (
        (Block(BlockKind.PREFIX, 3), Block(BlockKind.ALL_RANGES, 4), Block(BlockKind.TOTAL, 2)),
        (Block(BlockKind.IDENTITY, 3), Block(BlockKind.TOTAL, 4), Block(BlockKind.PREFIX, 2)))
    return Workload(("a", "b", "c"), SIZES, terms)


WEIGHTS = {"all": np.arange(1.0, 9.0),
           # no 0-way, no a-only, no full marginal: still supports 1- and 2-way terms
           "some_zero": np.array([0.0, 1.0, 2.0, 0.5, 0.0, 1.5, 3.0, 0.0])}


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_closed_forms_match_the_dense_strategy(name):
    target = mixed_workload()
    chosen = MarginalStrategy(SIZES, WEIGHTS[name])
    dense, queries = dense_marginals(SIZES, WEIGHTS[name]), target.dense()
    assert chosen.matrix() == pytest.approx(dense)
    assert chosen.query_count == dense.shape[0]
    assert chosen.l2_sensitivity == pytest.approx(np.max(np.linalg.norm(dense, axis=0)))
    assert chosen.l1_sensitivity == pytest.approx(np.max(np.abs(dense).sum(axis=0)))
    covariance = np.linalg.pinv(dense.T @ dense)
    chosen.require_support(target)
    assert chosen.trace(target) == pytest.approx(np.trace(queries @ covariance @ queries.T))
    assert chosen.query_variances(target) == pytest.approx(
        np.einsum("ij,jk,ik->i", queries, covariance, queries))
    x = np.random.default_rng(1).integers(0, 9, target.cells)
    assert chosen.apply(x) == pytest.approx(dense @ x)
    noisy = dense @ x + np.random.default_rng(2).normal(size=dense.shape[0])
    assert chosen.reconstruct(noisy) == pytest.approx(np.linalg.pinv(dense) @ noisy)


def test_a_workload_outside_the_kept_marginals_is_refused():
    only_a_and_b = np.zeros(8)
    only_a_and_b[[0b100, 0b010]] = 1.0
    chosen = MarginalStrategy(SIZES, only_a_and_b)
    with pytest.raises(UnsupportedWorkload, match="singular"):
        error.unit_rmse(workload.marginals(("a", "b", "c"), SIZES, (2,)), chosen)
    a_and_b = Workload(("a", "b", "c"), SIZES, workload.marginals(
        ("a", "b", "c"), SIZES, (1,)).terms[:2])
    assert error.unit_rmse(a_and_b, chosen) > 0


def test_opt_marginals_reaches_a_dense_optimisers_optimum():
    target = mixed_workload()
    queries = target.dense()

    def dense_error(weights):  # sensitivity^2 x trace, from the dense matrices only
        dense = dense_marginals(SIZES, np.maximum(weights, 0.0))
        return np.max(np.sum(dense ** 2, axis=0)) * np.trace(
            queries @ np.linalg.pinv(dense.T @ dense) @ queries.T)

    best = scipy.optimize.minimize(dense_error, np.full(8, 1 / 8), method="SLSQP",
                                   bounds=[(1e-9, 1)] * 8,
                                   constraints=[{"type": "eq", "fun": lambda u: u.sum() - 1}])
    chosen = opt_marginals(target)
    ours = chosen.l2_sensitivity ** 2 * chosen.trace(target)
    assert ours == pytest.approx(dense_error(chosen.weights), rel=1e-9)
    assert ours <= best.fun * (1 + 1e-6)
    assert chosen.duality_gap <= 1e-6
    # The certificate is a true lower bound: no weighting does better than ours x (1 - gap).
    assert best.fun >= ours * (1 - chosen.duality_gap) * (1 - 1e-9)


def test_two_way_marginals_over_a_million_cells_reach_the_svd_bound():
    """The issue's target is 0.9 of the bound (Kronecker Eigen-Design: 0.68); OPT_M measured
    0.9991 in 0.3 s."""
    target = workload.marginals(("a", "b", "c"), (100, 100, 100), (2,))
    chosen = opt_marginals(target)
    assert error.svd_bound_unit_rmse(target) / error.unit_rmse(target, chosen) >= 0.99


def test_answers_are_consistent_least_squares():
    target = workload.marginals(("a", "b", "c"), SIZES, (0, 1, 2))
    chosen = opt_marginals(target)
    data = np.arange(target.cells)
    release = answer_workload(target, chosen, data, epsilon=1.0, delta=1e-6)
    assert release.answers == pytest.approx(target.dense() @ release.estimate)
    assert release.expected_rmse == pytest.approx(
        error.expected_rmse(target, chosen, 1.0, 1e-6))


def test_union_closed_forms_match_the_dense_parts():
    target = mixed_workload()
    chosen = opt_union(target)
    parts = [functools.reduce(np.kron, p.factors) for p in chosen.parts]
    stacked = np.vstack([np.sqrt(u) * p for u, p in zip(chosen.weights, parts)])
    # The stated sensitivity bounds the true one (equal: Eigen-Design's columns are level).
    true = np.max(np.linalg.norm(stacked, axis=0))
    assert true <= chosen.l2_sensitivity * (1 + 1e-12)
    assert chosen.l2_sensitivity == pytest.approx(true)
    variances, trace = [], 0.0
    for term, part, u in zip(target.terms, parts, chosen.weights):
        rows = functools.reduce(np.kron, [b.dense() for b in term])
        covariance = np.linalg.pinv(part.T @ part) / u
        variances.append(np.einsum("ij,jk,ik->i", rows, covariance, rows))
        trace += np.trace(rows @ covariance @ rows.T)
    assert chosen.trace(target) == pytest.approx(trace)
    assert chosen.query_variances(target) == pytest.approx(np.concatenate(variances))
    # Gaussian budget split: sum_j E_j / u_j = (sum_j sqrt(E_j))^2 at sum_j u_j = 1.
    errors = np.array([p.trace(workload.Workload(
        target.attributes, target.sizes, (t,))) for p, t in zip(chosen.parts, target.terms)])
    assert trace == pytest.approx(np.sum(np.sqrt(errors)) ** 2)
    release = answer_workload(target, chosen, np.arange(target.cells), epsilon=1.0, delta=1e-6)
    assert release.estimate is None and release.answers.shape == (target.query_count,)
    with pytest.raises(ValueError, match="another workload"):
        error.unit_rmse(workload.marginals(("a", "b", "c"), SIZES, (1,)), chosen)


def test_the_picker_takes_the_least_error_and_the_release_says_which():
    cdf = workload.cdf(64)
    chosen = best_strategy(cdf)
    assert chosen.family == "convex optimum" == chosen.strategy.name
    assert chosen.unit_rmse["convex optimum"] == min(chosen.unit_rmse.values())
    assert chosen.unit_rmse["eigen-design"] > 1.1 * chosen.unit_rmse["convex optimum"]
    release = answer_workload(cdf, chosen.strategy, np.arange(64), epsilon=1.0, delta=1e-6)
    assert release.strategy == "convex optimum"
    marginals = workload.marginals(("a", "b", "c"), (100, 100, 100), (2,))
    picked = best_strategy(marginals)
    assert picked.family == "weighted marginals (OPT_M)"
    assert error.svd_bound_unit_rmse(marginals) / picked.unit_rmse[picked.family] >= 0.9


def test_a_registered_family_competes(monkeypatch):
    """Appended to CANDIDATES, a family is scored beside the others and loses where its error
    is not the least (all ranges: the identity is far from the optimum); given alone, it is
    the one picked and the only one scored."""
    from sage_tfx.dp_statistics.matrix import selection

    identity = Candidate("identity", lambda w: True, lambda w, cache_dir: strategy.identity(w))
    monkeypatch.setattr(selection, "CANDIDATES", [*selection.CANDIDATES, identity])
    ranges = best_strategy(workload.all_ranges(16))
    assert "identity" in ranges.unit_rmse and ranges.family != "identity"
    assert ranges.unit_rmse["identity"] > min(ranges.unit_rmse.values())
    only_identity = best_strategy(workload.explicit(np.eye(6)), candidates=[identity])
    assert only_identity.family == "identity" and list(only_identity.unit_rmse) == ["identity"]
