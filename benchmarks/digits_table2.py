"""Seed Table 2 (oblivious-sampling paper §5) in spirit, on scikit-learn's digits data.

    python benchmarks/digits_table2.py [--runs 3] [--epochs 60] [--json]

The same small network (64 inputs, one hidden layer of 64, softmax over 10 digits) trained with
shuffled, Poisson and SWO batches, without DP and with DP-SGD at a fixed noise multiplier; the
privacy of each scheme is then its own accountant's epsilon at delta = 1e-5 (the paper's
comparison: same noise, different amplification). Prints per scheme the mean and spread of test
accuracy over --runs runs and the epsilon.

The paper uses MNIST (n = 60,000, batch 600, sigma = 6, 100 epochs), which cannot be downloaded
here; digits has 1,797 images (1,437 train / 360 test), so the batch is 1% of the data like
the paper's and sigma is lower to keep the model learning on 1,437 records.
"""
from __future__ import annotations

import argparse
import json
import sys

import sage_tfx  # noqa: F401  (Keras 2 for tensorflow-privacy, before TensorFlow loads)
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from sage_tfx.components.dp_trainer import dp_sgd
from sage_tfx.components.oblivious_sample_gen import accounting
from sage_tfx.components.oblivious_sample_gen.sampling import (samples_poisson, samples_swo,
                                                               shuffle_and_split)

DELTA = 1e-5
CLIP = 1.0
HIDDEN = 64


def network() -> tf.keras.Model:
    return tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(HIDDEN, activation="relu"),
                                tf.keras.layers.Dense(10)])


def sample(scheme: str, n: int, batch: int, epochs: int, seed: int):
    rows = tf.range(n)
    if scheme == "poisson":
        return samples_poisson(rows, batch / n, seed=seed, epochs=epochs)
    sampler = samples_swo if scheme == "swo" else shuffle_and_split
    return sampler(rows, batch, seed=seed, epochs=epochs)


def one_run(scheme: str, private: bool, data, args, seed: int) -> tuple[float, float]:
    """(test accuracy, epsilon or inf) of one training run."""
    train_x, train_y, test_x, test_y = data
    samples = sample(scheme, len(train_y), args.batch, args.epochs, seed)
    plan = dp_sgd.StepPlan.for_layout(samples.real, samples.descriptor)
    features = tf.gather(train_x, samples.records)
    labels = tf.gather(train_y, samples.records)
    tf.keras.utils.set_random_seed(seed)
    model = network()
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if private:
        config = dp_sgd.DPSGDConfig(args.sigma, CLIP, args.learning_rate)
        dp_sgd.train(model, loss, features, labels, plan, config, seed=seed)
        epsilon = accounting.epsilon(samples.descriptor, args.sigma, DELTA)
    else:
        dp_sgd.run_steps(dp_sgd.make_nondp_step(model, loss, features, labels,
                                                args.nondp_learning_rate, plan.normaliser), plan)
        epsilon = float("inf")
    predictions = np.argmax(model(test_x).numpy(), axis=1)
    return float(np.mean(predictions == test_y.numpy().reshape(-1))), epsilon


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch", type=int, default=14, help="1%% of the training set")
    parser.add_argument("--sigma", type=float, default=1.5)
    parser.add_argument("--learning-rate", type=float, default=1.0, help="DP-SGD")
    # Unclipped, noiseless steps diverge at DP-SGD's rate on some Poisson runs.
    parser.add_argument("--nondp-learning-rate", type=float, default=0.3)
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    digits = load_digits()
    train_x, test_x, train_y, test_y = train_test_split(
        digits.data.astype(np.float32) / 16.0, digits.target.astype(np.float32), test_size=0.2,
        random_state=0, stratify=digits.target)
    data = (tf.constant(train_x), tf.constant(train_y.reshape(-1, 1)), tf.constant(test_x),
            tf.constant(test_y.reshape(-1, 1)))
    rows = []
    for scheme in ("shuffle", "poisson", "swo"):
        for private in (False, True):
            results = [one_run(scheme, private, data, args, seed) for seed in range(args.runs)]
            accuracies = [accuracy for accuracy, _ in results]
            rows.append({"scheme": scheme, "dp": private,
                         "accuracy_mean": round(float(np.mean(accuracies)), 4),
                         "accuracy_std": round(float(np.std(accuracies)), 4),
                         "epsilon": round(results[0][1], 3) if private else None})
    report = {"n_train": len(train_y), "batch": args.batch, "epochs": args.epochs,
              "sigma": args.sigma, "delta": DELTA, "runs": args.runs, "rows": rows}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"digits: n={len(train_y)}, batch {args.batch}, {args.epochs} epochs, sigma "
              f"{args.sigma}, delta {DELTA}, {args.runs} runs each")
        print(f"{'scheme':8} {'DP':3} {'accuracy':>16} {'epsilon':>9}")
        for row in rows:
            epsilon = "-" if row["epsilon"] is None else f"{row['epsilon']:.3f}"
            print(f"{row['scheme']:8} {'yes' if row['dp'] else 'no':3} "
                  f"{row['accuracy_mean']:.4f} +- {row['accuracy_std']:.4f} {epsilon:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
