"""DP-SGD epoch time against non-private SGD on the same model, data and batches.

    python benchmarks/dp_training.py --rows 100000 --repeats 5 [--json]

Three models, each trained for one epoch of SWO samples (batch 256) with DPTrainer's DP-SGD
step (one-pass per-example clipping + Gaussian noise, dp_sgd.make_dp_step) and with the
non-private reference step (dp_sgd.make_nondp_step), both compiled the same way (TensorFlow
graphs as DPTrainer runs them), in one process:

* mlp: 20 standard normal inputs, two hidden Dense layers of 64 (relu), one logit;
* embedding: one categorical feature of 10,000 ids, an Embedding of dimension 16, a hidden
  Dense layer of 64, one logit;
* conv: scikit-learn's 8x8 digits (its 1,797 images drawn with replacement up to --rows),
  two 3x3 Conv2D layers of 16 channels and a Dense softmax layer over the 10 classes.

Each model's two steps get the same warm-up (one untimed epoch each, which also compiles),
then --repeats timed epochs each, alternating which side runs first. Prints one JSON object:
per model the median, min and max epoch seconds of each side, "ratio" (median DP / median
non-DP) and the min and max of the per-repeat ratios; "max_ratio" over the models. The same
figures in CPU seconds of the process (suffix _cpu) are less sensitive to other processes on
a shared machine than wall-clock seconds.
Target (issue 35) at 100,000 rows: ratio <= 1.25 for every model.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import sage_tfx  # noqa: F401  (Keras 2, before TensorFlow loads)
import numpy as np
import tensorflow as tf

from sage_tfx.components.dp_trainer import dp_sgd
from sage_tfx.components.oblivious_sample_gen.sampling import samples_swo

BATCH = 256
FEATURES = 20
IDS, EMBEDDING_DIMENSION = 10_000, 16


def mlp_task(rows: int, rng: np.random.Generator):
    def build():
        return tf.keras.Sequential([tf.keras.Input((FEATURES,)),
                                    tf.keras.layers.Dense(64, activation="relu"),
                                    tf.keras.layers.Dense(64, activation="relu"),
                                    tf.keras.layers.Dense(1)])
    features = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    labels = rng.integers(0, 2, size=(rows, 1)).astype(np.float32)
    return build, features, labels, tf.keras.losses.BinaryCrossentropy(from_logits=True)


def embedding_task(rows: int, rng: np.random.Generator):
    def build():
        return tf.keras.Sequential([tf.keras.Input((1,), dtype="int32"),
                                    tf.keras.layers.Embedding(IDS, EMBEDDING_DIMENSION),
                                    tf.keras.layers.Flatten(),
                                    tf.keras.layers.Dense(64, activation="relu"),
                                    tf.keras.layers.Dense(1)])
    features = rng.integers(0, IDS, size=(rows, 1)).astype(np.int32)
    labels = (features % 2).astype(np.float32)  # a label the ids determine
    return build, features, labels, tf.keras.losses.BinaryCrossentropy(from_logits=True)


def conv_task(rows: int, rng: np.random.Generator):
    from sklearn.datasets import load_digits

    def build():
        return tf.keras.Sequential([tf.keras.Input((8, 8, 1)),
                                    tf.keras.layers.Conv2D(16, 3, activation="relu"),
                                    tf.keras.layers.Conv2D(16, 3, activation="relu"),
                                    tf.keras.layers.Flatten(),
                                    tf.keras.layers.Dense(10)])
    digits = load_digits()
    drawn = rng.integers(0, len(digits.target), size=rows)
    features = (digits.images[drawn] / 16.0).astype(np.float32)[..., None]
    labels = digits.target[drawn].astype(np.int32)[:, None]
    return build, features, labels, tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True)


TASKS = {"mlp": mlp_task, "embedding": embedding_task, "conv": conv_task}


def epoch_seconds(step, plan: dp_sgd.StepPlan) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds of this process's threads) of one epoch, with the
    background work its steps started: the DP step's next noise fill, drawn ahead on a worker
    thread, would otherwise be drawn during the other side's epoch and charged to it."""
    wall, cpu = time.perf_counter(), time.process_time()
    dp_sgd.run_steps(step, plan, on_epoch=lambda epoch, loss: None)  # waits for the last step
    step.settle()
    return time.perf_counter() - wall, time.process_time() - cpu


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def compare(task, rows: int, repeats: int) -> dict:
    build, features, labels, loss = task(rows, np.random.default_rng(0))
    samples = samples_swo(tf.range(rows), BATCH, seed=1)
    plan = dp_sgd.StepPlan.for_layout(samples.real, samples.descriptor)
    # Step j reads slots [j w, (j + 1) w), real or not; slot i holds row samples.records[i].
    features = tf.gather(tf.constant(features), samples.records)
    labels = tf.gather(tf.constant(labels), samples.records)
    steps = {
        "dp": dp_sgd.make_dp_step(build(), loss, features, labels,
                                  dp_sgd.DPSGDConfig(1.0, 1.0, 0.1), plan.normaliser,
                                  dp_sgd.noise_generator()),
        "nondp": dp_sgd.make_nondp_step(build(), loss, features, labels, 0.1, plan.normaliser)}
    for step in steps.values():
        epoch_seconds(step, plan)  # warm-up: traces, compiles, touches every batch once
    seconds = {(side, clock): [] for side in steps for clock in ("wall", "cpu")}
    for repeat in range(repeats):
        for side in (("dp", "nondp") if repeat % 2 == 0 else ("nondp", "dp")):
            wall, cpu = epoch_seconds(steps[side], plan)
            seconds[side, "wall"].append(wall)
            seconds[side, "cpu"].append(cpu)
    result = {}
    for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
        dp, nondp = seconds["dp", clock], seconds["nondp", clock]
        ratios = [a / b for a, b in zip(dp, nondp)]
        result.update({f"dp_epoch_s{suffix}": spread(dp), f"nondp_epoch_s{suffix}": spread(nondp),
                       f"ratio{suffix}": round(statistics.median(dp) / statistics.median(nondp), 3),
                       f"ratio_per_repeat{suffix}": {"min": round(min(ratios), 3),
                                                     "max": round(max(ratios), 3)}})
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default=",".join(TASKS),
                        help=f"comma-separated subset of {','.join(TASKS)}")
    parser.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    args = parser.parse_args(argv)
    models = {name: compare(TASKS[name], args.rows, args.repeats)
              for name in args.models.split(",")}
    print(json.dumps({"rows": args.rows, "batch": BATCH, "repeats": args.repeats,
                      "models": models,
                      "max_ratio": max(result["ratio"] for result in models.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
