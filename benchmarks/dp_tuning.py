"""DPTuner on the taxi DP-SGD task: tuned against the untuned default at the same epsilon.

    python benchmarks/dp_tuning.py [--epsilon 1.0] [--months 24] [--epochs 5]
                                   [--tune-epochs 1] [--trials-mean 3] [--tuning-share 0.25]
                                   [--score-fraction F] [--repeats 2] [--seed S]

The taxi DP-SGD pipeline's task (examples/taxi: taxi_module's model and loss, the spec's SWO
samples of 128 and clip 0.5, learning rate 0.05 as its default), on its first window (24
months of the real Chicago taxi sample, every other trip held out for evaluation, as its
TEST_FRACTION 0.5), at a grant of --epsilon per block split as DP_SGD_SPLIT. Per repeat, in
alternating order so both arms see the same load:

* untuned: DP-SGD (DPTrainer's code: samples_swo, calibrate, dp_sgd.train) on the whole training
  share with the default setting;
* tuned: DPTuner's search (dp_tuner.tuning.search) on --tuning-share of the training share over
  the taxi module's tuner_fn space (learning rates {0.02, 0.05, 0.2, 0.5} x clip {0.5, 1.0}),
  then DP-SGD on the rest with the released best setting. The total epsilon per block is the
  same.

Held-out metric: the mean squared error (hours^2) on the held-out trips, exact (public data;
the pipeline's validator would release it with DP). Not the pipeline's: the DP transform's
feature hour_speed is replaced by its public typical value (both arms alike), and the SWO
sample size is the exact count (the pipeline uses a DP count). Prints one JSON object: each
arm's MSE per repeat and median, the tuned arm's released settings and DP scores, the privacy
cost of tuning as a fraction of the training share, the search's wall seconds, and `uptime`.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time

import sage_tfx  # noqa: F401  (Keras 2, before TensorFlow loads)
import numpy as np
import tensorflow as tf

from sage_tfx.components.dp_trainer import dp_sgd
from sage_tfx.components.dp_trainer.calibrate import calibrate
from sage_tfx.components.dp_tuner import tuning
from sage_tfx.components.dp_tuner.search_space import load_candidates
from sage_tfx.components.oblivious_sample_gen.sampling import samples_swo
from sage_tfx.components.util.user_module import UserModule
from sage_tfx.examples.taxi import pipeline as taxi
from sage_tfx.examples.taxi import taxi_module
from sage_tfx.examples.taxi.stream import TaxiStream
from sage_tfx.sage_access.accounting import split_share

DEFAULT = {"learning_rate": 0.05, "l2_norm_clip": 0.5}  # examples/taxi dp_sgd_spec
SAMPLE_SIZE = 128
TYPICAL_SPEED_SCALED = taxi_module.TYPICAL_SPEED_MPH / taxi_module.MAX_SPEED_MPH


def taxi_rows(months: int, rng: np.random.Generator):
    """(train inputs, labels, eval inputs, labels) of the first `months` months: inputs
    (miles scaled, typical speed), labels hours clipped to [0, 1]; every other trip held out
    at random."""
    stream = TaxiStream.load()
    trips = [trip for month in stream.months[:months] for trip in stream.trips_by_month[month]]
    miles = np.array([trip[2] for trip in trips], np.float32)
    hours = np.clip(np.array([trip[3] for trip in trips], np.float32) / 3600.0, 0.0, 1.0)
    inputs = np.stack([np.clip(miles / taxi_module.MAX_MILES, 0.0, 1.0),
                       np.full_like(miles, TYPICAL_SPEED_SCALED)], axis=1)
    held_out = rng.random(len(trips)) < taxi.TEST_FRACTION
    return (inputs[~held_out], hours[~held_out, None], inputs[held_out], hours[held_out, None])


def train(module: UserModule, inputs: np.ndarray, labels: np.ndarray, setting: dict,
          epsilon: float, delta: float, epochs: int, seed) -> tf.keras.Model:
    """DPTrainer's DP-SGD: SWO samples of SAMPLE_SIZE, noise calibrated to (epsilon, delta)."""
    samples = samples_swo(np.arange(len(inputs)), SAMPLE_SIZE, seed=seed, epochs=epochs)
    calibration = calibrate(samples.descriptor, epsilon, delta)
    rows = samples.records.astype(np.int64)
    model = module.build_model()
    dp_sgd.train(model, module.training_loss(model), tf.constant(inputs[rows]),
                 tf.constant(labels[rows]),
                 dp_sgd.StepPlan.for_layout(samples.real, samples.descriptor),
                 dp_sgd.DPSGDConfig(calibration.noise_multiplier, setting["l2_norm_clip"],
                                    setting["learning_rate"]), seed=seed)
    return model


def mse(model: tf.keras.Model, inputs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean((model(tf.constant(inputs)).numpy() - labels) ** 2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--months", type=int, default=taxi.MIN_WINDOW["dp_sgd"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--tune-epochs", type=int, default=1)
    parser.add_argument("--tune-gamma", type=float, default=0.02)
    parser.add_argument("--trials-mean", type=float, default=3.0)
    parser.add_argument("--tuning-share", type=float, default=0.25)
    parser.add_argument("--score-fraction", type=float, default=None,
                        help="of the search's epsilon, per trial's DP score (DPTuner's default)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)

    module = UserModule.load(taxi.MODULE_FILE, "benchmark", ("build_model",))
    candidates = load_candidates(taxi.MODULE_FILE, "tuner_fn")
    train_x, train_y, eval_x, eval_y = taxi_rows(args.months, np.random.default_rng(0))
    epsilon, delta = split_share(args.epsilon, taxi.BLOCK_DELTA / 10, taxi.DP_SGD_SPLIT,
                                 "training")
    tune_epsilon, tune_delta = epsilon * args.tuning_share, delta * args.tuning_share
    parameters = tuning.SearchParameters.of({
        "gamma": args.tune_gamma, "epochs": args.tune_epochs, "trials_mean": args.trials_mean,
        "metric": "loss", "loss_bound": taxi.LOSS_BOUND, "score_fraction": args.score_fraction})
    plan = tuning.plan_search(parameters, tune_epsilon, tune_delta)
    arms = {"untuned": [], "tuned": []}
    released, search_seconds = [], []
    seed = args.seed
    for repeat in range(args.repeats):
        order = ("untuned", "tuned") if repeat % 2 == 0 else ("tuned", "untuned")
        for arm in order:
            run_seed = None if seed is None else seed + repeat
            if arm == "untuned":
                model = train(module, train_x, train_y, DEFAULT, epsilon, delta, args.epochs,
                              run_seed)
            else:
                started = time.monotonic()
                best, _ = tuning.search(module, tf.constant(train_x), tf.constant(train_y),
                                        candidates, plan, run_seed)
                search_seconds.append(time.monotonic() - started)
                released.append({"setting": best.settings, "dp_score": best.score})
                model = train(module, train_x, train_y, best.settings, epsilon - tune_epsilon,
                              delta - tune_delta, args.epochs, run_seed)
            arms[arm].append(mse(model, eval_x, eval_y))
    print(json.dumps({
        "epsilon_per_block": args.epsilon, "training_share_epsilon": epsilon,
        "tuning_cost_fraction_of_training_share": args.tuning_share,
        "tuning_epsilon": tune_epsilon, "search_accounted_epsilon": plan.epsilon,
        "search_noise_multiplier": plan.noise_multiplier, "trials_mean": args.trials_mean,
        "train_records": len(train_x), "eval_records": len(eval_x),
        "untuned_mse": arms["untuned"], "tuned_mse": arms["tuned"],
        "untuned_mse_median": statistics.median(arms["untuned"]),
        "tuned_mse_median": statistics.median(arms["tuned"]),
        "released": released, "search_seconds": [round(s, 1) for s in search_seconds],
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()},
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
