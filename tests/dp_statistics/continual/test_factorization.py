"""The BLT square-root factorization (continual/factorization.py) against dense matrices and
brute force: B C = A, the column-normalised B' C' = A, variances from the factor matrices, the
sensitivity over every way a unit's records land, the union bound's slack, and the keyed noise
recomputed bit for bit."""
import itertools
import math

import numpy as np
import pytest
from scipy.linalg import toeplitz
from scipy.signal import lfilter
from scipy.special import log_ndtr
from scipy.stats import chi2, multivariate_normal, norm

from sage_tfx.dp_statistics.continual import factorization
from sage_tfx.dp_statistics.continual.factorization import (
    BufferedToeplitz, FactorizationIndex, WindowFactor, fit_square_root,
    square_root_coefficients)
from sage_tfx.mechanisms.keyed import KeyedGaussian

NOISE = KeyedGaussian(bytes(range(32)))  # a fixed key: tests only


def _window(length: int) -> WindowFactor:
    return WindowFactor(fit_square_root(length), length)


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


@pytest.mark.parametrize("length, tolerance", [(100, 1e-3), (1000, 1e-3), (10_000, 3e-3)])
def test_the_fitted_blt_is_as_accurate_as_the_exact_square_root(length, tolerance):
    """Mean prefix variance x squared sensitivity (the error at equal zCDP) within 0.1% of the
    exact square root's (0.3% at T = 10^4): the buffers cost almost nothing."""
    exact = square_root_coefficients(length)
    exact_error = np.sum(exact ** 2) * np.mean(np.cumsum(exact ** 2))
    factor = fit_square_root(length)
    error = (np.sum(factor.encoder(length) ** 2) * np.mean(factor.prefix_variances(length)))
    assert exact_error <= error <= exact_error * (1 + tolerance)


@pytest.mark.parametrize("length", [1, 2, 7, 64, 300])
def test_the_normalised_factorization_against_dense_matrices(length):
    """B' = A E A^{-1} B from dense matrices (not the module's recurrences): decoder_matrix is
    it, B' C' = A with C' = B'^{-1} A lower-triangular, every column of C' has norm s (the
    sensitivity, which is C's), and Var Z'(t) / sigma^2 is B''s row t squared."""
    window = _window(length)
    workload = np.tril(np.ones((length, length)))
    decoder = _lower_toeplitz(window.blt.decoder(length))
    dense = workload @ np.diag(window.gains) @ np.linalg.inv(workload) @ decoder
    np.testing.assert_allclose(window.decoder_matrix(length), dense, rtol=1e-10, atol=1e-12)
    encoder = np.linalg.solve(dense, workload)
    np.testing.assert_allclose(np.triu(encoder, 1), 0.0, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(encoder, axis=0), window.sensitivity, rtol=1e-9)
    assert window.sensitivity == pytest.approx(np.linalg.norm(window.blt.encoder(length)),
                                               rel=1e-12)
    np.testing.assert_allclose(window.prefix_variances(length), np.sum(dense ** 2, axis=1),
                               rtol=1e-10)


def _brute_force_sensitivity(decoder: np.ndarray, records: int) -> float:
    """max ||C' u||, C' = B'^{-1} A, over every way `records` records of weight +-1 land in the
    steps (repeats allowed: the vertices of the l1 ball; ||C' u|| is convex)."""
    length = len(decoder)
    encoder = np.linalg.solve(decoder, np.tril(np.ones((length, length))))
    best = 0.0
    for steps in itertools.combinations_with_replacement(range(length), records):
        for signs in itertools.product((1.0, -1.0), repeat=records):
            u = np.zeros(length)
            np.add.at(u, list(steps), signs)
            best = max(best, float(np.linalg.norm(encoder @ u)))
    return best


class _ScaledTooFar(WindowFactor):
    """A broken variant: columns scaled up twice as far (gains e^2) while the sensitivity is
    still claimed to be the Toeplitz s; column j of its C' has norm s / e_j > s."""
    @property
    def gains(self):
        return super().gains ** 2

    @property
    def sensitivity(self):
        return float(np.linalg.norm(self.blt.encoder(self.length)))


@pytest.mark.parametrize("records", [1, 2, 3])
def test_the_sensitivity_against_every_way_a_units_records_land(records):
    """k s (k = 1: a selection stream; k = C: the value sums) is the brute-force maximum over
    every pattern at T = 6; the broken variant's claim is below its brute-force maximum."""
    window = _window(6)
    brute = _brute_force_sensitivity(window.decoder_matrix(6), records)
    assert records * window.sensitivity == pytest.approx(brute, rel=1e-9)
    broken = _ScaledTooFar(window.blt, 6)
    assert _brute_force_sensitivity(broken.decoder_matrix(6), records) > (
        1.2 * records * broken.sensitivity)


@pytest.mark.parametrize("length", [16, 100, 1000])
def test_normalising_the_columns_lowers_the_variance_at_every_step(length):
    """The point of it: at the same sensitivity, Var Z'(t) <= Var Z(t) at every t, most at
    the end (module docstring's figures)."""
    window = _window(length)
    scaled, toeplitz_variances = (window.prefix_variances(length),
                                  window.blt.prefix_variances(length))
    assert np.all(scaled <= toeplitz_variances * (1 + 1e-12))
    if length in (100, 1000):
        assert scaled[-1] / toeplitz_variances[-1] == pytest.approx(
            {100: 0.69, 1000: 0.64}[length], abs=0.01)
        assert scaled.max() / toeplitz_variances.max() == pytest.approx(
            {100: 0.86, 1000: 0.89}[length], abs=0.01)


def _pairwise_exceedance(correlations: np.ndarray, level: float) -> np.ndarray:
    """P(X > level, Y > level) for standard normals of correlation rho, by Gauss-Legendre
    quadrature of int_level^inf phi(x) P(Y > level | X = x) dx (in logs: ~1e-17 values)."""
    nodes, weights = np.polynomial.legendre.leggauss(200)
    reach = 40.0 / level  # phi(level + y) / phi(level) < e^-40 beyond
    ys, weights = (nodes + 1.0) * reach / 2.0, weights * reach / 2.0
    rho = np.minimum(correlations, 1.0 - 1e-12)[:, None]
    x = level + ys[None, :]
    log_density = -0.5 * x ** 2 - 0.5 * math.log(2.0 * math.pi) + log_ndtr(
        -(level - rho * x) / np.sqrt(1.0 - rho ** 2))
    return np.exp(log_density) @ weights


def test_the_quadrature_agrees_with_scipy_where_scipy_is_accurate():
    for rho in (0.0, 0.5, 0.9):
        exact = multivariate_normal([0.0, 0.0], [[1.0, rho], [rho, 1.0]]).cdf([-2.0, -2.0])
        assert _pairwise_exceedance(np.array([rho]), 2.0)[0] == pytest.approx(exact, rel=1e-5)


def test_the_union_bound_is_tight_for_the_operators_thresholds():
    """factorization.py, "Is the union bound loose?": at the operator's thresholds
    (epsilon 6, delta 1e-9, C = 16, T = 100) the pairwise terms of Bonferroni's lower bound
    are < 1% of the union bound, so no sound bound of this shape lowers tau by 0.01%."""
    from sage_tfx.dp_statistics.continual import budget
    plan = budget.plan(6.0, 1e-9, 100, 16, mechanism="factorization")
    decoder = plan.factor.decoder_matrix(100)
    covariance = decoder @ decoder.T
    sd = np.sqrt(np.diag(covariance))
    level = float(plan.thresholds[0] / (plan.selection_sigma * sd[0]))
    np.testing.assert_allclose(plan.thresholds / (plan.selection_sigma * sd), level,
                               rtol=1e-9)
    pairs = np.triu_indices(100, 1)
    correlations = (covariance / np.outer(sd, sd))[pairs]
    slack = _pairwise_exceedance(correlations, level).sum() / (100 * norm.sf(level))
    assert 0 < slack < 0.01


def test_a_blt_refuses_bad_parameters():
    with pytest.raises(ValueError, match="decays must be in"):
        BufferedToeplitz((1.0,), (0.5,))
    with pytest.raises(ValueError, match="as many weights"):
        BufferedToeplitz((0.5, 0.6), (0.5,))


LENGTH, SIGMA = 200, 1.5


def _index(thresholds=None, rows=40):
    index = FactorizationIndex.empty(SIGMA, LENGTH, thresholds, _window(LENGTH))
    index.add(NOISE, np.arange(rows), np.full(rows, LENGTH))
    return index


def test_the_indexed_noise_is_the_one_pass_noise_bit_for_bit():
    """Any step of any stream, from the stored buffer states, equals the noise computed in one
    pass from step 1 (a crashed micro-batch recomputes the same bits), also for a one-row
    index (the Beam engine keeps one key per index) and after a round trip through storage."""
    index = _index()
    full = factorization.prefix_noise(NOISE, np.arange(40), _window(LENGTH), LENGTH,
                                      SIGMA)
    rows = np.repeat(np.arange(40), LENGTH)
    steps = np.tile(np.arange(1, LENGTH + 1), 40)
    assert np.array_equal(index.noise_at(NOISE, rows, steps), full.ravel())
    stored = FactorizationIndex.from_arrays(SIGMA, LENGTH, None, index.to_arrays(),
                                            _window(LENGTH))
    assert np.array_equal(stored.noise_at(NOISE, rows, steps), full.ravel())
    alone = FactorizationIndex.empty(SIGMA, LENGTH, None, _window(LENGTH))
    alone.add(NOISE, [17], [LENGTH])
    assert np.array_equal(alone.noise_at(NOISE, np.zeros(LENGTH, np.int64),
                                         np.arange(1, LENGTH + 1)), full[17])


def test_the_noise_has_the_factorization_covariance():
    """Over 4,000 streams, Z(1), Z(50), Z(200) against sigma^2 B B' (the decoder's rows):
    each variance within its chi-square 0.999 interval (false-failure rate <= 0.003 total with
    plus 6e-5 for the covariance; deterministic in fact: a fixed key)."""
    streams = 4000
    noise = factorization.prefix_noise(NOISE, np.arange(1000, 1000 + streams),
                                       _window(LENGTH), LENGTH, SIGMA)
    expected = factorization.prefix_std(_window(LENGTH), LENGTH, SIGMA) ** 2
    for step in (1, 50, 200):
        ratio = np.sum(noise[:, step - 1] ** 2) / expected[step - 1]
        assert chi2.ppf(0.0005, streams) < ratio < chi2.ppf(0.9995, streams)
    decoder = _window(LENGTH).decoder_matrix(LENGTH)
    covariance = SIGMA ** 2 * decoder[49] @ decoder[199]
    products = noise[:, 49] * noise[:, 199]
    # within 4 standard errors of the mean (normal approximation: false-failure rate 6e-5)
    assert abs(products.mean() - covariance) < 4 * products.std() / math.sqrt(streams)


def test_the_first_crossing_is_the_first_step_a_scan_finds():
    """first_crossing (block minima, then an exact block scan) against a scan of the one-pass
    noise: the first step after `after` where count > tau - Z."""
    thresholds = np.linspace(3.0, 6.0, LENGTH)
    index = _index(thresholds)
    full = factorization.prefix_noise(NOISE, np.arange(40), _window(LENGTH), LENGTH,
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
    for mechanism, words in (("factorization",
                              "column-normalised BLT square-root factorization with 6 buffers"),
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
    factor = _window(length)
    full = factorization.prefix_noise(NOISE, np.arange(5), factor, length, SIGMA)
    index = FactorizationIndex.empty(SIGMA, length, None, factor)
    index.add(NOISE, np.arange(5), np.full(5, length))
    arrays = index.to_arrays()
    assert arrays["bases"].shape == (5, factorization.BUFFERS + 2)
    assert arrays["cursors"].shape == (5,)
    for step in (length // 2, 3, length, length // 2, 1, length - 40):
        assert np.array_equal(index.noise_at(NOISE, np.arange(5), np.full(5, step)),
                              full[:, step - 1])


def test_value_streams_at_different_distances_give_the_one_pass_noise():
    """One call asks 12 value streams for steps at distances from their cursors from 0 to 300
    steps, from odd and even cursors (ragged keyed-noise calls, one per power of two of the
    counts, each group run together); each is the
    one-pass noise."""
    length = 300
    factor = _window(length)
    full = factorization.prefix_noise(NOISE, np.arange(12), factor, length, SIGMA)
    index = FactorizationIndex.empty(SIGMA, length, None, factor)
    index.add(NOISE, np.arange(12), np.full(12, length))
    first = np.array([1, 2, 33, 40, 70, 100, 130, 160, 200, 250, 290, 300])
    assert np.array_equal(index.noise_at(NOISE, np.arange(12), first), full[np.arange(12),
                                                                                first - 1])
    then = np.minimum(first + np.array([0, 1, 5, 40, 64, 90, 120, 140, 0, 45, 10, 0]), length)
    assert np.array_equal(index.noise_at(NOISE, np.arange(12), then), full[np.arange(12),
                                                                              then - 1])


def _lfilter_noise_paths(factor, z, starts, first_steps, columns):
    """The numpy/scipy code the compiled recurrence replaced (factorization.py at a6505e1),
    kept as the oracle of its bits: scipy's lfilter per buffer, then numpy's products, sums,
    differences, gains and cumsum."""
    buffers = len(factor.blt.decays)
    rows = np.arange(len(z))[:, None]
    states = np.empty(columns.shape + (factor.width,))
    total = None
    for i, (theta, weight) in enumerate(zip(factor.blt.decays, factor.blt.weights)):
        path, _ = lfilter(np.array([0.0, theta]), np.array([1.0, -theta]), z, axis=1,
                          zi=starts[:, i:i + 1])
        states[..., i] = path[rows, columns]
        path *= weight
        total = np.add(z, path, out=path) if total is None else total.__iadd__(path)
    first, before = columns == 0, np.maximum(columns - 1, 0)
    states[..., buffers] = np.where(first, starts[:, -2:-1], total[rows, before])
    scaled = np.empty_like(total)
    np.subtract(total[:, 1:], total[:, :-1], out=scaled[:, 1:])
    np.subtract(total[:, :1], starts[:, -2:-1], out=scaled[:, :1])
    gains = np.lib.stride_tricks.sliding_window_view(factor.padded_gains, z.shape[1])
    scaled *= gains[first_steps]
    scaled[:, 0] += starts[:, -1]
    np.cumsum(scaled, axis=1, out=scaled)
    states[..., buffers + 1] = np.where(first, starts[:, -1:], scaled[rows, before])
    return scaled, states


@pytest.mark.parametrize("length", [70, 1000])
def test_the_compiled_recurrence_has_the_bits_of_the_lfilter_code_it_replaced(length):
    """blt_kernel.py against the numpy/scipy path it replaced, bit for bit (every float of Z'
    and of the states): streams from step 1 (zero states, as new selection streams) and from
    arbitrary states and steps (as scans and value-stream replays), states read at block starts,
    at column 0, twice at one column and at the last column; keyed normals times sigma, as the
    index draws them, and wider-ranged ones (values of 1e-300 to 1e300, exact zeros, states of
    -0.0)."""
    factor = _window(length)
    rng = np.random.default_rng(length)
    cases = []
    for rows, steps in ((64, 32 * -(-length // 32)), (1, 32), (7, 5), (3, 1)):
        z = NOISE.normal_rows(np.arange(rows), np.zeros(rows, np.uint64), steps) * SIGMA
        cases.append((z, np.zeros((rows, factor.width)), np.zeros(rows, np.int64),
                      np.broadcast_to(np.arange(0, steps, 32), (rows, -(-steps // 32)))))
        starts = rng.normal(0.0, 50.0, (rows, factor.width))
        first = rng.integers(0, length, rows)
        columns = np.sort(rng.integers(0, steps, (rows, 4)), axis=1)
        columns[:, 0], columns[:, -1] = 0, steps - 1
        cases.append((z, starts, first, columns))
    wide = rng.normal(size=(5, 40)) * 10.0 ** rng.integers(-300, 300, (5, 40))
    wide[:, 3] = 0.0
    cases.append((wide, np.zeros((5, factor.width)), np.arange(5),
                  np.tile([0, 3, 4, 4, 39], (5, 1))))
    # States of -0.0: lfilter's output is -0.0 + 0 * x, +0.0 where x > 0 (the sign of a zero).
    cases.append((wide, np.full((5, factor.width), -0.0), np.arange(5),
                  np.tile([0, 0, 1, 2, 3], (5, 1))))
    for z, starts, first, columns in cases:
        noise, states = factorization._noise_paths(factor, z, starts, first, columns)
        expected_noise, expected_states = _lfilter_noise_paths(factor, z, starts, first,
                                                               columns)
        assert noise.tobytes() == expected_noise.tobytes()
        assert states.tobytes() == expected_states.tobytes()


@pytest.mark.parametrize("length", [70, 1000])
def test_new_selection_streams_summaries_are_the_numpy_summaries(length):
    """A new selection stream's block states and minima of R = tau - Z' (computed in the
    compiled pass, without Z') against the lfilter code's Z' and the numpy minima computed from
    it before (factorization.py at a6505e1): the same bits, rows of several lengths (+inf past
    a row's end), thresholds shorter than the stream (the last one repeats)."""
    factor = _window(length)
    rows, width = 9, 32 * -(-length // 32)
    z = NOISE.normal_rows(np.arange(rows), np.zeros(rows, np.uint64), width) * SIGMA
    lengths = np.array([length, 1, 31, 32, 33, length - 1, length // 2, 40, length])
    thresholds = np.random.default_rng(3).normal(40.0, 5.0, length - 7)
    columns = np.arange(0, width, 32)
    _, states, minima = factorization._recurrences(factor, z.T, None, np.zeros(rows, np.int64),
                                                   columns, thresholds, lengths)
    total, expected_states = _lfilter_noise_paths(
        factor, z, np.zeros((rows, factor.width)), np.zeros(rows, np.int64),
        np.broadcast_to(columns, (rows, len(columns))))
    leaves = np.arange(1, width + 1)[None, :]
    taus = thresholds[np.minimum(leaves, len(thresholds)) - 1]
    required = np.where(leaves > lengths[:, None], np.inf, taus - total)
    assert states.tobytes() == expected_states.tobytes()
    assert minima.tobytes() == required.reshape(rows, -1, 32).min(axis=2).tobytes()


def test_the_compiled_recurrence_refuses_what_it_would_read_out_of_bounds():
    factor = _window(100)
    z, starts = np.ones((2, 8)), np.zeros((2, factor.width))
    with pytest.raises(ValueError, match="past the gains"):
        factorization._noise_paths(factor, z, starts, np.array([0, 1000]))
    with pytest.raises(ValueError, match="past the gains"):
        factorization._noise_paths(factor, z, starts, np.array([-1, 0]))
    for columns in ([[0, 8], [0, 1]], [[-1, 0], [0, 0]], [[3, 2], [0, 0]]):
        with pytest.raises(ValueError, match="state columns"):
            factorization._noise_paths(factor, z, starts, np.zeros(2, np.int64),
                                       np.array(columns))
    with pytest.raises(ValueError, match="states"):
        factorization._noise_paths(factor, z, starts[:1], np.zeros(2, np.int64))
