"""The online square-root strategy (dp_statistics/matrix/online.py) for prefix and range
workloads in a stream: its error is the factorization's, it is online, and it beats the offline
strategies on the CDF."""
import numpy as np
import pytest

from sage_tfx.dp_statistics.continual import factorization
from sage_tfx.dp_statistics.matrix import error, online, strategy, workload
from sage_tfx.dp_statistics.matrix.workload import DomainError


@pytest.mark.parametrize("steps", [1, 16, 200])
def test_its_cdf_error_is_the_factorizations_prefix_variance(steps):
    """trace(W X W') of the CDF through the generic least squares = sum_t Var Z(t) / sigma^2
    of the BLT decoder, and the sensitivity is the encoder's first column norm."""
    cdf = workload.cdf(steps)
    chosen = online.square_root_strategy(cdf)
    fitted = factorization.fit_square_root(steps)
    assert chosen.trace(cdf) == pytest.approx(np.sum(fitted.prefix_variances(steps)), rel=1e-9)
    assert chosen.l2_sensitivity == pytest.approx(
        np.linalg.norm(fitted.encoder(steps)), rel=1e-12)


def test_it_is_online_each_estimate_needs_only_the_steps_so_far():
    """A and its inverse are lower-triangular: the strategy answer and the estimate of the
    first t cells are unchanged by anything after step t."""
    chosen = strategy.online_square_root(workload.all_ranges(40))
    [matrix] = chosen.factors
    assert np.allclose(matrix, np.tril(matrix))
    rng = np.random.default_rng(3)
    answers = rng.normal(size=40)
    later = answers.copy()
    later[25:] += rng.normal(size=15)
    assert np.allclose(chosen.reconstruct(answers)[:25], chosen.reconstruct(later)[:25])


def test_it_beats_eigen_design_on_the_cdf_and_stays_near_the_svd_bound():
    """Measured at 64 cells: 9.42 against Eigen-Design's 10.43 and the SVD bound 8.62 (eps 1,
    delta 1e-6); the bound is for any strategy, online or not."""
    cdf = workload.cdf(64)
    ours = error.expected_rmse(cdf, strategy.online_square_root(cdf), 1.0, 1e-6)
    assert ours < 0.95 * error.expected_rmse(cdf, strategy.eigen_design(cdf), 1.0, 1e-6)
    assert ours < 1.1 * error.svd_lower_bound_rmse(cdf, 1.0, 1e-6)


def test_it_refuses_more_than_one_attribute():
    with pytest.raises(DomainError, match="one ordered attribute"):
        strategy.online_square_root(workload.ranges_2d(4, 4))


def test_the_picker_takes_the_online_strategy_for_a_cdf_beyond_the_convex_optimum():
    """Above the convex optimum's 512 cells, the online square root beats Eigen-Design on the
    CDF (3.11 against 3.70 per query at unit noise over 1,024 cells) and is chosen."""
    from sage_tfx.dp_statistics.matrix import best_strategy

    chosen = best_strategy(workload.cdf(1024))
    assert chosen.family == "online square root"
    assert chosen.unit_rmse["online square root"] < 0.9 * chosen.unit_rmse["eigen-design"]
    assert "convex optimum" not in chosen.unit_rmse
