"""The baseline test: ACCEPT only a model that beats every public baseline (each class always
predicted, a previously blessed model) by the margin."""
import numpy as np
import pytest

from sage_tfx.validators.executor import baseline_losses, validate
from sage_tfx.validators.slaed import (ACCEPT, REJECT, RETRY, Metric, _bounded_losses,
                                       baseline_gap_sum, baseline_gap_validator)

BASE_RATE = 0.771  # the taxi template's majority class (no big tip), as the issue measured


def _labels(rng, n):
    return (rng.random(n) >= BASE_RATE).astype(np.int64)  # class 0 with probability 0.771


def test_one_record_moves_the_statistic_by_at_most_twice_the_bound():
    # The sensitivity the Laplace release is calibrated to (2B): over random data, adding any
    # one record moves S by a value in [0, 2B].
    rng = np.random.default_rng(5)
    for _ in range(300):
        n, k, bound = rng.integers(1, 40), rng.integers(1, 4), float(rng.choice([1.0, 7.5]))
        model = rng.random(n + 1) * bound
        baselines = rng.random((n + 1, k)) * bound
        if rng.random() < 0.3:  # losses at the bound's edges
            model[-1], baselines[-1] = rng.choice([0.0, bound]), rng.choice([0.0, bound])
        moved = (baseline_gap_sum(model, baselines, bound)
                 - baseline_gap_sum(model[:-1], baselines[:-1], bound))
        assert -1e-9 <= moved <= 2 * bound + 1e-9


def test_the_majority_class_model_is_never_blessed():
    """A model that always predicts the majority class (accuracy 0.771, the base rate) passes an
    accuracy target of 0.6; against the class baselines it must not be ACCEPTed. 200 runs at
    n = 3,000: each ACCEPT has probability <= 0.025 (eta at confidence 0.95), so more than 16
    ACCEPTs has probability < 1e-4 (binomial tail); we see none. The broken variant, the
    target test alone (no baselines), ACCEPTs it in nearly every run."""
    rng = np.random.default_rng(11)
    accepted, accepted_without_baselines = 0, 0
    for _ in range(200):
        labels = _labels(rng, 3000)
        correct = (labels == 0).astype(np.float64)
        baselines = baseline_losses(Metric.ACCURACY, None, labels, np.zeros(len(labels)), (),
                                    None)
        result, gap = validate(Metric.ACCURACY, correct, baselines, 0.6, 1.0, 0.95, None, 0.0)
        accepted += result.outcome == ACCEPT
        assert result.outcome in (RETRY, ACCEPT) and gap.outcome in (RETRY, ACCEPT)
        alone, _ = validate(Metric.ACCURACY, correct, baselines, 0.6, 1.0, 0.95, None, None)
        accepted_without_baselines += alone.outcome == ACCEPT
    assert accepted <= 16
    assert accepted_without_baselines >= 190


def test_a_model_better_than_every_baseline_is_accepted():
    # Accuracy 0.9 against a base rate of 0.771 at n = 5,000: the gap's lower bound is about
    # 0.06 > 0 (Bernstein at eta / 3 with range 2, Laplace noise of scale 4 on a sum of about
    # 5,600), so a RETRY would need the noise at hundreds of scales: probability < 1e-30.
    rng = np.random.default_rng(12)
    labels = _labels(rng, 5000)
    correct = np.where(rng.random(5000) < 0.9, 1.0, 0.0)
    baselines = baseline_losses(Metric.ACCURACY, None, labels, np.zeros(5000), (), None)
    assert baselines.shape == (5000, 2)
    result, gap = validate(Metric.ACCURACY, correct, baselines, 0.6, 1.0, 0.95, None, 0.0)
    assert result.outcome == ACCEPT and gap.outcome == ACCEPT
    assert 0.05 < gap.lower_bound < 0.9 - BASE_RATE < gap.dp_estimate + 0.05
    # The same model against a margin it does not reach: RETRY, never REJECT.
    result, gap = validate(Metric.ACCURACY, correct, baselines, 0.6, 1.0, 0.95, None, 0.2)
    assert result.outcome == RETRY and gap.outcome == RETRY


def test_a_blessed_model_is_a_baseline_and_a_reject_comes_from_the_target():
    rng = np.random.default_rng(13)
    labels = _labels(rng, 4000)
    model_outputs = np.where(rng.random(4000) < 0.85, labels, 1 - labels).astype(np.float64)
    blessed_outputs = labels.astype(np.float64)  # a perfect earlier model
    correct = (model_outputs == labels).astype(np.float64)
    baselines = baseline_losses(Metric.ACCURACY, None, labels, model_outputs, (),
                                blessed_outputs)
    assert baselines.shape == (4000, 3) and baselines[:, 2].sum() == 0
    result, gap = validate(Metric.ACCURACY, correct, baselines, 0.6, 1.0, 0.95, None, 0.0)
    assert result.outcome == RETRY and gap.lower_bound < 0  # it does not beat the blessed one
    result, _ = validate(Metric.ACCURACY, correct, baselines, 0.99, 1.0, 0.95, None, 0.0)
    assert result.outcome == REJECT


def test_bounded_losses_and_bad_parameters():
    np.testing.assert_array_equal(_bounded_losses([np.nan, -1.0, 3.0, np.inf], 2.0),
                                  [2.0, 0.0, 2.0, 2.0])
    with pytest.raises(ValueError, match="margin"):
        baseline_gap_validator([0.1], [[0.2]], 1.0, 1.0, 0.95, 1.0)
    with pytest.raises(ValueError, match="at least one baseline"):
        baseline_gap_validator([0.1], np.empty((1, 0)), 0.0, 1.0, 0.95, 1.0)


def test_the_dp_metrics_are_written_as_tfma_reads_them(tmp_path):
    import tensorflow_model_analysis as tfma
    from sage_tfx.validators.executor import write_tfma_metrics
    rng = np.random.default_rng(14)
    labels = _labels(rng, 2000)
    correct = np.where(rng.random(2000) < 0.9, 1.0, 0.0)
    baselines = baseline_losses(Metric.ACCURACY, None, labels, np.zeros(2000), (), None)
    result, gap = validate(Metric.ACCURACY, correct, baselines, 0.6, 1.0, 0.95, None, 0.0)
    write_tfma_metrics(str(tmp_path), Metric.ACCURACY, result, gap)
    [metrics] = list(tfma.load_metrics(str(tmp_path)))
    assert not metrics.slice_key.single_slice_keys  # the overall slice
    values = {entry.key.name: entry.value.double_value.value
              for entry in metrics.metric_keys_and_values}
    assert values == {"dp_accuracy": result.dp_estimate,
                      "dp_accuracy_lower_bound": result.lower_bound,
                      "dp_accuracy_upper_bound": result.upper_bound,
                      "dp_baseline_gap": gap.dp_estimate,
                      "dp_baseline_gap_lower_bound": gap.lower_bound}
