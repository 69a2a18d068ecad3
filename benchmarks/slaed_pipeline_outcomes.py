"""How often test_validator_blesses_only_on_accept_and_pusher_follows would fail: its AdaSSP fit
and its two SLAed validations, run directly (no TFX) on the same ingested trips, many times.

    python benchmarks/slaed_pipeline_outcomes.py [--runs 200] [--trips-per-month 6000]
        [--shares 0.5 0.25 0.25] [--targets 4000 2] [--loss-bounds 5000 100]

The records and their train/test split are BlockExampleGen's (csv_records, then the keyed-hash
split) on the test's CSV (tests/support/ingest.py), on the two granted months. Reported: the
loose (should ACCEPT) and strict (should REJECT) outcomes, the test MSE quantiles (losses
clipped at the loose bound), and the strict floor: the smallest clipped MSE any model predicting
one value a mileage (so any linear model) can reach on the test split.
"""
from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import sys
import tempfile
from collections import Counter

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from support.ingest import MONTHS, write_csv  # noqa: E402

from sage_tfx.components.block_example_gen.executor import _split_of, csv_records  # noqa: E402
from sage_tfx.components.dp_trainer import adassp  # noqa: E402
from sage_tfx.validators.slaed import loss_validator  # noqa: E402

BUDGET, DELTA, FEATURE_BOUND, LABEL_BOUND, CONFIDENCE = 4.0, 1e-7, 5.0, 1000.0, 0.95


def granted_splits(trips_per_month: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(miles, seconds) of the train and test splits of the two most recent months."""
    directory = tempfile.mkdtemp()
    write_csv(os.path.join(directory, "data"), trips_per_month)
    first_granted = dt.datetime.fromisoformat(f"{MONTHS[-2]}-01T00:00:00+00:00").timestamp()
    rows = {"train": [], "test": []}
    for record in csv_records(os.path.join(directory, "data", "trips.csv")):
        feature = tf.train.Example.FromString(record).features.feature
        if feature["trip_start_timestamp"].int64_list.value[0] >= first_granted:
            rows[_split_of(record, 0.2)].append((feature["trip_miles"].float_list.value[0],
                                                 feature["trip_seconds"].int64_list.value[0]))
    return {split: tuple(np.array(column) for column in zip(*pairs))
            for split, pairs in rows.items()}


def one_value_a_mileage_floor(miles: np.ndarray, seconds: np.ndarray, bound: float) -> float:
    """min over predictions p(miles) of the mean of min((seconds - p)^2, bound)."""
    total = 0.0
    for value in np.unique(miles):
        labels = seconds[miles == value].astype(np.float64)
        grid = np.linspace(labels.min() - 20.0, labels.max() + 20.0, 20001)
        total += np.minimum((labels[None, :] - grid[:, None]) ** 2, bound).sum(axis=1).min()
    return total / len(miles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--trips-per-month", type=int, default=6000)
    parser.add_argument("--shares", type=float, nargs=3, default=[0.5, 0.25, 0.25],
                        metavar=("TRAINING", "LOOSE", "STRICT"))
    parser.add_argument("--targets", type=float, nargs=2, default=[4000.0, 2.0])
    parser.add_argument("--loss-bounds", type=float, nargs=2, default=[5000.0, 100.0])
    args = parser.parse_args()
    splits = granted_splits(args.trips_per_month)
    (train_x, train_y), (test_x, test_y) = splits["train"], splits["test"]
    test_x, test_y = test_x.astype(np.float32), test_y.astype(np.float32)
    # One calibration for every run (it is deterministic in epsilon and delta).
    adassp.noise_multiplier = functools.lru_cache()(adassp.noise_multiplier)
    training, loose_share, strict_share = (BUDGET * share for share in args.shares)
    outcomes = {"loose": Counter(), "strict": Counter()}
    mses = []
    for _ in range(args.runs):
        weights = adassp.adassp(train_x.reshape(-1, 1), train_y, training, DELTA, FEATURE_BOUND,
                                LABEL_BOUND).weights.astype(np.float32)  # the Keras Dense's
        losses = (test_y - (test_x * weights[0] + weights[1])) ** 2
        mses.append(float(np.minimum(losses, args.loss_bounds[0]).mean()))
        for name, target, share, bound in zip(outcomes, args.targets,
                                              (loose_share, strict_share), args.loss_bounds):
            outcomes[name][str(loss_validator(losses, target, share, CONFIDENCE,
                                              bound).outcome)] += 1
    quantiles = [0.5, 0.99, 0.999, 0.9999]
    print(json.dumps({
        "train": len(train_x), "test": len(test_x), "runs": args.runs,
        "loose": dict(outcomes["loose"]), "strict": dict(outcomes["strict"]),
        "mse_quantiles": dict(zip(map(str, quantiles), np.quantile(mses, quantiles).round(1))),
        "mse_max": round(max(mses), 1),
        "strict_floor": round(one_value_a_mileage_floor(test_x, test_y, args.loss_bounds[1]), 3),
    }, indent=1, default=float))


if __name__ == "__main__":
    main()
