"""DP analyzers on tensorflow_transform/Beam: accurate with much budget, noisy as calibrated,
and a preprocessing_fn with a non-private analyzer or too many shares refused unread."""
import math
import os
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_transform as tft
import tensorflow_transform.beam as tft_beam
from tensorflow_transform.tf_metadata import dataset_metadata

from sage_tfx.components.dp_transform import analyzers as dp
from sage_tfx.components.dp_transform.executor import audit

SPEC = {"hour": tf.io.FixedLenFeature([], tf.int64), "speed": tf.io.FixedLenFeature([], tf.float32)}


def _analyze(preprocessing_fn, rows, epsilon):
    """Run the preprocessing_fn on `rows` with TFT on Beam's DirectRunner, as DPTransform does."""
    metadata = dataset_metadata.DatasetMetadata.from_feature_spec(SPEC)
    with dp.transform_budget(epsilon) as budget, tempfile.TemporaryDirectory() as temp, \
            tft_beam.Context(temp_dir=temp, force_tf_compat_v1=True):
        (transformed, _), _ = (rows, metadata) | tft_beam.AnalyzeAndTransformDataset(
            budget.wrap(preprocessing_fn))
    return transformed


def _rows(n=4000, seed=0):
    rng = np.random.default_rng(seed)
    hours = rng.integers(0, 4, n)
    return [{"hour": int(h), "speed": float(0.2 * h + 0.1 * rng.random())} for h in hours]


def group_means(inputs):
    return {"hour_speed": dp.dp_group_by_mean(inputs["hour"], inputs["speed"], num_keys=4,
                                              value_range=(0.0, 1.0), budget_share=1.0)}


def test_group_by_mean_is_close_with_a_large_budget():
    rows = _rows()
    transformed = _analyze(group_means, rows, epsilon=1000.0)
    for row, out in zip(rows, transformed):
        true = 0.2 * row["hour"] + 0.05
        assert out["hour_speed"] == pytest.approx(true, abs=0.01)


def _dp_analyzers(preprocessing_fn, spec, epsilon):
    """The DP analyzer PTransforms a traced preprocessing_fn will run, as DPTransform traces it."""
    from tensorflow_transform import impl_helper
    from sage_tfx.components.dp_transform.executor import _analyzer_defs
    with dp.transform_budget(epsilon) as budget:
        graph, _, _ = impl_helper.trace_preprocessing_function(
            budget.wrap(preprocessing_fn), spec, use_tf_compat_v1=True)
    return [op.ptransform for op in _analyzer_defs(graph) if dp.is_dp_analyzer(op)]


def test_analyzers_spend_exactly_their_budget_share():
    # Oracle: share * epsilon, written here; the epsilon is dp_accounting's (PLD) for the event
    # OpenDP reports for the noise that ran. An analyzer spending 2x its share fails.
    def stats(inputs):
        return {"count": tf.fill(tf.shape(inputs["hour"]), dp.dp_count(inputs["hour"], 0.2)),
                "mean": tf.fill(tf.shape(inputs["hour"]),
                                dp.dp_mean(inputs["speed"], (0.0, 1.0), 0.3)),
                "group": group_means_at(0.5)(inputs)["hour_speed"]}
    analyzers = _dp_analyzers(stats, SPEC, epsilon=2.0)
    spent = {}
    for analyzer in analyzers:
        release = analyzer.release(np.array([[50.0] * analyzer.num_keys] * 2))
        spent[(analyzer.count_only, analyzer.num_keys)] = release.epsilon(1e-12)
    assert spent == pytest.approx({(True, 1): 0.4, (False, 1): 0.6, (False, 4): 1.0}, rel=1e-3)


def group_means_at(share):
    def fn(inputs):
        return {"hour_speed": dp.dp_group_by_mean(inputs["hour"], inputs["speed"], num_keys=4,
                                                  value_range=(0.0, 1.0), budget_share=share)}
    return fn


def test_group_by_mean_noise_matches_its_calibration_with_a_negative_lower_bound():
    # Range [-10, 1]: a record's clamped value centred on -4.5 lies in [-5.5, 5.5], so the sum's
    # sensitivity is 5.5 (not the upper bound 1) and its noise Lap(2 * 5.5 / eps) = Lap(22) at
    # eps 0.5. 20,000 keys of 1,000 records summing to 0 give 20,000 independent releases; the
    # released mean minus the midpoint is dp_sum / dp_count ~ Lap(22) / 1000 (count noise Lap(4)
    # moves the ratio by < 1%). Variance 2 * 22^2 / 1000^2; the sample variance of 20,000
    # Laplace draws has relative sd sqrt(5 / 20000) = 1.6%, so +-12% is > 7 sd: false-failure
    # rate < 1e-9. A sensitivity of 1 (the upper bound) gives 1/30 of the variance: caught.
    analyzer = dp._NoisyGroupSums(20_000, -10.0, 1.0, epsilon=0.5)
    sums = np.stack([np.full(20_000, 1000.0), np.zeros(20_000)])
    centred = analyzer.release(sums).value.astype(np.float64) + 4.5
    assert np.var(centred) == pytest.approx(2 * 22.0 ** 2 / 1000.0 ** 2, rel=0.12)


def test_dp_count_noise_has_its_discrete_laplace_scale():
    # dp_count at eps 0.5: count + discrete Laplace with P(z) ~ exp(-0.5 |z|), whose variance is
    # 2 e^-a / (1 - e^-a)^2 = 7.83 (a = 0.5). 3,000 draws: the sample variance has relative sd
    # ~ sqrt(5 / 3000) = 4%, so +-25% is > 6 sd (false-failure rate < 1e-8). 10x noise: caught.
    analyzer = dp._NoisyGroupSums(1, 0.0, 1.0, epsilon=0.5, count_only=True)
    draws = np.array([analyzer.release(np.array([[123.0], [0.0]])).value for _ in range(3000)])
    a = 0.5
    assert np.all(draws == np.round(draws))
    assert np.var(draws - 123) == pytest.approx(2 * math.exp(-a) / (1 - math.exp(-a)) ** 2,
                                                rel=0.25)
    assert abs(np.mean(draws) - 123) < 6 * math.sqrt(7.83 / 3000)


def test_non_finite_values_map_to_the_midpoint_before_clamping():
    analyzer = dp._NoisyGroupSums(2, -1.0, 3.0, epsilon=1.0)
    batch = (np.array([0, 0, 1, 1, 1]), np.array([np.nan, np.inf, -np.inf, 2.0, 9.0]))
    counts, centred_sums = analyzer._batch_sums(batch)
    # NaN and +-inf count as the midpoint 1 (centred 0); 2 -> 1, 9 clamps to 3 -> 2.
    assert counts.tolist() == [2, 3] and centred_sums.tolist() == [0.0, 3.0]
    assert np.all(np.isfinite(analyzer.release(np.stack([counts, centred_sums])).value))


def test_vector_inputs_are_refused_at_trace_time():
    spec = dict(SPEC, speeds=tf.io.FixedLenFeature([10], tf.float32))
    with pytest.raises(dp.DPTransformError, match=r"dp_mean: value must hold one value per "):
        audit(lambda inputs: {"m": dp.dp_mean(inputs["speeds"], (0.0, 1.0), 0.5)}, spec, 1.0)
    with pytest.raises(dp.DPTransformError, match=r"dp_group_by_mean: value .*\(None, 10\)"):
        audit(lambda inputs: {"m": dp.dp_group_by_mean(inputs["hour"], inputs["speeds"], 4,
                                                       (0.0, 1.0), 0.5)}, spec, 1.0)


def test_count_and_mean_share_the_budget():
    rows = _rows(2000)

    def stats(inputs):
        return {"count": tf.fill(tf.shape(inputs["hour"]), dp.dp_count(inputs["hour"], 0.5)),
                "mean": tf.fill(tf.shape(inputs["hour"]),
                                dp.dp_mean(inputs["speed"], (0.0, 1.0), 0.5))}
    out = _analyze(stats, rows, epsilon=500.0)[0]
    assert out["count"] == pytest.approx(2000, abs=5)
    assert out["mean"] == pytest.approx(np.mean([r["speed"] for r in rows]), abs=0.01)


def test_non_private_analyzers_and_overspending_are_refused_before_reading():
    def uses_tft_mean(inputs):
        return {"centred": inputs["speed"] - tft.mean(inputs["speed"])}

    def overspends(inputs):
        return {"a": dp.dp_mean(inputs["speed"], (0.0, 1.0), 0.7),
                "b": dp.dp_mean(inputs["speed"], (0.0, 1.0), 0.7)}

    with pytest.raises(dp.DPTransformError, match="non-private analyzers"):
        audit(uses_tft_mean, SPEC, epsilon=1.0)
    with pytest.raises(dp.DPTransformError, match="at most 1"):
        audit(overspends, SPEC, epsilon=1.0)
    assert audit(group_means, SPEC, epsilon=1.0) == [("dp_group_by_mean", 1.0)]
    with pytest.raises(dp.DPTransformError, match="only inside DPTransform"):
        dp.dp_mean(tf.constant([1.0]), (0.0, 1.0), 0.5)
    with pytest.raises(dp.DPTransformError, match="value_range"):
        audit(lambda inputs: {"m": dp.dp_mean(inputs["speed"], (1.0, 0.0), 0.5)}, SPEC, 1.0)


# Each of these mixes the records of a Beam batch outside the DP analyzers.
MIXING = {
    "centring": lambda i: {"x": i["speed"] - tf.reduce_mean(i["speed"])},
    "max over the batch": lambda i: {"x": i["speed"] / tf.reduce_max(i["speed"], axis=0)},
    "sum along axis -1 of a vector": lambda i: {"x": tf.reduce_sum(i["speed"], axis=-1)
                                                 + 0 * i["speed"]},
    "batch size in arithmetic": lambda i: {"x": i["speed"] / tf.cast(tf.shape(i["speed"])[0],
                                                                      tf.float32)},
    "cumulative sum": lambda i: {"x": tf.cumsum(i["speed"])},
    "sort": lambda i: {"x": tf.sort(i["speed"])},
    "top k": lambda i: {"x": i["speed"] * 0 + tf.reduce_sum(tf.math.top_k(i["speed"], 1)[0])},
    "outer broadcast": lambda i: {"x": i["speed"] + tf.reshape(i["speed"], [-1, 1])},
    "row zero": lambda i: {"x": i["speed"] - i["speed"][0]},
    "shift by one row": lambda i: {"x": tf.concat([i["speed"][1:], i["speed"][:1]], axis=0)},
    "position in batch": lambda i: {"x": tf.cast(tf.range(tf.shape(i["speed"])[0]),
                                                  tf.float32)},
    "matmul across rows": lambda i: {"x": tf.linalg.matmul(
        tf.reshape(i["speed"], [1, -1]), tf.reshape(i["speed"], [-1, 1]))[0]},
    "state written from a batch": lambda i: _accumulates(i["speed"]),
    "mixed input of a DP analyzer": lambda i: {"m": tf.fill(tf.shape(i["speed"]), dp.dp_mean(
        i["speed"] - tf.reduce_mean(i["speed"]), (0.0, 1.0), 0.5))},
}


def _accumulates(speed):
    """Adds each batch's records to a variable and reads it back: mixing through state."""
    total = tf.compat.v1.get_variable("total", [], tf.float32, tf.zeros_initializer(),
                                      use_resource=True)
    with tf.control_dependencies([total.assign_add(tf.reduce_sum(speed * 0 + 1))]):
        return {"x": speed * 0 + total.read_value()}


@pytest.mark.parametrize("name", sorted(MIXING))
def test_ops_that_mix_the_records_of_a_batch_are_refused_at_trace_time(name):
    with pytest.raises(dp.DPTransformError, match="mixes the records of a batch"):
        audit(MIXING[name], SPEC, epsilon=1.0)


def test_per_row_preprocessing_with_dp_releases_passes_the_audit():
    def per_row(inputs):
        speed = dp.scale_with_bounds(inputs["speed"], 0.0, 1.0)
        two = tf.stack([speed, tf.square(speed)], axis=1)               # [B, 2]
        hour_speed = dp.dp_group_by_mean(inputs["hour"], speed, num_keys=4,
                                         value_range=(0.0, 1.0), budget_share=0.5)
        count = dp.dp_count(inputs["hour"], budget_share=0.5)
        return {"row_sum": tf.reduce_sum(two, axis=1),                   # within a row
                "first": two[:, 0], "last": two[..., -1],
                "flat": tf.reshape(tf.expand_dims(speed, 1), [-1]),
                "hour_speed": hour_speed - speed,
                "share": tf.fill(tf.shape(speed), count) * speed,        # DP count per row
                "projected": tf.matmul(two, tf.constant([[1.0], [2.0]]))[:, 0],
                "onehot_hour": tf.one_hot(inputs["hour"], 4),
                "bucket": tf.where(speed > 0.5, 1, 0)}

    assert audit(per_row, SPEC, epsilon=1.0) == [("dp_group_by_mean", 0.5), ("dp_count", 0.5)]
    assert audit(group_means, SPEC, epsilon=1.0) == [("dp_group_by_mean", 1.0)]


def test_scale_with_bounds_is_the_affine_map_of_the_clipped_value():
    # (clip(v, lo, hi) - lo) / (hi - lo) with a negative lower bound, written out by hand.
    scaled = dp.scale_with_bounds(tf.constant([-9.0, -2.0, 0.0, 3.0, 6.0, 50.0]), -2.0, 6.0)
    np.testing.assert_allclose(scaled.numpy(), [0.0, 0.0, 0.25, 0.625, 1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize("shares", [(-0.5, 1.4), (0.0, 1.0), (1.5,)])
def test_a_share_outside_zero_one_is_refused_before_reading(shares):
    # A negative share would let another analyzer spend more than the whole budget while the
    # sum still looks <= 1 (-0.5 + 1.4 = 0.9).
    def spends(inputs):
        return {f"m{i}": dp.dp_mean(inputs["speed"], (0.0, 1.0), share)
                for i, share in enumerate(shares)}
    with pytest.raises(dp.DPTransformError, match=r"budget_share must be in \(0, 1\]"):
        audit(spends, SPEC, epsilon=1.0)
