"""The matrix mechanism (sage_tfx.dp_statistics.matrix): the workload algebra against dense
matrices, Eigen-Design against the paper and the SVD bound, the expected error against the
mechanism's empirical error, consistency, refusals, and the privacy audit.

False-failure rates. The Monte-Carlo tests compare a mean of squared errors with its closed-form
expectation at 5 of its standard deviations (computed exactly from the noise's 2nd and 4th
moments; the mean is over >= 2000 independent runs, so the normal approximation holds): false
failure about 6e-7 each. The audit's coverage assertion runs at confidence 0.9999 (false failure
<= 1e-4). The product's noise is OpenDP's CSPRNG (no seed); only workload sampling is seeded.
Everything else is deterministic linear algebra with tolerances on rounding.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from sage_tfx import mechanisms
from sage_tfx.audit import mechanisms as audits
from sage_tfx.audit.bounds import epsilon_lower_bound
from sage_tfx.dp_statistics.matrix import (DomainError, Noise, Strategy, UnsupportedWorkload,
                                           answer_workload, eigen_design, error,
                                           expected_rmse, laplace_expected_rmse, strategy,
                                           svd_lower_bound_rmse, workload)
from sage_tfx.dp_statistics.matrix.workload import Block, BlockKind, Workload

EXAMPLE4 = np.array([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0],
                     [0, 0, 0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1, 0, 0],
                     [0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1],
                     [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, -1, -1, -1, -1]], float)


def small_workloads():
    rng = np.random.default_rng(5)
    return {
        "example4": workload.explicit(EXAMPLE4),
        "ranges": workload.all_ranges(16),
        "permuted": workload.permuted_ranges(16, rng),
        "cdf": workload.cdf(12),
        "predicates": workload.predicates(10, 30, rng),
        "random_ranges": workload.random_ranges(12, 20, rng),
        "ranges_2d": workload.ranges_2d(4, 5),
        "marginals": workload.marginals(("a", "b", "c"), (2, 3, 4), (1, 2)),
        "range_marginals": workload.range_marginals(("a", "b", "c"), (2, 3, 4), (2,)),
    }


# --- the workload algebra: closed forms against dense matrices ---

@pytest.mark.parametrize("name", list(small_workloads()))
def test_gram_answers_and_query_variances_match_the_dense_workload(name):
    target = small_workloads()[name]
    dense = target.dense()
    assert dense.shape == (target.query_count, target.cells)
    assert np.allclose(target.gram(), dense.T @ dense)
    x = np.random.default_rng(1).integers(0, 9, target.cells)
    assert np.allclose(target.answer(x), dense @ x)
    assert len(target.labels()) == target.query_count
    for chosen in (strategy.identity(target), strategy.hierarchical(target)):
        covariance = np.linalg.pinv(chosen.matrix().T @ chosen.matrix())
        assert np.allclose(chosen.query_variances(target),
                           np.einsum("ij,jk,ik->i", dense, covariance, dense))
        assert chosen.trace(target) == pytest.approx(np.trace(dense @ covariance @ dense.T))


def test_strategies_of_the_paper_have_the_expected_shape():
    # Fig. 2's Haar wavelet on 8 cells, and H2 on 8 cells (15 nodes, each cell in 4 of them).
    assert np.array_equal(strategy.haar(8)[:4], [[1] * 8, [1] * 4 + [-1] * 4,
                                                 [1, 1, -1, -1, 0, 0, 0, 0],
                                                 [0, 0, 0, 0, 1, 1, -1, -1]])
    tree = strategy.hierarchy(8)
    assert tree.shape == (15, 8) and np.all(tree.sum(axis=0) == 4)
    assert strategy.haar(6).shape[1] == 6 and np.linalg.matrix_rank(strategy.haar(6)) == 6


# --- Eigen-Design: the paper's Example 4, the bound, the identity ---

def test_example4_reproduces_the_papers_ratios():
    """Example 4's RMSE relative to the identity (free of the paper's Gaussian constant):
    wavelet 34.62 / 45.36, Eigen-Design 29.79 / 45.36, bound 29.18 / 45.36 (to 0.5%)."""
    target = workload.explicit(EXAMPLE4)
    identity = expected_rmse(target, strategy.identity(target), 0.5, 1e-4)
    assert expected_rmse(target, strategy.wavelet(target), 0.5, 1e-4) / identity == \
        pytest.approx(34.62 / 45.36, rel=5e-3)
    assert expected_rmse(target, eigen_design(target), 0.5, 1e-4) / identity == \
        pytest.approx(29.79 / 45.36, rel=5e-3)
    assert svd_lower_bound_rmse(target, 0.5, 1e-4) / identity == \
        pytest.approx(29.18 / 45.36, rel=5e-3)


@pytest.mark.parametrize("name", list(small_workloads()))
def test_no_strategy_beats_the_svd_bound_and_eigen_design_beats_identity(name):
    target = small_workloads()[name]
    bound = error.svd_bound_unit_rmse(target)
    rng = np.random.default_rng(2)
    candidates = [strategy.identity(target), strategy.wavelet(target),
                  strategy.hierarchical(target), strategy.workload_as_strategy(target),
                  Strategy((rng.normal(size=(target.cells + 3, target.cells)),), "gaussian"),
                  eigen_design(target)]
    errors = {c.name: error.unit_rmse(target, c) for c in candidates}
    # Marginals reach the bound exactly (paper §5.1): equal up to rounding.
    assert min(errors.values()) >= bound * (1 - 1e-7), errors
    # Program 1 at u = 1 is the identity rotated (A = Q, A^T A = I): never worse (rounding).
    assert errors["eigen-design"] <= errors["identity"] * (1 + 1e-9), errors
    assert eigen_design(target).duality_gap < 1e-3  # the dual certificate, relative


def test_eigen_design_reaches_the_bound_where_the_paper_does_and_is_representation_free():
    rng = np.random.default_rng(3)
    ranges, permuted = workload.all_ranges(64), workload.permuted_ranges(64, rng)
    predicates = workload.predicates(64, 64, rng)
    for target in (permuted, predicates):
        assert error.svd_bound_unit_rmse(target) / error.unit_rmse(
            target, eigen_design(target)) > 0.95
    # Prop. 5: permuting the cells changes nothing for Eigen-Design, everything for the wavelet.
    assert error.unit_rmse(permuted, eigen_design(permuted)) == pytest.approx(
        error.unit_rmse(ranges, eigen_design(ranges)), rel=1e-3)
    assert error.unit_rmse(permuted, strategy.wavelet(permuted)) > 1.5 * error.unit_rmse(
        ranges, strategy.wavelet(ranges))


def test_speed_ups_stay_close_to_the_full_design():
    target = workload.all_ranges(128)
    full = error.unit_rmse(target, eigen_design(target))
    for options in ({"separation_group": 8}, {"principal_fraction": 0.1}):
        assert full <= error.unit_rmse(target, eigen_design(target, **options)) * (1 + 1e-6)
        assert error.unit_rmse(target, eigen_design(target, **options)) < 1.1 * full


def test_strategies_are_cached_per_workload():
    first = eigen_design(workload.all_ranges(32))
    assert eigen_design(workload.all_ranges(32)) is first  # an equal spec, built again
    assert eigen_design(workload.cdf(32)) is not first


def test_kronecker_design_factors_and_scales_to_a_million_cells():
    small = workload.marginals(("a", "b", "c"), (3, 4, 5), (2,))
    factored = eigen_design(small, kronecker=True)
    dense = Strategy((factored.matrix(),), "same, dense")
    assert error.unit_rmse(small, factored) == pytest.approx(error.unit_rmse(small, dense))
    assert error.unit_rmse(small, factored) < error.unit_rmse(small, strategy.identity(small))
    big = workload.marginals(("a", "b", "c"), (100, 100, 100), (2,))
    chosen = eigen_design(big)
    assert len(chosen.factors) == 3
    ratio = error.svd_bound_unit_rmse(big) / error.unit_rmse(big, chosen)
    assert 0.5 < ratio <= 1.0


# --- the mechanism: empirical error, consistency, refusals ---

def _batched(runs: int, block: Block, factor: np.ndarray) -> tuple[Workload, Strategy]:
    """Identity(runs) (x) the workload, I (x) the strategy: row r of the answers is an
    independent run of the one-run mechanism (the noise is independent per coordinate)."""
    target = Workload(("run", "x"), (runs, block.size),
                      ((Block(BlockKind.IDENTITY, runs), block),))
    return target, Strategy((np.eye(runs), factor), "batched")


@pytest.mark.parametrize("noise", [Noise.GAUSSIAN, Noise.LAPLACE])
def test_expected_error_matches_the_empirical_error(noise):
    block = Block(BlockKind.ALL_RANGES, 6)
    one = Workload(("x",), (6,), ((block,),))
    chosen = eigen_design(one)
    runs, calls, epsilon, delta = 250, 8, 1.0, 1e-5
    target, batched = _batched(runs, block, chosen.factors[0])
    data = np.tile(np.arange(6) * 3, runs)
    releases = [answer_workload(target, batched, data, epsilon=epsilon, delta=delta,
                                noise=noise) for _ in range(calls)]
    release = releases[0]
    per_run_mse = np.concatenate([
        np.mean((r.answers - target.answer(data)).reshape(runs, -1) ** 2, 1) for r in releases])
    runs *= calls
    if noise is Noise.GAUSSIAN:
        expected, variance = expected_rmse(one, chosen, epsilon, delta), 1.0
        scale = mechanisms.gaussian_sigma(l2_sensitivity=chosen.l2_sensitivity,
                                          epsilon=epsilon, delta=delta)
        excess_kurtosis = 0.0
    else:
        expected = laplace_expected_rmse(one, chosen, epsilon)
        scale = math.sqrt(2) * chosen.l1_sensitivity / epsilon
        excess_kurtosis = 3.0  # Laplace: E z^4 = 6 (E z^2)^2
    assert release.expected_rmse == pytest.approx(expected, rel=1e-9)
    # Per run, MSE = z^T B z / m with B = M^T M, M = W A^+ and z i.i.d. of variance s^2:
    # Var(z^T B z) = s^4 (2 tr(B^2) + excess_kurtosis * sum_i B_ii^2).
    m = one.query_count
    transfer = one.dense() @ np.linalg.pinv(chosen.factors[0])
    quadratic = transfer.T @ transfer
    variance = scale ** 4 * (2 * np.trace(quadratic @ quadratic)
                             + excess_kurtosis * np.sum(np.diag(quadratic) ** 2)) / m ** 2
    assert abs(per_run_mse.mean() - expected ** 2) < 5 * math.sqrt(variance / runs)


def test_answers_are_consistent_and_carry_the_noises_event():
    target = workload.range_marginals(("a", "b"), (4, 5), (1, 2))
    chosen = eigen_design(target)
    data = np.arange(20)
    release = answer_workload(target, chosen, data, epsilon=1.0, delta=1e-6)
    assert np.allclose(release.answers, target.dense() @ release.estimate)  # W x_hat
    assert release.event == mechanisms.gaussian(
        np.zeros(chosen.query_count), l2_sensitivity=chosen.l2_sensitivity, epsilon=1.0,
        delta=1e-6).event
    assert release.query_rmse.shape == (target.query_count,)
    assert np.sqrt(np.mean(release.query_rmse ** 2)) == pytest.approx(
        expected_rmse(target, chosen, 1.0, 1e-6))


@pytest.fixture
def no_noise(monkeypatch):
    """Fails the test if any noise is drawn: refusals must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("noise was drawn before the request was refused")
    monkeypatch.setattr(mechanisms, "gaussian", refuse)
    monkeypatch.setattr(mechanisms, "laplace", refuse)


def test_a_singular_strategy_is_refused_before_any_noise(no_noise):
    target = workload.all_ranges(6)
    half = Strategy((np.eye(6)[:3],), "three cells")
    with pytest.raises(UnsupportedWorkload, match="singular for this workload"):
        answer_workload(target, half, np.ones(6, dtype=int), epsilon=1.0, delta=1e-6)
    with pytest.raises(UnsupportedWorkload):
        expected_rmse(target, half, 1.0, 1e-6)
    # A rank-deficient strategy that still spans the workload's rows is accepted.
    total = workload.explicit(np.ones((1, 6)))
    assert expected_rmse(total, Strategy((np.ones((1, 6)),), "total"), 1.0, 1e-6) > 0


def test_data_and_queries_outside_the_declared_domain_are_refused(no_noise):
    target = workload.all_ranges(6)
    chosen = strategy.identity(target)
    with pytest.raises(DomainError, match="declared domain"):
        answer_workload(target, chosen, np.ones(7, dtype=int), epsilon=1.0, delta=1e-6)
    with pytest.raises(ValueError, match="non-negative integer counts"):
        answer_workload(target, chosen, -np.ones(6, dtype=int), epsilon=1.0, delta=1e-6)
    with pytest.raises(DomainError, match="declared domain"):
        workload.explicit(np.ones((2, 5)), attributes=("a", "b"), sizes=(2, 3))
    with pytest.raises(DomainError, match="outside the declared domain"):
        Workload(("a",), (4,), ((Block(BlockKind.ALL_RANGES, 5),),))
    with pytest.raises(DomainError, match="strategy covers cells"):
        expected_rmse(workload.all_ranges(5), chosen, 1.0, 1e-6)


# --- the privacy audit (audit/mechanisms.py): below its claim; unit sensitivity is caught ---

def test_matrix_mechanism_is_below_its_claim_and_unit_sensitivity_is_caught():
    claimed, delta = audits.MATRIX_EPSILON, audits.MATRIX_DELTA
    assert "matrix_mechanism" in audits.shipped()
    outputs = audits.matrix_mechanism_outputs(3000)
    # The release is what ran: D' shifts the statistic by the worst column's norm, 4 sqrt(6).
    assert np.mean(outputs[1]) - np.mean(outputs[0]) == pytest.approx(4 * math.sqrt(6), abs=2.5)
    assert epsilon_lower_bound(*outputs, delta=delta, confidence=0.9999) <= claimed
    # Measured 0.43-0.59 correct, 5.76-5.79 broken at 3000 runs; 1000 runs keep a wide margin.
    broken = audits.matrix_mechanism_outputs(1000, broken="unit_sensitivity")
    assert epsilon_lower_bound(*broken, delta=delta, confidence=0.99) > claimed
