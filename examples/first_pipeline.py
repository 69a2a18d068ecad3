"""A sage-tfx pipeline as a plain `tfx.orchestration.pipeline.Pipeline`, every channel named.

    BlockExampleGen -> BlockLedger -> ObliviousSampleGen -> DPTrainer -> SLAedValidator -> Pusher

Before the first run, create the ledger in the store the pipeline names (once):

    sage-tfx ledger --store out/first/metadata.sqlite init

Run it locally (LocalDagRunner behind the DAG guard, the ledger in the pipeline's own ML
Metadata store):

    python -m sage_tfx.examples.first_pipeline --data-root DIR_OF_CSV --workdir out/first \
        --first-month 2024-01 --last-month 2024-03

or compile it for Kubeflow (the ledger then lives in Kubeflow's ML Metadata over gRPC):

    sage-tfx compile --kubeflow --out first.json --image IMAGE --pipeline-root gs://BUCKET/first \
        --pipeline-module examples/first_pipeline.py:training_pipeline

(`training_pipeline` trains on blocks already registered; an ingesting run needs the months it
ingests, so compile your own function that passes them to `create_pipeline`.)

Ingestion and training are separate runs of different data. BlockExampleGen registers each block
(one month) in the ledger once: a block's budget may already be spent, so its data is immutable.
Running the same DAG again on the same files fails with "blocks are immutable"; give each run
only the files that arrived since (a new `data_root`), or pass `ingest=False` to train on the
blocks already registered.

The CSV columns are trip_start_timestamp (Unix seconds or an ISO date), trip_miles and
trip_seconds. The stream's schedule (--first-month..--last-month) is public: every month in it
becomes a block, records or not, and records outside it are dropped.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

# First, before TFX: importing TFX's Pusher makes TensorFlow pick its Keras, and DPTrainer needs
# Keras 2 (sage_tfx sets TF_USE_LEGACY_KERAS=1). Imported after, the grant's preflight refuses
# the run with nothing charged and says how to fix it.
import sage_tfx  # noqa: F401,I001
from tfx.components.pusher.component import Pusher
from tfx.orchestration import metadata, pipeline
from tfx.proto import pusher_pb2

from sage_tfx.components import (BlockExampleGen, BlockLedger, DPTrainer, ObliviousSampleGen,
                                  SLAedValidator)
from sage_tfx.components.block_example_gen import month_schedule
from sage_tfx.components.dp_trainer import TrainerMode
from sage_tfx.components.oblivious_sample_gen.descriptor import Scheme
from sage_tfx.sage_access.errors import LedgerError
from sage_tfx.sage_access.store import KUBEFLOW_LEDGER_STORE
from sage_tfx.validators.slaed import Metric

MODEL_MODULE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trip_model.py")
# The same module named by its module path: what a compiled job names, since the cluster's
# containers have the installed package, not this machine's files.
MODEL_MODULE_PATH = "sage_tfx.examples.trip_model"


def create_pipeline(pipeline_root: str, data_root: Optional[str] = None,
                    ledger_store: str = KUBEFLOW_LEDGER_STORE, metadata_path: Optional[str] = None,
                    ingest: bool = True, months: Optional[tuple[str, str]] = None,
                    window: int = 2, epsilon: float = 1.0,
                    delta: float = 1e-7, target_loss: float = 20000.0, epochs: int = 2,
                    sample_size: int = 16, module_file: str = MODEL_MODULE,
                    seed: Optional[int] = None) -> pipeline.Pipeline:
    """One training iteration; `months` = (first, last) "YYYY-MM" is the stream's public
    schedule (needed to ingest); `seed` fixes sampling and noise and is for tests only."""
    data_root = data_root or os.path.join(pipeline_root, "new-data")
    components = []
    new_blocks = None
    if ingest:
        if months is None:
            raise ValueError("ingesting needs the stream's public schedule: months=(first, last)")
        start, end = month_schedule(*months)
        # One block per calendar month of trip_start_timestamp, each with budget (2, 1e-6).
        block_gen = BlockExampleGen(input_base=data_root, block_key="trip_start_timestamp",
                                    block_by="month", ledger_store=ledger_store,
                                    schedule_start=start, schedule_end=end,
                                    block_epsilon=2.0, block_delta=1e-6, test_fraction=0.2)
        components.append(block_gen)
        new_blocks = block_gen.outputs["examples"]
    # The grant: (epsilon, delta) on the `window` most recent blocks, split between the DP steps.
    # Each share is consumed once; "sampling_count" pays the sampler's DP count of the records.
    grant = BlockLedger(ledger_store=ledger_store, epsilon=epsilon, delta=delta, window=window,
                        split={"sampling_count": 0.05, "training": 0.8, "validation": 0.15},
                        pipeline_name="first",
                        new_blocks=new_blocks)
    sampler = ObliviousSampleGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                                 scheme=Scheme.SWO, sample_size=sample_size, epochs=epochs,
                                 seed=seed)
    trainer = DPTrainer(examples=sampler.outputs["samples"], grant=grant.outputs["grant"],
                        module_file=module_file, mode=TrainerMode.DP_SGD, grant_step="training",
                        l2_norm_clip=1.0, learning_rate=0.05, seed=seed)
    # Durations are in seconds: the target is an MSE of 20,000 s^2 (an error of about 140 s);
    # the validator clips each squared error at loss_bound.
    validator = SLAedValidator(model=trainer.outputs["model"], examples=grant.outputs["examples"],
                               grant=grant.outputs["grant"], module_file=module_file,
                               metric=Metric.LOSS, target=target_loss, loss_bound=1e6,
                               confidence=0.95, grant_step="validation")
    pusher = Pusher(model=trainer.outputs["model"], model_blessing=validator.outputs["blessing"],
                    push_destination=pusher_pb2.PushDestination(
                        filesystem=pusher_pb2.PushDestination.Filesystem(
                            base_directory=os.path.join(pipeline_root, "serving"))))
    components += [grant, sampler, trainer, validator, pusher]
    return pipeline.Pipeline(
        pipeline_name="first", pipeline_root=pipeline_root, components=components,
        metadata_connection_config=metadata.sqlite_metadata_connection_config(metadata_path)
        if metadata_path else None)


def training_pipeline(pipeline_root: str) -> pipeline.Pipeline:
    """The iteration without ingestion, on the blocks already registered: what `sage-tfx compile
    --pipeline-module examples/first_pipeline.py:training_pipeline` compiles."""
    return create_pipeline(pipeline_root, ingest=False, module_file=MODEL_MODULE_PATH)


def main() -> None:
    from sage_tfx.pipelines.local import run_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True, help="directory of the new CSV files")
    parser.add_argument("--workdir", required=True, help="pipeline root; holds metadata.sqlite")
    parser.add_argument("--no-ingest", action="store_true",
                        help="train on blocks already registered (no BlockExampleGen)")
    parser.add_argument("--first-month", help="first month of the stream's schedule, YYYY-MM")
    parser.add_argument("--last-month", help="last month of the stream's schedule, YYYY-MM")
    args = parser.parse_args()
    if not args.no_ingest and not (args.first_month and args.last_month):
        parser.error("ingesting needs --first-month and --last-month (or pass --no-ingest)")
    store = os.path.join(args.workdir, "metadata.sqlite")
    try:
        run_local(create_pipeline(args.workdir, args.data_root, ledger_store=store,
                                  metadata_path=store, ingest=not args.no_ingest,
                                  months=(args.first_month, args.last_month)))
    except LedgerError as error:
        # A refused request (blocks already registered, a check before the charge, budget
        # exhausted) is the user's to fix: one line saying what and how, not a traceback.
        print(f"first_pipeline: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
