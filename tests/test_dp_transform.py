"""DP analyzers on tensorflow_transform/Beam: accurate with much budget, noisy as calibrated,
and a preprocessing_fn with a non-private analyzer or too many shares refused unread."""
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


def _analyze(preprocessing_fn, rows, epsilon, seed):
    """Run the preprocessing_fn on `rows` with TFT on Beam's DirectRunner, as DPTransform does."""
    metadata = dataset_metadata.DatasetMetadata.from_feature_spec(SPEC)
    with dp.transform_budget(epsilon, seed) as budget, tempfile.TemporaryDirectory() as temp, \
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
    transformed = _analyze(group_means, rows, epsilon=1000.0, seed=1)
    for row, out in zip(rows, transformed):
        true = 0.2 * row["hour"] + 0.05
        assert out["hour_speed"] == pytest.approx(true, abs=0.01)


def test_group_by_mean_noise_matches_its_calibration():
    # One key holding 200 records of value 1 in range [-1, 1], released at eps 0.2: the DP count
    # gets Laplace(2/eps) = Laplace(10) and the sum Laplace(2·max(|lo|,|hi|)/eps) = Laplace(10).
    # Replaying the generator with the same seed reproduces the release exactly only if the
    # code draws those two scales, in that order.
    release = dp._NoisyGroupSums(1, -1.0, 1.0, epsilon=0.2, seed=None)
    sums = np.array([[200.0], [200.0]])
    count_noise, sum_noise = [], []
    for seed in range(200):
        release.seed = seed
        rng = np.random.Generator(np.random.PCG64DXSM(seed))
        count_noise.append(rng.laplace(0.0, 10.0))
        sum_noise.append(rng.laplace(0.0, 10.0))
        mean = release._release(sums)[0]
        # The released mean is the noisy sum over the noisy count, clipped to the range.
        assert mean == pytest.approx(np.clip((200 + sum_noise[-1]) / (200 + count_noise[-1]),
                                             -1, 1), rel=1e-5)


def test_count_and_mean_share_the_budget():
    rows = _rows(2000)

    def stats(inputs):
        return {"count": tf.fill(tf.shape(inputs["hour"]), dp.dp_count(inputs["hour"], 0.5)),
                "mean": tf.fill(tf.shape(inputs["hour"]),
                                dp.dp_mean(inputs["speed"], (0.0, 1.0), 0.5))}
    out = _analyze(stats, rows, epsilon=500.0, seed=2)[0]
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
