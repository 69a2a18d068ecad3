"""The taxi pipelines: what each iteration runs, and the stream that feeds the database.

Two pipelines predict trip duration (taxi_module.py): an AdaSSP linear regression and a DP-SGD
neural network. Their MSE target (on durations in hours, each example's squared error clipped
to LOSS_BOUND) lies between the best model this data allows and the naive one that predicts
the mean. Measured on the whole sample without privacy: least squares 0.0167, the mean 0.0272.
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional

from tfx.orchestration import metadata, pipeline

from sage_tfx.components.block_example_gen import BlockExampleGen, month_schedule
from sage_tfx.components.dp_trainer import TrainerMode
from sage_tfx.components.oblivious_sample_gen.descriptor import Scheme
from sage_tfx.examples.taxi.stream import COLUMNS, TaxiStream
from sage_tfx.pipelines.adaptive import IterationSpec, build_iteration
from sage_tfx.pipelines.local import run_local
from sage_tfx.sage_access.store import KUBEFLOW_LEDGER_STORE
from sage_tfx.validators.slaed import Metric

MODULE_FILE = os.path.join(os.path.dirname(__file__), "taxi_module.py")
# Every monthly block's ceiling. The sample has about 400 trips a month (Sage's taxi stream had
# 16,000 an hour), so a month needs more budget than Sage's epsilon 1 to validate a model.
BLOCK_EPSILON, BLOCK_DELTA = 2.0, 1e-6
LOSS_BOUND = 0.25                          # squared error clipped at 30 minutes
MSE_TARGET = 0.026
TEST_FRACTION = 0.5                        # DP validation needs many test points (Sage §5.2)
# How each pipeline's grant is split among its DP steps. DP-SGD's "sampling_count" pays
# ObliviousSampleGen's DP count of the training records, which sizes the samples (no exact count
# is used; oblivious_sample_gen/accounting.py). AdaSSP runs no sampler.
ADASSP_SPLIT = {"transform": 0.1, "training": 0.5, "validation": 0.4}
DP_SGD_SPLIT = {"transform": 0.1, "sampling_count": 0.05, "training": 0.45,
                "validation": 0.4}
# Each pipeline's first iteration: its window (months) and epsilon. A REJECT stops the pipeline,
# and DP-SGD's noisy model was sometimes confidently worse than the naive one (REJECT): on 12
# months at epsilon 0.25-0.5 (4 of 12 runs), on 24 months at 0.25 (1 run in about 12). On 24
# months at 0.5 its lower bound stayed at most 0.0164 in 16 runs, far below the target; it
# ACCEPTed in 12 and RETRYed in 4 (then ACCEPT at 1).
# AdaSSP starts on 24 months at epsilon 1. Under the run-level SLA no model can be accepted on
# 12 months: least squares without privacy has test loss 0.0208 on 2013 (the naive model
# 0.0259), and Bernstein's term alone lifts its upper bound to 0.0282 at iteration 1 (confidence
# 0.9696), above 0.026 before any DP correction. The old start, 12 months at 0.25, spent 1.75
# of every 2013 block on three such iterations, then had one chance, 24 months (2014-15) at 1 as
# iteration 4 (confidence 0.9981); a RETRY there (DP loss 0.02006 in a measured run) ended in
# TIMEOUT: no 48 blocks could pay 1. Starting on 24 months at 1 keeps a second chance, 48
# months at 1, which the first 24 can still pay (doubling 0.5 -> 1 on them would leave 0.5).
# Simulated (the trainer and validator functions on the demo's blocks and splits under the
# driver's rules, unseeded), 300 runs each: the new start ACCEPTed in 300 (228 at iteration 1,
# 72 at iteration 2); the old one in 162 (all at iteration 4), with 136 TIMEOUTs and 2 REJECTs
# (12 months at 0.25). With the real driver, 12 runs: ACCEPT in 12, 9 at iteration 1 and 3 at
# iteration 2 (docs/pipelines.md).
MIN_WINDOW = {TrainerMode.ADASSP: 24, TrainerMode.DP_SGD: 24}
INITIAL_EPSILON = {TrainerMode.ADASSP: 1.0, TrainerMode.DP_SGD: 0.5}


def adassp_spec(seed: Optional[int] = None) -> IterationSpec:
    return IterationSpec(
        module_file=MODULE_FILE, split=ADASSP_SPLIT, seed=seed,
        # Rows are (scaled miles in [0, 1], hour speed, 1). The hour speed is the hour's mean
        # trip speed over 60 mph; a public guess puts it at most 30 mph (Chicago's speed limit;
        # trips stop at lights), 0.5, so the row norm is <= sqrt(1 + 0.25 + 1) = 1.5. AdaSSP's
        # Gram noise grows as the bound squared (2.25, not 3 for sqrt(3), the bound of features
        # in [0, 1]); a row above it is scaled down (trainer's clip_rows), which costs accuracy,
        # never privacy. Durations are clipped to [0, 1] hour; the fit is on duration - 0.2 h, a
        # public guess (12 minutes) at a typical trip, so the ridge shrinks toward it and
        # |duration - 0.2| <= 0.8.
        trainer={"mode": TrainerMode.ADASSP, "feature_bound": 1.5, "label_bound": 0.8,
                 "label_offset": 0.2},
        validation={"metric": Metric.LOSS, "target": MSE_TARGET, "loss_bound": LOSS_BOUND,
                    "confidence": 0.95})


def dp_sgd_spec(seed: Optional[int] = None) -> IterationSpec:
    return IterationSpec(
        module_file=MODULE_FILE, split=DP_SGD_SPLIT, seed=seed,
        sampling={"scheme": Scheme.SWO, "sample_size": 128, "epochs": 5},
        trainer={"mode": TrainerMode.DP_SGD, "l2_norm_clip": 0.5, "learning_rate": 0.05},
        validation={"metric": Metric.LOSS, "target": MSE_TARGET, "loss_bound": LOSS_BOUND,
                    "confidence": 0.95})


SPECS = {TrainerMode.ADASSP: adassp_spec, TrainerMode.DP_SGD: dp_sgd_spec}  # by trainer mode
# DPTuner's parameters for the DP-SGD iteration (IterationSpec.tuning): one epoch of Poisson
# samples at rate 0.02, scored by the validator's metric (the clipped loss). The search's fixed
# RDP overhead makes its trials noisy on a small share: noise multiplier 33 on the demo's
# epsilon 0.5 with tuning_share 0.25 (epsilon 0.056 for the search), 7.9 on epsilon 0.2, 3.7
# on 0.45 (tuning_share 0.5 at epsilon 2), at the spec's delta times the share.
DP_SGD_TUNING = {"gamma": 0.02, "epochs": 1, "metric": Metric.LOSS, "loss_bound": LOSS_BOUND}


class TaxiSource:
    """The driver's BlockSource: each `wait()` replays the next months of the taxi sample through
    BlockExampleGen (a one-component TFX run in the ledger's store), one block per month."""

    def __init__(self, ledger_store: str, workdir: str, months_per_wait: int = 1,
                 stream: Optional[TaxiStream] = None):
        self.ledger_store, self.workdir = ledger_store, workdir
        self.months_per_wait = months_per_wait
        self.stream = stream or TaxiStream.load()

    def blocks_left(self) -> int:
        return self.stream.remaining()

    def ingest(self, months: int) -> list[str]:
        directory = tempfile.mkdtemp(prefix="months-", dir=self.workdir)
        os.rmdir(directory)
        names = self.stream.release(months, directory)
        # The stream's public schedule: these calendar months are blocks, records or not.
        start, end = month_schedule(names[0], names[-1])
        gen = BlockExampleGen(input_base=directory, block_key="trip_start_timestamp",
                              block_by="month", schedule_start=start, schedule_end=end,
                              ledger_store=self.ledger_store,
                              block_epsilon=BLOCK_EPSILON, block_delta=BLOCK_DELTA,
                              test_fraction=TEST_FRACTION, columns=COLUMNS)
        run_local(pipeline.Pipeline(
            pipeline_name="taxi-ingest", pipeline_root=os.path.join(self.workdir, "ingest"),
            components=[gen],
            metadata_connection_config=metadata.sqlite_metadata_connection_config(
                self.ledger_store)))
        return names

    def wait(self) -> list[str]:
        months = min(self.months_per_wait, self.blocks_left())
        return self.ingest(months) if months else []


def kubeflow_pipeline(spec: IterationSpec, pipeline_root: str, data_root: str, window: int,
                      epsilon: float, ledger_store: str = KUBEFLOW_LEDGER_STORE,
                      name: str = "sage-taxi",
                      months: tuple[str, str] = ("2013-01", "2016-12"),
                      tuning_share: float = 0.0) -> pipeline.Pipeline:
    """One taxi iteration with ingestion first, for a cluster (`sage-tfx compile`'s example):
    BlockExampleGen -> BlockLedger -> DPTransform -> [ObliviousSampleGen] -> [DPTuner ->]
    DPTrainer -> SLAedValidator -> Pusher. `months` is the stream's public schedule; with
    `tuning_share` > 0 (a spec with `tuning`), DPTuner spends that share of the training share
    and DPTrainer trains with its best_hyperparameters (build_iteration)."""
    start, end = month_schedule(*months)
    ingest = BlockExampleGen(input_base=data_root, block_key="trip_start_timestamp",
                             block_by="month", schedule_start=start, schedule_end=end,
                             ledger_store=ledger_store,
                             block_epsilon=BLOCK_EPSILON, block_delta=BLOCK_DELTA,
                             test_fraction=TEST_FRACTION, columns=COLUMNS)
    return build_iteration(spec, name, pipeline_root, ledger_store, window, epsilon,
                           ingest=ingest, push_to=os.path.join(pipeline_root, "serving"),
                           tuning_share=tuning_share)
