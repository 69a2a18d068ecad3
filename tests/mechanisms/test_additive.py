"""sage_tfx.mechanisms against closed forms written here. The samplers cannot be seeded, so each
statistical check states its false-failure rate; each has a half-noise variant that fails."""
import functools
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from scipy import stats

from sage_tfx import mechanisms
from sage_tfx.mechanisms import additive, selection

from support.oracles import balle_wang_delta

N = 20_000
FALSE_FAILURE = 1e-6  # per Kolmogorov-Smirnov check


def test_laplace_matches_its_closed_form_and_half_the_noise_is_caught():
    release = mechanisms.laplace(np.full(N, 3.0), l1_sensitivity=2.0, epsilon=0.5)
    law = stats.laplace(loc=3.0, scale=2.0 / 0.5)
    assert stats.kstest(release.value, law.cdf).pvalue > FALSE_FAILURE
    assert release.epsilon(1e-12) == pytest.approx(0.5, rel=1e-3)
    half = mechanisms.laplace(np.full(N, 3.0), l1_sensitivity=1.0, epsilon=0.5)  # half noise
    assert stats.kstest(half.value, law.cdf).pvalue < FALSE_FAILURE


@pytest.mark.parametrize("epsilon,delta", [(0.5, 1e-5), (1.0, 1e-6), (4.0, 1e-9)])
def test_gaussian_sigma_is_balle_wang_analytic_calibration(epsilon, delta):
    sigma = mechanisms.gaussian_sigma(l2_sensitivity=3.0, epsilon=epsilon, delta=delta)
    assert balle_wang_delta(sigma, 3.0, epsilon) <= delta * (1 + 1e-6)
    assert balle_wang_delta(sigma * 0.999, 3.0, epsilon) > delta  # the smallest such sigma


def test_gaussian_matches_its_closed_form_and_half_the_noise_is_caught():
    sigma = mechanisms.gaussian_sigma(l2_sensitivity=1.0, epsilon=1.0, delta=1e-6)
    release = mechanisms.gaussian(np.zeros(N), l2_sensitivity=1.0, epsilon=1.0, delta=1e-6)
    assert release.event == dp_event.GaussianDpEvent(sigma)
    assert stats.kstest(release.value, stats.norm(scale=sigma).cdf).pvalue > FALSE_FAILURE
    assert release.epsilon(1e-6) == pytest.approx(1.0, rel=1e-3)  # dp_accounting's PLD
    half = mechanisms.gaussian_with_noise_multiplier(np.zeros(N), l2_sensitivity=1.0,
                                                     noise_multiplier=sigma / 2)
    assert stats.kstest(half.value, stats.norm(scale=sigma).cdf).pvalue < FALSE_FAILURE


def _discrete_laplace_variance(a):
    return 2 * math.exp(-a) / (1 - math.exp(-a)) ** 2


def test_discrete_laplace_pmf_and_event():
    # P(z) = tanh(a/2) exp(-a|z|), a = eps / sensitivity = 0.25. Chi-square on |z| <= 15 plus
    # the two tails; false-failure rate 1e-6. Half the noise (a = 0.5) is caught.
    a = 0.25
    release = mechanisms.discrete_laplace(np.zeros(N, np.int64), l1_sensitivity=2, epsilon=0.5)
    assert release.event == dp_event.DiscreteLaplaceDpEvent(noise_parameter=a, sensitivity=2)
    assert release.value.dtype == np.int64
    support = np.arange(-15, 16)

    def chi2_pvalue(draws):
        pmf = math.tanh(a / 2) * np.exp(-a * np.abs(support))
        expected = np.r_[(1 - pmf.sum()) / 2, pmf, (1 - pmf.sum()) / 2] * N
        observed = np.r_[np.sum(draws < -15), [np.sum(draws == z) for z in support],
                         np.sum(draws > 15)]
        return stats.chisquare(observed, expected).pvalue
    assert chi2_pvalue(release.value) > FALSE_FAILURE
    half = mechanisms.discrete_laplace(np.zeros(N, np.int64), l1_sensitivity=1, epsilon=0.5)
    assert chi2_pvalue(half.value) < FALSE_FAILURE


def test_discrete_gaussian_variance_and_event():
    release = mechanisms.discrete_gaussian(np.zeros(N, np.int64), l2_sensitivity=1.0,
                                           epsilon=1.0, delta=1e-6)
    rho = release.event.rho
    sigma = math.sqrt(1.0 / (2 * rho))
    assert release.epsilon(1e-6) <= 1.0 + 1e-6
    assert sigma >= mechanisms.gaussian_sigma(l2_sensitivity=1.0, epsilon=1.0, delta=1e-6)
    # For sigma >= 1 the discrete Gaussian's variance is sigma^2 to < 1e-8 (CKS 2020). Sample
    # variance of 20,000 normal draws: relative sd 1%; +-6% is 6 sd (false failure ~ 2e-9).
    assert np.var(release.value) == pytest.approx(sigma ** 2, rel=0.06)


def test_vectors_and_bad_inputs():
    assert mechanisms.laplace(2.0, l1_sensitivity=1.0, epsilon=1.0).value.shape == ()
    assert mechanisms.gaussian(np.zeros((3, 4)), l2_sensitivity=1.0, epsilon=1.0,
                               delta=1e-5).value.shape == (3, 4)
    with pytest.raises(ValueError, match="finite"):
        mechanisms.laplace([1.0, math.nan], l1_sensitivity=1.0, epsilon=1.0)
    with pytest.raises(ValueError, match="epsilon"):
        mechanisms.laplace([1.0], l1_sensitivity=1.0, epsilon=0.0)
    with pytest.raises(ValueError, match="integers"):
        mechanisms.discrete_laplace([1.5], l1_sensitivity=1, epsilon=1.0)
    with pytest.raises(ValueError, match="delta"):
        mechanisms.gaussian([1.0], l2_sensitivity=1.0, epsilon=1.0, delta=0.0)


def test_reused_measurements_draw_fresh_noise():
    # Measurements and calibrations are cached per parameter set; the noise must not be. Two
    # draws of 100 exact Laplace / Gaussian values coincide with probability ~0.
    first = mechanisms.laplace(np.zeros(100), l1_sensitivity=1.0, epsilon=1.0).value
    second = mechanisms.laplace(np.zeros(100), l1_sensitivity=1.0, epsilon=1.0).value
    assert not np.array_equal(first, second)
    first = mechanisms.discrete_gaussian(np.zeros(100, np.int64), l2_sensitivity=1.0,
                                         epsilon=1.0, delta=1e-6)
    second = mechanisms.discrete_gaussian(np.zeros(100, np.int64), l2_sensitivity=1.0,
                                          epsilon=1.0, delta=1e-6)
    assert first.event == second.event and not np.array_equal(first.value, second.value)


def test_count_and_sum_split_epsilon_in_half_and_scale_the_sum_by_its_bound():
    # Closed form: count noise Lap(2 / eps), sum noise Lap(2 B / eps); the composed event is
    # eps-DP (pure, so PLD's epsilon at a tiny delta is eps). A sum at half its noise is caught.
    release = mechanisms.laplace_count_and_sum(np.zeros(N), np.zeros(N), value_bound=3.0,
                                               epsilon=1.0)
    counts, sums = release.value
    assert stats.kstest(counts, stats.laplace(scale=2.0).cdf).pvalue > FALSE_FAILURE
    assert stats.kstest(sums, stats.laplace(scale=6.0).cdf).pvalue > FALSE_FAILURE
    assert stats.kstest(sums / 2, stats.laplace(scale=6.0).cdf).pvalue < FALSE_FAILURE
    assert release.epsilon(1e-12) == pytest.approx(1.0, rel=1e-3)
    assert [event.noise_multiplier for event in release.event.events] == pytest.approx([2, 2])


@pytest.mark.parametrize("epsilon,delta", [(1.0, 0.2), (2.0, 0.05)])
def test_release_epsilon_counts_additional_delta_against_delta(epsilon, delta):
    # Laplace at sensitivity 1, scale 1/eps has the exact curve delta(e) = 1 - exp((e - eps)/2)
    # (its hockey-stick divergence), so epsilon(delta) = eps + 2 ln(1 - delta) in closed form.
    release = mechanisms.Release(0.0, dp_event.LaplaceDpEvent(1.0 / epsilon), additional_delta=0.1)
    expected = epsilon + 2.0 * math.log(1.0 - delta)
    assert release.epsilon(delta + 0.1) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="additional_delta"):
        release.epsilon(0.05)


@pytest.mark.parametrize("maker,release", [
    ("make_laplace", lambda: mechanisms.laplace([0.0], l1_sensitivity=1.0, epsilon=1.0)),
    ("make_gaussian", lambda: mechanisms.gaussian_with_noise_multiplier(
        [0.0], l2_sensitivity=1.0, noise_multiplier=2.0)),
    ("make_gaussian", lambda: mechanisms.discrete_gaussian(
        [0], l2_sensitivity=1.5, epsilon=1.0, delta=1e-6)),
])
def test_a_mechanism_built_with_less_noise_than_calibrated_is_refused(monkeypatch, maker, release):
    # The event is read back from OpenDP's privacy map; if what is built spends more than the
    # calibration (here 2/3 of the scale: 1.5x epsilon, 2/3 of the multiplier), the
    # release must stop rather than return a value with an event that understates it.
    build = getattr(additive.measurements, maker)
    monkeypatch.setattr(additive.measurements, maker,
                        lambda *args, scale, **kw: build(*args, scale=scale / 1.5, **kw))
    # Measurements are cached per parameter set: build this one afresh, and drop the weakened
    # one afterwards so no later test reuses it.
    additive._measurement.cache_clear()
    monkeypatch.setattr(additive, "_measurement",
                        functools.lru_cache(maxsize=256)(additive._measurement.__wrapped__))
    with pytest.raises(RuntimeError, match="does not give the calibrated guarantee"):
        release()


def test_the_noise_scale_and_event_do_not_depend_on_the_vectors_length(monkeypatch):
    """Partition selection noises one count per partition the DATA holds, so a scale, a
    threshold or an event that moved with the vector's length would depend on one unit's
    records (the lattice term was size 2^k in L1, sqrt(size) 2^k in L2). Deterministic. The
    noised vectors stop at 10^5 coordinates (10^6 took 30 s of OpenDP's exact sampling): that
    term moved a scale by a relative 2^-45 or more already from 1 to 1,000 coordinates, above a
    double's 2^-52, so the third length checks no other term."""
    scales = []
    build = additive._measurement
    monkeypatch.setattr(additive, "_measurement",
                        lambda *args: scales.append(args[3]) or build(*args))
    for noise in (lambda v: mechanisms.laplace(v, l1_sensitivity=2.0, epsilon=1.0),
                  lambda v: mechanisms.gaussian(v, l2_sensitivity=2.0, epsilon=1.0,
                                                delta=1e-6)):
        scales.clear()
        events = [noise(np.zeros(size)).event for size in (1, 1000, 10 ** 5)]
        assert len(set(scales)) == 1 and events[0] == events[1] == events[2]
    assert len({selection._gaussian_threshold_calibration(4, 1.0, 1e-6, size)[1]
                for size in (1, 1000, 10 ** 6)}) == 1
    with pytest.raises(ValueError, match="at most 68719476736"):
        additive.gaussian_lattice(l2_sensitivity=1.0, size=2 ** 36 + 1, noise_multiplier=1.0)
