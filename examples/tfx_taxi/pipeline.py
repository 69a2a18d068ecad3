"""TFX's native-Keras Chicago taxi pipeline (tfx/examples/chicago_taxi_pipeline/
taxi_pipeline_native_keras.py), made private: the same DAG, each standard component that reads
records replaced by its DP stand-in, in the template's order (docs/tfx-pipeline.md):

| TFX's template | here |
| --- | --- |
| CsvExampleGen | BlockExampleGen: the same CSV, one block per month, each with ceiling (4, 1e-5) |
| (nothing) | BlockLedger: one grant on every block, charged before any record is read |
| StatisticsGen | DPStatisticsGen: TFDV's statistics format, every number DP |
| SchemaGen | DPSchemaGen: the template's own schema file (ImportSchemaGen's job) |
| ExampleValidator | TFX's own ExampleValidator where TFDV is installed (it reads only the DP statistics and the schema); left out here, where TFDV cannot be installed |
| Transform | DPTransform: the module's preprocessing_fn, its tft analyzers DP |
| Trainer | ObliviousSampleGen + DPTrainer: DP-SGD on oblivious samples |
| Resolver (latest blessed model) | TFX's Resolver |
| Evaluator | SLAedValidator: DP accuracy against the majority class and the latest blessed model |
| Pusher | TFX's Pusher, on SLAedValidator's blessing |

The module is the template's with `taxi_utils_native_keras.diff` applied (taxi_utils.py). Run:

    python -m sage_tfx.examples.tfx_taxi.pipeline --workdir out/tfx-taxi

The budget: every block's ceiling is (BLOCK_EPSILON, BLOCK_DELTA); the run's one grant of
(EPSILON, DELTA) covers all 48 months, so each block spends at most EPSILON, split among the DP
steps by SPLIT.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from tfx.components.pusher.component import Pusher
from tfx.dsl.components.common import resolver
from tfx.dsl.input_resolution.strategies.latest_blessed_model_strategy import (
    LatestBlessedModelStrategy)
from tfx.orchestration import metadata, pipeline
from tfx.proto import pusher_pb2
from tfx.types import Channel
from tfx.types.standard_artifacts import Model, ModelBlessing

from sage_tfx.components import (BlockExampleGen, BlockLedger, DPSchemaGen, DPStatisticsGen,
                                 DPTrainer, DPTransform, ObliviousSampleGen, SLAedValidator)
from sage_tfx.components.block_example_gen import month_schedule
from sage_tfx.components.dp_statistics_gen.schema import columns_and_bounds, read_schema
from sage_tfx.examples.tfx_taxi import template

PIPELINE_NAME = "chicago-taxi-native-keras"  # the template's, in the characters Kubeflow V2 takes
MODULE = "sage_tfx.examples.tfx_taxi.taxi_utils"   # the template's module + our diff
MODEL_FN = "_build_keras_model"                     # the module's model builder (run_fn's)
MONTHS = ("2013-01", "2016-12")                     # the stream's public schedule
WINDOW = 48                                         # the grant: every month of it
BLOCK_EPSILON, BLOCK_DELTA = 4.0, 1e-5              # every monthly block's ceiling
EPSILON, DELTA = 4.0, 1e-6                          # the run's grant, on every block
SPLIT = {"statistics": 0.05, "transform": 0.15, "sampling_count": 0.02, "training": 0.5,
         "validation": 0.28}
# Half of each block is held out (the `eval` split): DP validation is the most sample-hungry
# step (Sage §5.2). With a fifth held out (about 3,000 trips) and validation epsilon 0.72, the
# baseline test's bound was 0.12 below its DP estimate, more than a good model's lead over the
# majority class (about 0.1): the model was never blessed.
TEST_FRACTION = 0.5
# DPStatisticsGen's public bounds for the numeric features (the schema holds none): Chicago's
# extent, its census tracts and community areas, the calendar, the schedule.
STATISTICS_BOUNDS = {
    "trip_miles": (0.0, 50.0), "fare": (0.0, 100.0), "tips": (0.0, 50.0),
    "trip_seconds": (0.0, 7200.0), "trip_start_hour": (0, 23), "trip_start_day": (1, 7),
    "trip_start_month": (1, 12), "trip_start_timestamp": month_schedule(*MONTHS),
    "pickup_latitude": (41.6, 42.1), "dropoff_latitude": (41.6, 42.1),
    "pickup_longitude": (-88.0, -87.5), "dropoff_longitude": (-88.0, -87.5),
    "pickup_community_area": (1, 77), "dropoff_community_area": (1, 77),
    "pickup_census_tract": (17031010100, 17031980100),
    "dropoff_census_tract": (17031010100, 17031980100),
}
# DPTrainer's DP-SGD: Poisson samples of about 1/GAMMA_INVERSE of the training records.
TRAINER = {"l2_norm_clip": 1.0, "learning_rate": 0.5}
SAMPLING = {"scheme": "poisson", "gamma": 0.01, "epochs": 4}
VALIDATION = {"metric": "accuracy", "target": 0.6, "confidence": 0.95, "baseline_margin": 0.0}


def csv_columns(schema_file: str) -> dict[str, str]:
    """The CSV's columns typed as the user's schema types them (BlockExampleGen's `columns`:
    public, declared, never guessed from the cells)."""
    return columns_and_bounds(read_schema(schema_file))[0]


def create_pipeline(pipeline_name: str, pipeline_root: str, data_root: str, module_file: str,
                    serving_model_dir: str, ledger_store: str, schema_file: str,
                    metadata_connection_config=None, seed: Optional[int] = None,
                    epochs: int = SAMPLING["epochs"], enable_cache: bool = False,
                    beam_pipeline_args: Optional[list[str]] = None) -> pipeline.Pipeline:
    """The template's `_create_pipeline`, private. `ledger_store`: the ML Metadata store of
    the ledger (the pipeline's own SQLite file by default; a gRPC address on Kubeflow).
    `seed`: tests only (refused unless the ledger was created for tests)."""
    start, end = month_schedule(*MONTHS)
    example_gen = BlockExampleGen(
        input_base=data_root, block_key="trip_start_timestamp", block_by="month",
        schedule_start=start, schedule_end=end, ledger_store=ledger_store,
        block_epsilon=BLOCK_EPSILON, block_delta=BLOCK_DELTA, test_fraction=TEST_FRACTION,
        columns=csv_columns(schema_file))

    # Charges every block before a record is read; the DP components below spend its shares.
    grant = BlockLedger(ledger_store=ledger_store, new_blocks=example_gen.outputs["examples"],
                        window=WINDOW, epsilon=EPSILON, delta=DELTA,
                        split=SPLIT, pipeline_name=pipeline_name)
    examples, granted = grant.outputs["examples"], grant.outputs["grant"]

    statistics_gen = DPStatisticsGen(examples=examples, grant=granted, schema_file=schema_file,
                                     bounds=STATISTICS_BOUNDS)
    schema_gen = DPSchemaGen(schema_file=schema_file)
    example_validator = _example_validator(statistics_gen, schema_gen)

    transform = DPTransform(examples=examples, grant=granted, schema=schema_gen.outputs["schema"],
                            module_file=module_file)

    sampler = ObliviousSampleGen(examples=examples, grant=granted, seed=seed,
                                 **{**SAMPLING, "epochs": epochs})
    trainer = DPTrainer(examples=sampler.outputs["samples"], grant=granted,
                        module_file=module_file, model_fn=MODEL_FN,
                        transform_graph=transform.outputs["transform_graph"], seed=seed,
                        **TRAINER)

    model_resolver = resolver.Resolver(
        strategy_class=LatestBlessedModelStrategy,
        model=Channel(type=Model),
        model_blessing=Channel(type=ModelBlessing)).with_id("latest_blessed_model_resolver")

    evaluator = SLAedValidator(model=trainer.outputs["model"], examples=examples, grant=granted,
                               module_file=module_file,
                               transform_graph=transform.outputs["transform_graph"],
                               baseline_model=model_resolver.outputs["model"], **VALIDATION)

    pusher = Pusher(model=trainer.outputs["model"], model_blessing=evaluator.outputs["blessing"],
                    push_destination=pusher_pb2.PushDestination(
                        filesystem=pusher_pb2.PushDestination.Filesystem(
                            base_directory=serving_model_dir)))

    return pipeline.Pipeline(
        pipeline_name=pipeline_name, pipeline_root=pipeline_root,
        components=[example_gen, grant, statistics_gen, schema_gen, *example_validator,
                    transform, sampler, trainer, model_resolver, evaluator, pusher],
        enable_cache=enable_cache, metadata_connection_config=metadata_connection_config,
        beam_pipeline_args=beam_pipeline_args)


def _example_validator(statistics_gen, schema_gen) -> list:
    """TFX's ExampleValidator on the DP statistics and the schema where it imports (it needs
    TFDV); nothing where it does not. It reads no record, so it needs no grant."""
    try:
        from tfx.components.example_validator.component import ExampleValidator
    except ImportError:
        return []
    return [ExampleValidator(statistics=statistics_gen.outputs["statistics"],
                             schema=schema_gen.outputs["schema"])]


def main(argv: Optional[list[str]] = None) -> None:
    from sage_tfx.pipelines.local import run_local
    from sage_tfx.sage_access import BlockLedger as Ledger

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="out/tfx-taxi")
    args = parser.parse_args(argv)
    store = os.path.join(args.workdir, "metadata.sqlite")
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.exists(store):
        Ledger.create(store)
    run_local(create_pipeline(
        PIPELINE_NAME, os.path.join(args.workdir, "pipelines"), template.data_root(), MODULE,
        os.path.join(args.workdir, "serving_model"), store, template.schema_file(),
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store)))


if __name__ == "__main__":
    main()
