"""Private selection for tuning (mechanisms/private_selection.py): K follows its law, only the
best trial is released, and the ledger's rdp accountant charges Papernot-Steinke's bound.

Statistical tests draw at fixed seeds; each bound's false-failure rate is stated with it. The
audit (the accounted epsilon against an empirical lower bound, and the best of a fixed K
accounted as one trial caught) is in tests/audit/test_audit.py."""
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

from sage_tfx import mechanisms
from sage_tfx.mechanisms.private_selection import (PoissonTrials, Selected,
                                                   TruncatedNegativeBinomial, private_selection)
from sage_tfx.randomness import secret_rng
from sage_tfx.sage_access import BlockIds, BlockLedger
from sage_tfx.sage_access.accounting import DEFAULT_RDP_ORDERS, event_to_json, rdp_curve_of
from sage_tfx.sage_access.views import describe_event

LAWS = [(1.0, 0.25), (0.0, 0.1), (0.5, 0.3), (2.0, 0.5)]  # (eta, gamma)
TRIAL = dp_event.LaplaceDpEvent(noise_multiplier=1.0)


def scipy_law(eta: float, gamma: float):
    """The truncated negative binomial from scipy (an independent oracle): NegBin(eta, gamma)
    conditioned on K >= 1, or the logarithmic law for eta = 0. (pmf, mean)."""
    if eta == 0:
        law = stats.logser(1.0 - gamma)
        return law.pmf, law.mean()
    law = stats.nbinom(eta, gamma)
    kept = 1.0 - law.pmf(0)
    return (lambda k: law.pmf(k) / kept), law.mean() / kept


@pytest.mark.parametrize("eta, gamma", LAWS)
def test_the_number_of_trials_follows_the_truncated_negative_binomial(eta, gamma):
    """20,000 draws at a fixed seed against scipy's law: a chi-square test over the values
    with expected count >= 5 (the tail pooled), failing at p < 1e-4 (its false-failure rate),
    and the closed-form pmf and mean equal scipy's."""
    law = TruncatedNegativeBinomial(eta, gamma)
    pmf, mean = scipy_law(eta, gamma)
    assert law.mean == pytest.approx(mean, rel=1e-12)
    assert [law.probability(k) for k in range(1, 30)] == pytest.approx(
        [pmf(k) for k in range(1, 30)], rel=1e-10)
    draws = 20_000
    rng = secret_rng(11)
    counts = np.bincount([law.draw(rng) for _ in range(draws)])
    assert counts[0] == 0  # truncated: K >= 1
    top = max(k for k in range(1, 200) if draws * pmf(k) >= 5)
    observed = list(counts[1:top + 1]) + [counts[top + 1:].sum()]
    expected = [draws * pmf(k) for k in range(1, top + 1)]
    expected.append(draws - sum(expected))
    assert stats.chisquare(observed + [0] * (len(expected) - len(observed)),
                           expected).pvalue > 1e-4


def test_poisson_trials_follow_their_law_and_may_be_none():
    """K ~ Poisson(mean): 20,000 draws' mean within 4.5 standard errors (false failure < 1e-5);
    K = 0 releases None without running a trial."""
    rng = secret_rng(12)
    draws = [PoissonTrials(3.0).draw(rng) for _ in range(20_000)]
    assert abs(np.mean(draws) - 3.0) < 4.5 * math.sqrt(3.0 / 20_000)

    def never(candidate):
        raise AssertionError("no trial may run when K = 0")
    released = [private_selection(3, never, TRIAL, PoissonTrials(1e-9), secret_rng(seed))
                for seed in range(5)]
    assert all(release.value is None for release in released)
    assert released[0].event == dp_event.RepeatAndSelectDpEvent(TRIAL, 1e-9, math.inf)


def test_the_selection_runs_as_many_trials_as_the_law_draws_on_uniform_candidates():
    """The number of trials each selection runs, over 4,000 selections, against the law
    (chi-square, false failure 1e-4), and the candidates' frequencies against uniform: a
    selection that ran a fixed number of trials, or walked through the candidates in order,
    fails (the theorems need K random and the trials i.i.d.)."""
    law, rng = TruncatedNegativeBinomial(1.0, 0.25), secret_rng(13)
    pmf, _ = scipy_law(1.0, 0.25)
    trials_run, candidates = [], []

    def trial(candidate):
        candidates.append(candidate)
        return mechanisms.Release(np.array([0.0]), TRIAL)
    for _ in range(4_000):
        before = len(candidates)
        private_selection(3, trial, TRIAL, law, rng)
        trials_run.append(len(candidates) - before)
    counts = np.bincount(trials_run, minlength=40)
    top = max(k for k in range(1, 40) if 4_000 * pmf(k) >= 5)
    expected = [4_000 * pmf(k) for k in range(1, top + 1)]
    observed = list(counts[1:top + 1]) + [counts[top + 1:].sum()]
    assert counts[0] == 0
    assert stats.chisquare(observed, expected + [4_000 - sum(expected)]).pvalue > 1e-4
    assert stats.chisquare(np.bincount(candidates, minlength=3)).pvalue > 1e-4


def test_only_the_best_trial_is_released_and_ties_go_to_the_smaller_candidate():
    scores = {0: 0.5, 1: 2.0, 2: 2.0, 3: -1.0}
    for seed in range(20):
        ran = []

        def trial(candidate):
            ran.append(candidate)
            return mechanisms.Release(np.array([scores[candidate]]), TRIAL)
        release = private_selection(4, trial, TRIAL, TruncatedNegativeBinomial(1.0, 0.2),
                                    secret_rng(seed))
        best = max(ran, key=lambda c: (scores[c], -c))
        assert release.value == Selected(scores[best], best)
    assert release.event == dp_event.RepeatAndSelectDpEvent(
        TRIAL, TruncatedNegativeBinomial(1.0, 0.2).mean * (1 + 1e-12), 1.0)


def test_a_trial_that_runs_another_mechanism_stops_the_selection():
    def trial(candidate):
        return mechanisms.Release(np.array([1.0]), dp_event.LaplaceDpEvent(noise_multiplier=0.5))
    with pytest.raises(RuntimeError, match="not the accounted"):
        private_selection(2, trial, TRIAL, TruncatedNegativeBinomial(1.0, 0.5), secret_rng(0))

    def thresholded(candidate):  # partition selection's delta has no RDP curve
        return mechanisms.Release(np.array([1.0]), TRIAL, additional_delta=1e-6)
    with pytest.raises(RuntimeError, match="additional delta 1e-06"):
        private_selection(2, thresholded, TRIAL, TruncatedNegativeBinomial(1.0, 0.5),
                          secret_rng(0))


@pytest.mark.parametrize("law, message", [
    (lambda: TruncatedNegativeBinomial(-0.5, 0.5), "shape"),
    (lambda: TruncatedNegativeBinomial(math.inf, 0.5), "shape"),
    (lambda: TruncatedNegativeBinomial(1.0, 1.0), "gamma"),
    (lambda: TruncatedNegativeBinomial(1.0, 0.0), "gamma"),
    (lambda: PoissonTrials(0.0), "Poisson mean"),
    (lambda: private_selection(2, None, TRIAL, 4), "TruncatedNegativeBinomial or"),
    (lambda: private_selection(0, None, TRIAL, PoissonTrials(1.0)), "candidates"),
])
def test_bad_parameters_get_a_clear_error(law, message):
    with pytest.raises(ValueError, match=message):
        law()


def theorem_2(orders, trial_curve, eta, gamma, mean):
    """Papernot-Steinke Theorem 2 on a grid of orders, written out here as an oracle:
    epsilon(l) + (1 + eta) min_lh [(1 - 1/lh) epsilon(lh) + ln(1/gamma) / lh] + ln(E K)/(l - 1),
    then RDP's monotonicity (a bound at a higher order holds at a lower one)."""
    orders, trial_curve = np.asarray(orders), np.asarray(trial_curve)
    offset = (1 + eta) * np.min((1 - 1 / orders) * trial_curve + math.log(1 / gamma) / orders)
    bound = trial_curve + offset + math.log(mean) / (orders - 1)
    return np.minimum.accumulate(bound[::-1])[::-1]


@pytest.mark.parametrize("eta, gamma", LAWS)
def test_the_accounted_curve_is_theorem_2_of_one_trials_curve(eta, gamma):
    """dp_accounting's RepeatAndSelectDpEvent on the ledger's orders is Theorem 2 (to its
    bisection for gamma, which only loosens it), for a Laplace and a Gaussian trial."""
    law = TruncatedNegativeBinomial(eta, gamma)
    for trial in (TRIAL, dp_event.GaussianDpEvent(noise_multiplier=3.0)):
        one = rdp_curve_of([trial], DEFAULT_RDP_ORDERS)
        accounted = rdp_curve_of([law.selection_event(trial)], DEFAULT_RDP_ORDERS)
        exact = theorem_2(DEFAULT_RDP_ORDERS, one, eta, gamma, law.mean)
        assert np.all(accounted >= exact)
        assert accounted == pytest.approx(exact, rel=1e-6)
        assert np.all(accounted > one)


def test_the_poisson_curve_is_theorem_6_of_one_trials_curve():
    """Theorem 6: epsilon(l) + mu delta_hat + ln(mu)/(l - 1), delta_hat the trial's delta at
    epsilon_hat = ln(1 + 1/(l - 1)) (dp_accounting's conversion of its curve), then
    monotonicity is not applied (each order stands alone)."""
    trial, mu = dp_event.GaussianDpEvent(noise_multiplier=3.0), 4.0
    orders = DEFAULT_RDP_ORDERS
    one = rdp_curve_of([trial], orders)
    accounted = rdp_curve_of([PoissonTrials(mu).selection_event(trial)], orders)
    for order, single, charged in zip(orders, one, accounted):
        delta_hat, _ = rdp_privacy_accountant.compute_delta(
            orders, one, math.log1p(1 / (order - 1)))
        assert charged == pytest.approx(single + mu * delta_hat + math.log(mu) / (order - 1),
                                        rel=1e-9)


def test_an_rdp_ledger_records_and_charges_the_selection_curve():
    """A grant whose tuning step runs private selection: the rdp ledger charges its curve, the
    grant records the event, and a basic ledger charges the grant's (epsilon, delta)."""
    event = TruncatedNegativeBinomial(1.0, 0.25).selection_event(TRIAL)
    ledger = BlockLedger.create(":memory:", accounting="rdp", min_request_epsilon=0.01)
    ledger.add_block("b0", 10.0, 1e-6)
    grant = ledger.request(BlockIds(["b0"]), epsilon=1.0, delta=1e-7,
                           split={"tuning": 1.0}, events={"tuning": event})
    assert ledger.grant_event(grant, "tuning") == event
    assert describe_event(event_to_json(event)) == \
        "best of K~(mean 4, shape 1) x Laplace(noise_multiplier=1)"
    poisson = PoissonTrials(4.0).selection_event(TRIAL)  # shape infinity, recorded as JSON
    grant = ledger.request(BlockIds(["b0"]), epsilon=1.0, delta=1e-7,
                           split={"tuning": 1.0}, events={"tuning": poisson})
    assert ledger.grant_event(ledger.find_grant(grant.grant_id), "tuning") == poisson
    assert np.allclose(ledger.block("b0").spent.astype(float),
                       rdp_curve_of([event], ledger.orders) + rdp_curve_of([poisson],
                                                                           ledger.orders))
    basic = BlockLedger.create(":memory:", min_request_epsilon=0.01)
    basic.add_block("b0", 10.0, 1e-6)
    basic.request(BlockIds(["b0"]), epsilon=1.0, delta=1e-7, split={"tuning": 1.0},
                  events={"tuning": event})
    assert [float(v) for v in basic.block("b0").spent] == [1.0, 1e-7]
