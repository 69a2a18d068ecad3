"""DPTuner: the tuned model against the untuned default at the same total epsilon per block.

    python benchmarks/dp_tuning.py [--task taxi|tfx_taxi] [--epsilon E] [--epochs N]
        [--tune-epochs 1] [--tune-gamma G] [--trials-mean 3] [--tuning-share 0.25]
        [--score-fraction F] [--holdout-fraction H] [--space JSON] [--oracle]
        [--repeats 2] [--seed S] [--workdir out/bench-dp-tuning] [--reuse]

Two tasks (issue 46), each at a grant of --epsilon per block split as its pipeline splits it.
Per repeat, in alternating order so both arms see the same load:

* untuned: DP-SGD (DPTrainer's code: ObliviousSampleGen's sampling, calibrate, dp_sgd.train)
  on the whole training share with the default setting: what the user gets without tuning;
* tuned: DPTuner's search (dp_tuner.tuning.search) on --tuning-share of the training share,
  then DP-SGD on the rest with the released best setting. The total epsilon per block is the
  same; the tuning's cost is --tuning-share of the training share.

`--task taxi` (default epsilon 1, 5 epochs): the taxi DP-SGD pipeline's task (examples/taxi:
taxi_module's model and loss, SWO samples of 128; default learning rate 0.05, clip 0.5, its
dp_sgd_spec) on its first window (24 months, every other trip held out, TEST_FRACTION 0.5).
Space: the module's tuner_fn ({0.02, 0.05, 0.2, 0.5} x clip {0.5, 1.0}). Metric: the MSE
(hours^2) on the held-out trips, exact. Not the pipeline's: the DP feature hour_speed is
replaced by its public typical value (both arms alike), the SWO size is the exact count.

`--task tfx_taxi` (default epsilon 4, 4 epochs): the TFX taxi template's classifier
(examples/tfx_taxi: the template's `_build_keras_model`, its compiled binary cross-entropy;
DPTrainer replaces its compiled Adam by DP-SGD's SGD), on the records its pipeline grants and
its DPTransform transforms (the pipeline's first stages run once on a ledger for tests:
`run_prefix`), Poisson samples at gamma 0.01 (the pipeline's SAMPLING; size the exact count).
The untuned default is the pipeline's DPTrainer setting, learning rate 0.5 and clip 1.0
(pipeline.TRAINER): DPTrainer has no default of its own and does not take the template's Adam
learning rate (0.001, an Adam step size, meaningless for SGD), so this is what a user who
converts the template as docs/tfx-pipeline.md says gets. Space (TFX_SPACE, what a TFX user
writes before measuring anything): learning rate over decades {0.05, 0.5, 5} x clip
{0.1, 1, 10}; the trials score by DP accuracy (the validator's metric: the template's module
has no loss() for the loss metric). Metric: AUC (and accuracy) on the pipeline's held-out
`eval` split, read exactly for the benchmark only (a ledger for tests), as
benchmarks/tfx_taxi.py reads it.

`--oracle` also trains every candidate on the whole training share and reports its exact
held-out metric (mean of --repeats runs): the most any selection could gain over the default,
for free. That is the bound the goal needs first, before any private selection:

    gain = metric(best, (1 - f) eps) - metric(default, eps)

must exceed the metric's noise (one run's standard deviation over seeds, `*_std` below).
Private selection can only lose against the oracle: it trains the chosen setting on (1 - f)
of the share, and picks by DP scores whose noise (Laplace on a held-out share at a small
fraction of f eps, times Papernot-Steinke's ~3x overhead for E[K] = 3) must be below the gap
between the best candidate and the rest, with K random (a candidate is never tried with
probability (1 - 1/|space|)^K). So the oracle's gap over the default is an upper bound on
what tuning can show; when it is below the noise of one run, no tuning share, E[K], search
space or held-out size meets the goal on that task, and the figures say so.

Prints one JSON object: per metric each arm's values per repeat, means and standard
deviations and the difference with its standard error; the released settings and DP scores;
the privacy cost of tuning as a fraction of the training share; the search's wall seconds (an
upper bound under load); the oracle's table (--oracle); and `uptime`.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import sage_tfx  # noqa: F401  (Keras 2, before TensorFlow loads)
import numpy as np
import tensorflow as tf

from sage_tfx.components.dp_trainer import dp_sgd
from sage_tfx.components.dp_trainer.calibrate import calibrate
from sage_tfx.components.dp_tuner import tuning
from sage_tfx.components.dp_tuner.search_space import candidates_from, load_candidates
from sage_tfx.components.oblivious_sample_gen.sampling import samples_poisson, samples_swo
from sage_tfx.components.util.user_module import UserModule
from sage_tfx.examples.taxi import pipeline as taxi
from sage_tfx.examples.taxi import taxi_module
from sage_tfx.examples.taxi.stream import TaxiStream
from sage_tfx.sage_access.accounting import split_share

DEFAULT = {"learning_rate": 0.05, "l2_norm_clip": 0.5}  # examples/taxi dp_sgd_spec
SAMPLE_SIZE = 128
# The TFX template's search: what a TFX user would write, before any measurement: the learning
# rate over decades around the pipeline's 0.5, and the clip norm a decade either side of its 1.
TFX_SPACE = {"learning_rate": [0.05, 0.5, 5.0], "l2_norm_clip": [0.1, 1.0, 10.0]}
TFX_TUNE_GAMMA = 0.02
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


def train(module: UserModule, inputs, labels, setting: dict, epsilon: float, delta: float,
          epochs: int, seed, gamma: float | None = None) -> tf.keras.Model:
    """DPTrainer's DP-SGD on ObliviousSampleGen's samples of the n training records (SWO samples
    of SAMPLE_SIZE, or Poisson samples at rate `gamma`), noise calibrated to (epsilon, delta).
    `inputs`: an array, or a dict of tensors (a model's named inputs)."""
    n = int(labels.shape[0])
    samples = (samples_swo(np.arange(n), SAMPLE_SIZE, seed=seed, epochs=epochs) if gamma is None
               else samples_poisson(np.arange(n), gamma, seed=seed, epochs=epochs))
    calibration = calibrate(samples.descriptor, epsilon, delta)
    rows = tf.constant(samples.records.astype(np.int64).reshape(-1))
    if seed is not None:
        tf.keras.utils.set_random_seed(seed)  # the module's initializers
    model = module.build_model()
    dp_sgd.train(model, module.training_loss(model), dp_sgd.gather_rows(inputs, rows),
                 tf.gather(labels, rows),
                 dp_sgd.StepPlan.for_layout(samples.real, samples.descriptor),
                 dp_sgd.DPSGDConfig(calibration.noise_multiplier, setting["l2_norm_clip"],
                                    setting["learning_rate"]), seed=seed)
    return model


def mse(model: tf.keras.Model, inputs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean((model(tf.constant(inputs)).numpy() - labels) ** 2))


def tfx_taxi_data(workdir: str, reuse: bool = False):
    """The TFX taxi template's records as its pipeline (examples/tfx_taxi) grants and transforms
    them: the pipeline's first stages (BlockExampleGen, BlockLedger, DPSchemaGen, DPTransform)
    run on a ledger for tests in `workdir`, then the granted train and eval splits decoded
    through the DP transform graph as DPTrainer decodes (the model's named inputs). Returns
    (module, train inputs, labels, eval inputs, labels). The eval split is read exactly (as
    benchmarks/tfx_taxi.py reads it, for the benchmark only: a ledger for tests). `reuse`: decode
    the records of an earlier run in `workdir` instead."""
    import tensorflow_transform as tft

    from sage_tfx.components.dag_guard import PrivateExamples
    from sage_tfx.components.util.examples_io import EVAL_SPLIT, TRAIN_SPLIT, read_split
    from sage_tfx.components.util.user_module import RecordDecoder, declared_inputs
    from sage_tfx.examples.tfx_taxi import pipeline

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tfx_taxi import artifact_uri

    store = os.path.join(workdir, "metadata.sqlite")
    if not (reuse and os.path.exists(store)):
        run_prefix(workdir, store)
    examples = artifact_uri(store, PrivateExamples.TYPE_NAME, "BlockLedger")
    transform_output = tft.TFTransformOutput(artifact_uri(store, "TransformGraph", "DPTransform"))
    module = UserModule.load(pipeline.MODULE, "benchmark", model_fn=pipeline.MODEL_FN)
    decoder = RecordDecoder(module, transform_output, inputs=declared_inputs(module.build_model()))
    train_x, train_y = decoder.decode(read_split(examples, TRAIN_SPLIT).numpy().tolist())
    eval_x, eval_y = decoder.decode(read_split(examples, EVAL_SPLIT).numpy().tolist())
    return module, train_x, train_y, eval_x, eval_y.numpy().reshape(-1)


def run_prefix(workdir: str, store: str) -> None:
    """examples/tfx_taxi's pipeline up to DPTransform, on a new ledger for tests in `workdir`
    (its grant is charged in full; the later steps' shares stay unspent)."""
    from tfx.orchestration import metadata
    from tfx.orchestration import pipeline as tfx_pipeline

    from sage_tfx.examples.tfx_taxi import pipeline, template
    from sage_tfx.pipelines.local import run_local
    from sage_tfx.sage_access import BlockLedger

    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    BlockLedger.create(store, for_tests=True)
    built = pipeline.create_pipeline(
        pipeline.PIPELINE_NAME, os.path.join(workdir, "pipelines"), template.data_root(),
        pipeline.MODULE, os.path.join(workdir, "serving_model"), store, template.schema_file(),
        seed=0, metadata_connection_config=metadata.sqlite_metadata_connection_config(store))
    stages = {"BlockExampleGen", "BlockLedger", "DPSchemaGen", "DPTransform"}
    kept = [component for component in built.components if component.id in stages]
    for component in kept:  # the later stages do not run: no longer their downstream nodes
        component._downstream_nodes = {node for node in component.downstream_nodes
                                       if node.id in stages}
    run_local(tfx_pipeline.Pipeline(
        pipeline_name=built.pipeline_info.pipeline_name,
        pipeline_root=built.pipeline_info.pipeline_root, components=kept,
        metadata_connection_config=built.metadata_connection_config))


def classifier_metrics(model: tf.keras.Model, inputs, labels: np.ndarray) -> dict:
    """Held-out AUC and accuracy (threshold 0.5 on the sigmoid output, as the validator's)."""
    from sklearn.metrics import roc_auc_score

    scores = np.ravel(model.predict(inputs, batch_size=4096, verbose=0))
    return {"auc": float(roc_auc_score(labels, scores)),
            "accuracy": float(np.mean((scores >= 0.5) == (labels == 1)))}


@dataclass
class Task:
    """One benchmark task: the module, its data (decoded inputs and labels), DPTrainer's
    training of the untuned default and of a setting, and the held-out metrics."""
    name: str
    module: UserModule
    candidates: list
    default: dict
    train_x: object
    train_y: object
    eval_x: object
    eval_y: np.ndarray
    epsilon: float  # the grant's training share per block
    delta: float
    train: Callable  # (setting, epsilon, delta, seed) -> model
    metrics: Callable  # model -> {name: value}
    primary: str  # the metric --oracle reports
    search: dict  # DPTuner's parameters
    facts: dict


def tfx_taxi_task(args) -> Task:
    from sage_tfx.examples.tfx_taxi import pipeline

    module, train_x, train_y, eval_x, eval_y = tfx_taxi_data(os.path.join(args.workdir, "tfx"),
                                                             args.reuse)
    epsilon, delta = split_share(args.epsilon, pipeline.DELTA, pipeline.SPLIT, "training")
    gamma = pipeline.SAMPLING["gamma"]
    return Task("tfx_taxi", module, candidates_from(TFX_SPACE), dict(pipeline.TRAINER),
                train_x, train_y, eval_x, eval_y, epsilon, delta,
                lambda setting, eps, dlt, seed: train(module, train_x, train_y, setting, eps,
                                                      dlt, args.epochs, seed, gamma=gamma),
                lambda model: classifier_metrics(model, eval_x, eval_y), "auc",
                {"metric": "accuracy", "gamma": TFX_TUNE_GAMMA},
                {"epochs": args.epochs, "sampling_gamma": gamma})


def taxi_task(args) -> Task:
    module = UserModule.load(taxi.MODULE_FILE, "benchmark", ("build_model",))
    train_x, train_y, eval_x, eval_y = taxi_rows(args.months, np.random.default_rng(0))
    epsilon, delta = split_share(args.epsilon, taxi.BLOCK_DELTA / 10, taxi.DP_SGD_SPLIT,
                                 "training")
    return Task("taxi", module, load_candidates(taxi.MODULE_FILE, "tuner_fn"), DEFAULT,
                tf.constant(train_x), tf.constant(train_y), tf.constant(eval_x), eval_y,
                epsilon, delta,
                lambda setting, eps, dlt, seed: train(module, train_x, train_y, setting, eps,
                                                      dlt, args.epochs, seed),
                lambda model: {"mse": mse(model, eval_x, eval_y)}, "mse",
                {"metric": "loss", "loss_bound": taxi.LOSS_BOUND, "gamma": 0.02},
                {"months": args.months, "epochs": args.epochs})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("taxi", "tfx_taxi"), default="taxi")
    parser.add_argument("--epsilon", type=float, default=None,
                        help="per block (default: the task's pipeline's)")
    parser.add_argument("--months", type=int, default=taxi.MIN_WINDOW["dp_sgd"])
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--tune-epochs", type=int, default=1)
    parser.add_argument("--tune-gamma", type=float, default=None,
                        help="the trials' Poisson rate (default: taxi 0.02, tfx_taxi 0.02)")
    parser.add_argument("--trials-mean", type=float, default=3.0)
    parser.add_argument("--tuning-share", type=float, default=0.25)
    parser.add_argument("--score-fraction", type=float, default=None,
                        help="of the search's epsilon, per trial's DP score (DPTuner's default)")
    parser.add_argument("--holdout-fraction", type=float, default=None)
    parser.add_argument("--space", default=None,
                        help="JSON {name: [values]} instead of the module's tuner_fn")
    parser.add_argument("--oracle", action="store_true",
                        help="also each candidate's exact held-out metric at the whole share")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workdir", default="out/bench-dp-tuning")
    parser.add_argument("--reuse", action="store_true",
                        help="tfx_taxi: the records and transform graph of the last run")
    args = parser.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)
    tfx = args.task == "tfx_taxi"
    if args.epsilon is None:
        args.epsilon = 4.0 if tfx else 1.0  # examples/tfx_taxi's grant; the taxi figures' first
    if args.epochs is None:
        args.epochs = 4 if tfx else 5  # each pipeline's sampling epochs
    task = (tfx_taxi_task if tfx else taxi_task)(args)
    candidates = (candidates_from(json.loads(args.space)) if args.space else task.candidates)

    tune_epsilon, tune_delta = task.epsilon * args.tuning_share, task.delta * args.tuning_share
    parameters = tuning.SearchParameters.of({
        **task.search, "gamma": args.tune_gamma or task.search["gamma"],
        "epochs": args.tune_epochs, "trials_mean": args.trials_mean,
        "score_fraction": args.score_fraction, "holdout_fraction": args.holdout_fraction})
    plan = tuning.plan_search(parameters, tune_epsilon, tune_delta)
    arms = {"untuned": [], "tuned": []}
    released, search_seconds = [], []
    for repeat in range(args.repeats):
        order = ("untuned", "tuned") if repeat % 2 == 0 else ("tuned", "untuned")
        run_seed = None if args.seed is None else args.seed + repeat
        for arm in order:
            if arm == "untuned":
                model = task.train(task.default, task.epsilon, task.delta, run_seed)
            else:
                started = time.monotonic()
                best, _ = tuning.search(task.module, task.train_x, task.train_y, candidates,
                                        plan, run_seed)
                search_seconds.append(time.monotonic() - started)
                released.append({"setting": best.settings, "dp_score": round(best.score, 5)})
                model = task.train(best.settings, task.epsilon - tune_epsilon,
                                   task.delta - tune_delta, run_seed)
            arms[arm].append(task.metrics(model))
    result = {
        "task": task.name, **task.facts, "epsilon_per_block": args.epsilon,
        "training_share_epsilon": task.epsilon, "default": task.default,
        "candidates": len(candidates),
        "tuning_cost_fraction_of_training_share": args.tuning_share,
        "tuning_epsilon": tune_epsilon, "search_accounted_epsilon": plan.epsilon,
        "search_noise_multiplier": plan.noise_multiplier,
        "search": {name: getattr(parameters, name) for name in (
            "gamma", "epochs", "trials_mean", "holdout_fraction", "score_fraction", "metric")},
        "train_records": int(task.train_y.shape[0]), "eval_records": len(task.eval_y),
        "repeats": args.repeats, "released": released,
        "search_seconds": [round(s, 1) for s in search_seconds]}
    for name in arms["untuned"][0]:
        untuned = [run[name] for run in arms["untuned"]]
        tuned = [run[name] for run in arms["tuned"]]
        result[name] = {"untuned": untuned, "tuned": tuned, **summary(untuned, tuned)}
    if args.oracle:
        result["oracle"] = oracle(task, candidates, args.repeats, args.seed)
    result["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps(result, indent=1))
    return 0


def summary(untuned: list, tuned: list) -> dict:
    """Means, the per-run standard deviations (the metric's noise: one run's spread over seeds),
    and the tuned arm's mean minus the untuned's with its standard error."""
    def std(values):
        return statistics.stdev(values) if len(values) > 1 else float("nan")
    difference = statistics.fmean(tuned) - statistics.fmean(untuned)
    error = math.sqrt(std(untuned) ** 2 / len(untuned) + std(tuned) ** 2 / len(tuned))
    return {"untuned_mean": statistics.fmean(untuned), "untuned_std": std(untuned),
            "tuned_mean": statistics.fmean(tuned), "tuned_std": std(tuned),
            "tuned_minus_untuned": difference, "difference_standard_error": error}


def oracle(task: Task, candidates, repeats: int, seed) -> list:
    """Each candidate trained on the whole training share, its exact held-out metric (mean over
    `repeats` runs): what a selection that knew the held-out truth could reach. Not a release:
    the benchmark's view of the gap between the best setting and the default."""
    rows = []
    for setting in [task.default] + [c for c in candidates if c != task.default]:
        runs = [task.metrics(task.train(setting, task.epsilon, task.delta,
                                        None if seed is None else seed + 1000 + r))[task.primary]
                for r in range(repeats)]
        rows.append({"setting": setting, task.primary: round(statistics.fmean(runs), 5),
                     "runs": [round(v, 5) for v in runs]})
    return rows


if __name__ == "__main__":
    sys.exit(main())
