"""DP-SGD epoch time against non-private SGD on the same model, data and batches.

    python benchmarks/dp_training.py --rows 100000 [--json]

Trains a Keras MLP (20 inputs, two hidden layers of 64, batch 256) for one epoch of SWO samples
with DPTrainer's DP-SGD step (tensorflow-privacy fast clipping + Gaussian noise) and with the
non-private reference step, in one process, and prints
{"rows", "dp_epoch_s", "nondp_epoch_s", "ratio"}. Each step function is traced once before the
clock starts; the epoch time is the best of --repeats epochs. Target at 100,000 rows: ratio <= 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import sage_tfx  # noqa: F401  (Keras 2 for tensorflow-privacy, before TensorFlow loads)
import numpy as np
import tensorflow as tf

from sage_tfx.components.dp_trainer import dp_sgd
from sage_tfx.components.oblivious_sample_gen.sampling import samples_swo

BATCH = 256
FEATURES = 20


def mlp() -> tf.keras.Model:
    return tf.keras.Sequential([tf.keras.Input((FEATURES,)),
                                tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(1)])


def epoch_seconds(step, plan: dp_sgd.StepPlan, repeats: int) -> float:
    step(tf.constant(plan.rows[0]), tf.constant(plan.weights[0]))  # trace
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dp_sgd.run_steps(step, plan, on_epoch=lambda epoch, loss: None)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    features = tf.constant(rng.normal(size=(args.rows, FEATURES)).astype(np.float32))
    labels = tf.constant(rng.integers(0, 2, size=(args.rows, 1)).astype(np.float32))
    samples = samples_swo(tf.range(args.rows), BATCH, seed=1)
    plan = dp_sgd.StepPlan.for_layout(samples.real, samples.descriptor)
    # Step j reads slots [j w, (j + 1) w), real or not; slot i holds row samples.records[i].
    features, labels = tf.gather(features, samples.records), tf.gather(labels, samples.records)
    loss = tf.keras.losses.BinaryCrossentropy(from_logits=True)
    dp_step = dp_sgd.make_dp_step(mlp(), loss, features, labels,
                                  dp_sgd.DPSGDConfig(1.0, 1.0, 0.1), plan.normaliser,
                                  dp_sgd.noise_generator())
    nondp_step = dp_sgd.make_nondp_step(mlp(), loss, features, labels, 0.1, plan.normaliser)
    dp_s = epoch_seconds(dp_step, plan, args.repeats)
    nondp_s = epoch_seconds(nondp_step, plan, args.repeats)
    print(json.dumps({"rows": args.rows, "dp_epoch_s": round(dp_s, 4),
                      "nondp_epoch_s": round(nondp_s, 4), "ratio": round(dp_s / nondp_s, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
