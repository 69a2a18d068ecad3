"""SLAed validation tests: their guarantees hold at the edge, they decide when the evidence is
clear, their noise has the stated scale, and bad input gets a clear error.

Statistical tests: R independent validations at a fixed seed; a test fails only if the number
of wrong decisions exceeds the 1 - 1e-4 quantile of Binomial(R, eta), the worst case the
guarantee allows. False-failure rate <= 1e-4 per assertion."""
import math

import numpy as np
import pytest
from scipy import stats

from sage_tfx.validators import (ACCEPT, REJECT, RETRY, accuracy_validator, loss_validator,
                                 sum_statistic_validator)
from sage_tfx.validators import slaed
from sage_tfx.validators.slaed import DPMeanRelease, bernstein_lower, bernstein_upper

RUNS = 1500
FALSE_FAILURE = 1e-4


def allowed_errors(eta: float) -> int:
    return int(stats.binom.ppf(1.0 - FALSE_FAILURE, RUNS, eta))


def wrong_decisions(decide, draw, rng) -> int:
    return sum(decide(draw(rng), rng) for _ in range(RUNS))


@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_loss_accept_and_reject_guarantees_hold_at_the_edge(confidence):
    eta = (1 - confidence) / 2
    rng = np.random.default_rng(1)
    # Losses B * Beta(2, 5): mean B * 2/7. Targets a hair on either side of the mean, where a
    # validator without its DP correction errs often.
    bound, n = 2.0, 400
    mean = bound * 2 / 7

    def draw(rng):
        return bound * rng.beta(2, 5, size=n)

    accepted_above = wrong_decisions(
        lambda losses, rng: loss_validator(losses, mean - 0.01, 1.0, confidence,
                                           bound).outcome == ACCEPT, draw, rng)
    # The setting can tell: accepting on the DP estimate alone ("No SLA") errs far more often.
    naive_accepted_above = wrong_decisions(
        lambda losses, rng: loss_validator(losses, mean - 0.01, 1.0, confidence,
                                           bound).dp_estimate <= mean - 0.01, draw, rng)
    assert naive_accepted_above > 3 * allowed_errors(eta)
    rejected_below = wrong_decisions(
        lambda losses, rng: loss_validator(losses, mean + 0.01, 1.0, confidence,
                                           bound).outcome == REJECT, draw, rng)
    assert accepted_above <= allowed_errors(eta)
    assert rejected_below <= allowed_errors(eta)


def test_loss_validator_decides_when_the_evidence_is_clear():
    rng = np.random.default_rng(2)
    losses = rng.beta(2, 5, size=20_000)  # mean 0.286
    good = loss_validator(losses, 0.35, 1.0, 0.95, 1.0)
    bad = loss_validator(losses, 0.22, 1.0, 0.95, 1.0)
    unsure = loss_validator(losses[:50], 0.35, 1.0, 0.95, 1.0)
    assert (good.outcome, bad.outcome, unsure.outcome) == (ACCEPT, REJECT, RETRY)
    assert good.lower_bound <= 0.286 <= good.upper_bound <= 0.35
    assert abs(good.dp_estimate - losses.mean()) < 0.01


def test_accuracy_guarantees_and_decisions():
    eta = 0.025
    rng = np.random.default_rng(3)
    accuracy, n = 0.8, 600

    def draw(rng):
        return rng.random(n) < accuracy

    accepted_below = wrong_decisions(
        lambda correct, rng: accuracy_validator(correct, accuracy + 0.01, 1.0,
                                                0.95).outcome == ACCEPT, draw, rng)
    rejected_above = wrong_decisions(
        lambda correct, rng: accuracy_validator(correct, accuracy - 0.01, 1.0,
                                                0.95).outcome == REJECT, draw, rng)
    assert accepted_below <= allowed_errors(eta)
    assert rejected_above <= allowed_errors(eta)
    correct = rng.random(20_000) < accuracy
    result = accuracy_validator(correct, 0.75, 1.0, 0.95)
    assert result.outcome == ACCEPT and result.lower_bound >= 0.75
    assert accuracy_validator(correct, 0.85, 1.0, 0.95).outcome == REJECT


def test_sum_statistic_error_bound_holds_and_accepts_with_data():
    eta = 0.025
    rng = np.random.default_rng(4)
    low, high = 0.0, 60.0  # speeds in mph, population mean 30

    def violated(values, rng):
        result = sum_statistic_validator(values, 3.0, 1.0, 0.95, (low, high))
        return result.outcome == ACCEPT and abs(result.dp_estimate - 30.0) > 3.0

    assert wrong_decisions(violated, lambda rng: rng.uniform(low, high, size=1500),
                           rng) <= allowed_errors(eta)
    many = sum_statistic_validator(rng.uniform(low, high, 20_000), 1.5, 1.0, 0.95, (low, high))
    assert many.outcome == ACCEPT and abs(many.dp_estimate - 30.0) <= 1.5
    few = sum_statistic_validator(rng.uniform(low, high, 30), 1.5, 1.0, 0.95, (low, high))
    assert few.outcome == RETRY  # never REJECT: more data always tightens the bound


@pytest.mark.slow
def test_noise_has_the_stated_laplace_scales():
    releases = [DPMeanRelease.of(np.full(100, 0.5), 4.0, 0.5) for _ in range(20_000)]
    counts = np.array([r.dp_count for r in releases]) - 100
    sums = np.array([r.dp_sum for r in releases]) - 50
    # Kolmogorov-Smirnov against Lap(2/eps) and Lap(2B/eps); false-failure rate 1e-4 each.
    assert stats.kstest(counts, stats.laplace(scale=2 / 0.5).cdf).pvalue > FALSE_FAILURE
    assert stats.kstest(sums, stats.laplace(scale=2 * 4.0 / 0.5).cdf).pvalue > FALSE_FAILURE


def test_bernstein_bounds_bracket_the_mean():
    assert bernstein_lower(0.3, 1000, 0.01, 1.0) < 0.3 < bernstein_upper(0.3, 1000, 0.01, 1.0)
    # The upper bound's last term scales with the range B (Listing 2 omits the factor).
    assert bernstein_upper(0.0, 100, 0.01, 5.0) == pytest.approx(4 * 5.0 * math.log(100) / 100)


def test_bad_input_gets_a_clear_error_and_bad_predictions_do_not_crash():
    losses = np.array([0.1, 0.2])
    with pytest.raises(ValueError, match="target"):
        loss_validator(losses, 1.5, 1.0, 0.95, loss_bound=1.0)
    with pytest.raises(ValueError, match="target"):
        accuracy_validator([1, 0], -0.1, 1.0)
    with pytest.raises(ValueError, match="confidence"):
        loss_validator(losses, 0.5, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="loss_bound"):
        loss_validator(losses, 0.5, 1.0, 0.95, 0.0)
    with pytest.raises(ValueError, match="epsilon"):
        sum_statistic_validator([1.0], 0.5, 0.0, 0.95, (0.0, 1.0))
    with pytest.raises(ValueError, match="value_range"):
        sum_statistic_validator([1.0], 0.5, 1.0, 0.95, (1.0, 1.0))
    # NaN and infinite losses count as B: all-bad predictions can never be accepted.
    rng = np.random.default_rng(6)
    broken = loss_validator(np.full(5000, np.nan), 0.5, 1.0, 0.95, 1.0)
    assert broken.outcome == REJECT and broken.lower_bound > 0.9
    mixed = loss_validator(np.r_[np.zeros(5000), np.full(5000, np.inf)], 0.3, 1.0, 0.95, 1.0)
    assert mixed.outcome == REJECT
    assert accuracy_validator(np.full(5000, np.nan), 0.5, 1.0, 0.95).outcome == REJECT


# Where the DP correction decides (issue 24): small epsilon, large n. At epsilon = 0.005 and
# n = 20,000 the Laplace corrections (~ 0.08 on a mean in [0, 1]) are several times the
# Bernstein and Hoeffding slack (~ 0.012), so a validator without them (every laplace_tail = 0,
# hence dp_error = 0) is wrong far more often than eta. The validators use only the count and sum of
# a test set, so a Bernoulli(mu) test set is drawn as its Binomial(n, mu) number of ones.
SMALL_EPSILON, LARGE_N = 0.005, 20_000


def bernoulli_test_set(mean):
    def draw(rng):
        values = np.zeros(LARGE_N)
        values[:rng.binomial(LARGE_N, mean)] = 1.0
        return values
    return draw


def without_laplace_corrections(monkeypatch):
    from sage_tfx.validators import slaed
    monkeypatch.setattr(slaed, "laplace_tail", lambda scale, probability, two_sided=False: 0.0)


def test_loss_accept_guarantee_holds_where_the_dp_correction_decides(monkeypatch):
    eta, mean = 0.025, 0.3
    target = mean - 0.001  # the true expected loss is just above the target: ACCEPT is wrong

    def accepted(losses, rng):
        return loss_validator(losses, target, SMALL_EPSILON, 0.95, 1.0).outcome == ACCEPT
    assert wrong_decisions(accepted, bernoulli_test_set(mean),
                           np.random.default_rng(7)) <= allowed_errors(eta)
    # It is not a validator that never accepts: its upper bound is ~mean + 0.13 here, above
    # mean + 0.4 only if the sum noise exceeds ~4,900 (probability < 1e-5).
    assert loss_validator(bernoulli_test_set(mean)(np.random.default_rng(7)), mean + 0.4,
                          SMALL_EPSILON, 0.95, 1.0).outcome == ACCEPT
    without_laplace_corrections(monkeypatch)
    broken = wrong_decisions(accepted, bernoulli_test_set(mean), np.random.default_rng(7))
    assert broken > 3 * allowed_errors(eta), broken


def test_sum_statistic_guarantee_holds_where_the_dp_correction_decides(monkeypatch):
    eta, mean = 0.025, 0.5

    def accepted_and_wrong(target):
        def decide(values, rng):
            result = sum_statistic_validator(values, target, SMALL_EPSILON, 0.95, (0.0, 1.0))
            return result.outcome == ACCEPT and abs(result.dp_estimate - mean) > target
        return decide

    draw = bernoulli_test_set(mean)
    # The error bound here is ~0.20 (DP 0.19 + sampling 0.012; it exceeds 0.3 only if the count
    # noise is below -7,000, probability 1e-8 per run): at target 0.3 the validator ACCEPTs
    # every run, at 0.015 it must RETRY. Wrong ACCEPTs stay within eta at both.
    rng = np.random.default_rng(8)
    at_loose = [sum_statistic_validator(draw(rng), 0.3, SMALL_EPSILON, 0.95, (0.0, 1.0))
                for _ in range(RUNS)]
    assert all(result.outcome == ACCEPT for result in at_loose)
    assert sum(abs(result.dp_estimate - mean) > 0.3 for result in at_loose) <= allowed_errors(eta)
    assert wrong_decisions(accepted_and_wrong(0.015), draw,
                           np.random.default_rng(8)) <= allowed_errors(eta)
    # Without the corrections the bound is the sampling term alone (0.012), so it ACCEPTs at
    # 0.015 while the Laplace noise on the mean (scale 0.02) exceeds 0.015 in ~47% of runs.
    without_laplace_corrections(monkeypatch)
    broken = wrong_decisions(accepted_and_wrong(0.015), draw, np.random.default_rng(8))
    assert broken > 3 * allowed_errors(eta), broken


def _listing2_bounds(dp_count, dp_sum, value_range, epsilon, confidence):
    """Sage Listing 2's bounds (with the 4 R L / n correction), written out from the paper: eta
    = (1 - confidence) / 2 split in three; one-sided Laplace correction b ln(3 / (2 eta)),
    two-sided b ln(3 / eta); Bernstein at probability eta / 3, so L = ln(3 / eta)."""
    eta = (1 - confidence) / 2
    one_sided, two_sided, log_term = math.log(3 / (2 * eta)), math.log(3 / eta), math.log(3 / eta)
    count_low = dp_count - 2 / epsilon * one_sided
    mean_high = (dp_sum + 2 * value_range / epsilon * one_sided) / count_low
    upper = (mean_high + math.sqrt(2 * value_range * mean_high * log_term / count_low)
             + 4 * value_range * log_term / count_low)
    count_slack = 2 / epsilon * two_sided
    reject_count_low = dp_count - count_slack
    mean_low = max(dp_sum - 2 * value_range / epsilon * one_sided, 0) / (dp_count + count_slack)
    a = math.sqrt(2 * value_range * log_term / reject_count_low)
    excess = max(0.0, mean_low - 2 * value_range * log_term / (3 * reject_count_low))
    lower = ((-a + math.sqrt(a * a + 4 * excess)) / 2) ** 2
    return lower, upper


@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_loss_bounds_are_listing2s_closed_form(confidence):
    # Pins every correction's probability share: a bound looser than Listing 2 wastes data, a
    # tighter one breaks the guarantee; neither shows in a pass/fail run at the edge.
    losses = np.random.default_rng(5).uniform(0.0, 2.0, 3000)
    result = loss_validator(losses, 0.9, epsilon=0.5, confidence=confidence, loss_bound=2.0)
    dp_sum = result.dp_estimate * result.dp_count
    lower, upper = _listing2_bounds(result.dp_count, dp_sum, 2.0, 0.5, confidence)
    assert result.upper_bound == pytest.approx(upper, rel=1e-9)
    assert result.lower_bound == pytest.approx(lower, rel=1e-9)
    accuracy = accuracy_validator(losses < 1.0, 0.5, epsilon=0.5, confidence=confidence)
    error_lower, error_upper = _listing2_bounds(
        accuracy.dp_count, (1 - accuracy.dp_estimate) * accuracy.dp_count, 1.0, 0.5, confidence)
    assert accuracy.lower_bound == pytest.approx(1 - error_upper, rel=1e-9)
    assert accuracy.upper_bound == pytest.approx(1 - error_lower, rel=1e-9)


def test_sum_statistic_error_bound_is_its_closed_form():
    # (t_S + R t_n) / n_dp + R sqrt(ln(2 / p) / (2 n_low)), t two-sided at p = eta / 3.
    epsilon, confidence, width = 0.5, 0.95, 4.0
    values = np.random.default_rng(6).uniform(-1.0, 3.0, 5000)
    result = sum_statistic_validator(values, 0.5, epsilon, confidence, value_range=(-1.0, 3.0))
    p = (1 - confidence) / 2 / 3
    count_slack = 2 / epsilon * math.log(1 / p)
    bound = ((2 * width / epsilon * math.log(1 / p) + width * count_slack) / result.dp_count
             + width * math.sqrt(math.log(2 / p) / (2 * (result.dp_count - count_slack))))
    assert result.details["error_bound"] == pytest.approx(bound, rel=1e-9)
    assert result.lower_bound == pytest.approx(result.dp_estimate - bound, rel=1e-9)


def test_bernstein_bounds_without_data_are_trivial():
    # No observation: nothing is known beyond the range [0, R], so the bounds are 0 and infinity
    # (a lower bound above 0 would let REJECT fire with no evidence).
    assert bernstein_lower(0.7, 0, 0.01, 1.0) == 0.0
    assert bernstein_upper(0.7, 0, 0.01, 1.0) == math.inf


def test_release_with_too_few_records_bounds_nothing():
    # 5 records at epsilon 0.1: the count's correction (2 / 0.1) ln(3 / eta) ~ 96 exceeds the
    # count, so neither test has evidence: lower bound 0, upper bound infinity (a lower bound
    # above the target here would REJECT on noise alone).
    release = DPMeanRelease(dp_count=5.0, dp_sum=4.0, value_range=1.0, epsilon=0.1)
    assert slaed.mean_lower_bound(release, 0.025) == 0.0
    assert slaed.mean_upper_bound(release, 0.025) == math.inf


def test_the_dp_metric_stays_finite_and_in_range_when_the_noisy_count_is_not_positive():
    # 3 losses at epsilon 0.01: the count's Laplace noise (scale 200) makes n_dp <= 0 about half
    # the time, and the sum's noise pushes S_dp / n_dp far outside [0, B]. The released metric
    # is post-processed into [0, B] and never NaN (200 runs: a NaN or an out-of-range value in
    # any of them fails).
    for _ in range(200):
        result = slaed.loss_validator([0.1, 0.2, 0.3], target=0.5, epsilon=0.01, loss_bound=1.0)
        assert 0.0 <= result.dp_estimate <= 1.0


def test_sum_statistic_counts_a_nan_value_as_the_midpoint_instead_of_refusing():
    # One bad value must not decide whether the validator runs (issue 16 §2): with the NaN
    # mapped to the midpoint 0.5, the release is that of the same data holding 0.5.
    values = np.full(4000, 0.25)
    values[0] = np.nan
    result = slaed.sum_statistic_validator(values, target_abs_error=0.3, epsilon=50.0,
                                           value_range=(0.0, 1.0))
    # Noise at epsilon 50 on 4,000 values moves the mean by ~1e-5; the NaN moves it by 0.25/4000.
    assert result.dp_estimate == pytest.approx(0.25 + 0.25 / 4000, abs=5e-4)
    assert math.isfinite(result.lower_bound) and math.isfinite(result.upper_bound)
