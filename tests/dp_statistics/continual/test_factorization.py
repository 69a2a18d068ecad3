"""The BLT square-root factorization (continual/factorization.py) against dense matrices and
brute force: B C = A, variances from the factor matrices, the sensitivity under k participations
over every pattern, and the keyed noise recomputed bit for bit."""
import itertools
import math

import numpy as np
import pytest
from scipy.linalg import toeplitz
from scipy.stats import chi2

from sage_tfx.dp_statistics.continual import factorization
from sage_tfx.dp_statistics.continual.factorization import (
    BufferedToeplitz, FactorizationIndex, fit_square_root, participation_sensitivity,
    square_root_coefficients)
from sage_tfx.mechanisms.keyed import KeyedGaussian

NOISE = KeyedGaussian(bytes(range(32)))  # a fixed key: tests only


def _lower_toeplitz(coefficients: np.ndarray) -> np.ndarray:
    return toeplitz(coefficients, np.zeros(len(coefficients)))


def test_the_square_root_coefficients_square_to_the_prefix_workload():
    root = _lower_toeplitz(square_root_coefficients(40))
    np.testing.assert_allclose(root @ root, np.tril(np.ones((40, 40))), atol=1e-12)
    assert square_root_coefficients(4).tolist() == [1.0, 0.5, 0.375, 0.3125]


@pytest.mark.parametrize("length", [1, 2, 7, 64, 300])
def test_the_encoder_is_the_dense_inverse_of_the_decoder_times_the_workload(length):
    """C = B^{-1} A from a dense solve is Toeplitz with `encoder`'s coefficients, B C = A, and
    Var Z(t) / sigma^2 is the squared norm of B's row t."""
    factor = fit_square_root(length)
    decoder = _lower_toeplitz(factor.decoder(length))
    encoder = np.linalg.solve(decoder, np.tril(np.ones((length, length))))
    np.testing.assert_allclose(encoder, _lower_toeplitz(factor.encoder(length)),
                               rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(decoder @ _lower_toeplitz(factor.encoder(length)),
                               np.tril(np.ones((length, length))), atol=1e-12)
    np.testing.assert_allclose(factor.prefix_variances(length),
                               np.sum(decoder ** 2, axis=1), rtol=1e-12)
    assert factorization.column_norm(factor.encoder(length)) == pytest.approx(
        np.linalg.norm(encoder, axis=0).max(), rel=1e-12)


@pytest.mark.parametrize("length, tolerance", [(100, 1e-3), (1000, 1e-3), (10_000, 3e-3)])
def test_the_fitted_blt_is_as_accurate_as_the_exact_square_root(length, tolerance):
    """Mean prefix variance x squared sensitivity (the error at equal zCDP) within 0.1% of the
    exact square root's (0.3% at T = 10^4): the buffers cost almost nothing."""
    exact = square_root_coefficients(length)
    exact_error = np.sum(exact ** 2) * np.mean(np.cumsum(exact ** 2))
    factor = fit_square_root(length)
    error = (factorization.column_norm(factor.encoder(length)) ** 2
             * np.mean(factor.prefix_variances(length)))
    assert exact_error <= error <= exact_error * (1 + tolerance)


def _brute_force_sensitivity(encoder: np.ndarray, participations: int, same_step: bool):
    """max ||C u|| over every pattern: up to k steps (with repeats if same_step), each with
    weight +1 or -1 (the vertices of the set of contributions; ||C u|| is convex)."""
    matrix = _lower_toeplitz(encoder)
    steps = range(len(encoder))
    best = 0.0
    for size in range(1, participations + 1):
        patterns = (itertools.combinations_with_replacement(steps, size) if same_step
                    else itertools.combinations(steps, size))
        for pattern in patterns:
            for signs in itertools.product((1.0, -1.0), repeat=size):
                u = np.zeros(len(encoder))
                np.add.at(u, list(pattern), signs)
                best = max(best, float(np.linalg.norm(matrix @ u)))
    return best


ENCODERS = {
    "blt square root": fit_square_root(6).encoder(6),
    "exact square root": square_root_coefficients(6),
    "not monotone": np.array([1.0, 0.2, 0.9, -0.3, 0.5, 0.1]),
}


@pytest.mark.parametrize("name", sorted(ENCODERS))
@pytest.mark.parametrize("participations", [1, 2, 3])
@pytest.mark.parametrize("same_step", [False, True])
def test_the_participation_sensitivity_against_every_pattern(name, participations, same_step):
    """Sound (>= the brute-force maximum) always; exact for non-negative decreasing
    coefficients (the first k steps are the worst distinct pattern, k times the first column
    with repeats)."""
    encoder = ENCODERS[name]
    brute = _brute_force_sensitivity(encoder, participations, same_step)
    computed = participation_sensitivity(encoder, participations, same_step)
    assert computed >= brute - 1e-12
    if name != "not monotone":
        assert computed == pytest.approx(brute, rel=1e-12)


def test_the_fitted_encoders_are_non_negative_and_decreasing():
    """The premise of the distinct-pattern theorem holds for the fits the operator uses."""
    for length in (2, 10, 100, 1000, 10_000):
        encoder = fit_square_root(length).encoder(length)
        assert encoder.min() >= 0 and np.all(np.diff(encoder) <= 0), length


def test_a_blt_refuses_bad_parameters():
    with pytest.raises(ValueError, match="decays must be in"):
        BufferedToeplitz((1.0,), (0.5,))
    with pytest.raises(ValueError, match="as many weights"):
        BufferedToeplitz((0.5, 0.6), (0.5,))
    with pytest.raises(ValueError, match="participations"):
        participation_sensitivity(np.ones(3), 0)


LENGTH, SIGMA = 200, 1.5


def _index(thresholds=None, rows=40):
    index = FactorizationIndex.empty(SIGMA, LENGTH, thresholds, fit_square_root(LENGTH))
    index.add(NOISE, np.arange(rows), np.full(rows, LENGTH))
    return index


def test_the_indexed_noise_is_the_one_pass_noise_bit_for_bit():
    """Any step of any stream, from the stored buffer states, equals the noise computed in one
    pass from step 1 (a crashed micro-batch recomputes the same bits), also for a one-row
    index (the Beam engine keeps one key per index) and after a round trip through storage."""
    index = _index()
    full = factorization.prefix_noise(NOISE, np.arange(40), fit_square_root(LENGTH), LENGTH,
                                      SIGMA)
    rows = np.repeat(np.arange(40), LENGTH)
    steps = np.tile(np.arange(1, LENGTH + 1), 40)
    assert np.array_equal(index.noise_at(NOISE, rows, steps), full.ravel())
    stored = FactorizationIndex.from_arrays(SIGMA, LENGTH, None, index.to_arrays(),
                                            fit_square_root(LENGTH))
    assert np.array_equal(stored.noise_at(NOISE, rows, steps), full.ravel())
    alone = FactorizationIndex.empty(SIGMA, LENGTH, None, fit_square_root(LENGTH))
    alone.add(NOISE, [17], [LENGTH])
    assert np.array_equal(alone.noise_at(NOISE, np.zeros(LENGTH, np.int64),
                                         np.arange(1, LENGTH + 1)), full[17])


def test_the_noise_has_the_factorization_covariance():
    """Over 4,000 streams, Z(1), Z(50), Z(200) against sigma^2 B B' (the decoder's rows):
    each variance within its chi-square 0.999 interval (false-failure rate <= 0.003 total with
    plus 6e-5 for the covariance; deterministic in fact: a fixed key)."""
    streams = 4000
    noise = factorization.prefix_noise(NOISE, np.arange(1000, 1000 + streams),
                                       fit_square_root(LENGTH), LENGTH, SIGMA)
    expected = factorization.prefix_std(fit_square_root(LENGTH), LENGTH, SIGMA) ** 2
    for step in (1, 50, 200):
        ratio = np.sum(noise[:, step - 1] ** 2) / expected[step - 1]
        assert chi2.ppf(0.0005, streams) < ratio < chi2.ppf(0.9995, streams)
    decoder = _lower_toeplitz(fit_square_root(LENGTH).decoder(LENGTH))
    covariance = SIGMA ** 2 * decoder[49] @ decoder[199]
    products = noise[:, 49] * noise[:, 199]
    # within 4 standard errors of the mean (normal approximation: false-failure rate 6e-5)
    assert abs(products.mean() - covariance) < 4 * products.std() / math.sqrt(streams)


def test_the_first_crossing_is_the_first_step_a_scan_finds():
    """first_crossing (block minima, then an exact block scan) against a scan of the one-pass
    noise: the first step after `after` where count > tau - Z."""
    thresholds = np.linspace(3.0, 6.0, LENGTH)
    index = _index(thresholds)
    full = factorization.prefix_noise(NOISE, np.arange(40), fit_square_root(LENGTH), LENGTH,
                                      SIGMA)
    rng = np.random.default_rng(7)
    after = rng.integers(0, LENGTH, 40)
    counts = rng.uniform(0.0, 5.0, 40)
    found = index.first_crossing(NOISE, np.arange(40), after, counts)
    for row in range(40):
        steps = np.arange(1, LENGTH + 1)
        crossing = (counts[row] > thresholds - full[row]) & (steps > after[row])
        assert found[row] == (steps[crossing][0] if crossing.any() else 0)
    assert math.isclose(index.sigma, SIGMA)


def _query(**fields):
    from sage_tfx.dp_statistics.continual.spec import StreamQuery
    return StreamQuery(key_column="k", unit_column="u", time_column="t", micro_batches=8,
                       contribution_limit=2, epsilon=2.0, delta=1e-6, **fields)


def test_a_query_names_a_known_mechanism_and_its_state_refuses_another_budgets():
    from sage_tfx.dp_statistics.aggregation.spec import QueryError
    from sage_tfx.dp_statistics.continual.budget import plan
    from sage_tfx.dp_statistics.continual.state import StreamStateError, WindowState
    with pytest.raises(QueryError, match="mechanism must be one of"):
        _query(mechanism="banded").check()
    with pytest.raises(StreamStateError, match="planned for the factorization mechanism"):
        WindowState.fresh(_query(mechanism="tree"), plan(2.0, 1e-6, 8, 2,
                                                         mechanism="factorization"), bytes(32))


def test_every_release_states_the_mechanism_that_ran():
    import pandas as pd
    from sage_tfx.dp_statistics.continual import operator
    from sage_tfx.dp_statistics.continual.budget import plan
    from sage_tfx.dp_statistics.continual.state import WindowState
    for mechanism, words in (("factorization", "BLT square-root factorization with 6 buffers"),
                             ("tree", "binary trees with Honaker's estimator")):
        budget = plan(2.0, 1e-6, 8, 2, mechanism=mechanism)
        state = WindowState.fresh(_query(mechanism="auto"), budget, bytes(32))
        release = operator.step(state, budget, pd.DataFrame({"unit": [1], "key": ["a"]}))
        assert f"(DP-SQLP on 8 micro-batches: {words})" in release.guarantee


@pytest.mark.parametrize("length", [200, 2000])
def test_a_value_stream_keeps_its_buffer_states_only_and_is_asked_in_any_order(length):
    """A value stream's memory is O(buffers), not O(T): one step and BUFFERS states, whatever
    the window. Asked forward, backward or twice, any step's noise is the one-pass noise bit
    for bit (selection streams keep per-block states for the prediction: module docstring)."""
    factor = fit_square_root(length)
    full = factorization.prefix_noise(NOISE, np.arange(5), factor, length, SIGMA)
    index = FactorizationIndex.empty(SIGMA, length, None, factor)
    index.add(NOISE, np.arange(5), np.full(5, length))
    arrays = index.to_arrays()
    assert arrays["bases"].shape == (5, factorization.BUFFERS)
    assert arrays["cursors"].shape == (5,)
    for step in (length // 2, 3, length, length // 2, 1, length - 40):
        assert np.array_equal(index.noise_at(NOISE, np.arange(5), np.full(5, step)),
                              full[:, step - 1])
