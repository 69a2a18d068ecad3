"""The taxi pipeline as a Kubeflow Pipelines V2 PipelineJob (TFX's KubeflowV2DagRunner).

    sage-tfx compile --kubeflow --out taxi.json [--image IMAGE] [--pipeline-root gs://...]

One privacy-adaptive iteration per run, with ingestion first: BlockExampleGen -> BlockLedger ->
DPTransform -> [ObliviousSampleGen] -> DPTrainer -> SLAedValidator -> Pusher. On Kubeflow the
ledger lives in the cluster's ML Metadata, reached over gRPC (KUBEFLOW_LEDGER_STORE), the same
store the Kubeflow UI reads, so each grant appears next to its run. The image must have
sage-tfx installed, TF_USE_LEGACY_KERAS=1 in its environment (tensorflow-privacy needs Keras 2),
and the module file at the path given.
"""
from __future__ import annotations

import json
import os
import sys

from tfx.orchestration.kubeflow.v2 import kubeflow_v2_dag_runner

from sage_tfx.components.block_example_gen import BlockExampleGen, month_schedule
from sage_tfx.pipelines.adaptive import IterationSpec, build_iteration

KUBEFLOW_LEDGER_STORE = "grpc://metadata-grpc-service:8080"


def taxi_pipeline(spec: IterationSpec, pipeline_root: str, data_root: str, window: int,
                  epsilon: float, ledger_store: str = KUBEFLOW_LEDGER_STORE,
                  name: str = "sage-taxi", months: tuple[str, str] = ("2013-01", "2016-12")):
    """The taxi iteration with ingestion first; `months` is the stream's public schedule."""
    from sage_tfx.examples.taxi.pipeline import BLOCK_DELTA, BLOCK_EPSILON, TEST_FRACTION
    start, end = month_schedule(*months)
    ingest = BlockExampleGen(input_base=data_root, block_key="trip_start_timestamp",
                             block_by="month", schedule_start=start, schedule_end=end,
                             ledger_store=ledger_store,
                             block_epsilon=BLOCK_EPSILON, block_delta=BLOCK_DELTA,
                             test_fraction=TEST_FRACTION)
    return build_iteration(spec, name, pipeline_root, ledger_store, window, epsilon,
                           ingest=ingest, push_to=os.path.join(pipeline_root, "serving"))


class _NoInfraValidator:
    """Stands in for tfx.components.InfraValidator when its import failed (see below)."""


def compile_kubeflow(tfx_pipeline, out: str, image: str) -> dict:
    """Write the PipelineJob JSON to `out` and return it."""
    from tfx import components
    if components.InfraValidator is None:
        # TFX 1.21's V2 step builder tests isinstance(node, components.InfraValidator), which
        # is None here because InfraValidator needs the kubernetes client we do not install.
        # These pipelines have no InfraValidator, so a class nothing is an instance of is exact.
        components.InfraValidator = _NoInfraValidator
    directory, filename = os.path.split(os.path.abspath(out))
    runner = kubeflow_v2_dag_runner.KubeflowV2DagRunner(
        config=kubeflow_v2_dag_runner.KubeflowV2DagRunnerConfig(default_image=image),
        output_dir=directory, output_filename=filename)
    runner.run(tfx_pipeline)
    with open(out) as handle:
        return json.load(handle)


def compile_taxi_command(args) -> int:
    """`sage-tfx compile --kubeflow` (arguments in sage_tfx/cli.py)."""
    import dataclasses

    from sage_tfx.examples.taxi.pipeline import (INITIAL_EPSILON, MIN_WINDOW, adassp_spec,
                                                 dp_sgd_spec)
    spec = (adassp_spec if args.mode == "adassp" else dp_sgd_spec)()
    if args.module_file:
        spec = dataclasses.replace(spec, module_file=args.module_file)
    window = MIN_WINDOW[args.mode] if args.window is None else args.window
    epsilon = INITIAL_EPSILON[args.mode] if args.epsilon is None else args.epsilon
    try:
        tfx_pipeline = taxi_pipeline(spec, args.pipeline_root, args.data_root, window, epsilon)
    except ValueError as error:
        print(f"sage-tfx compile: {error}; nothing written", file=sys.stderr)
        return 2
    job = compile_kubeflow(tfx_pipeline, args.out, args.image)
    tasks = job["pipelineSpec"]["root"]["dag"]["tasks"]
    print(f"wrote {args.out}: Kubeflow V2 PipelineJob {job['displayName']!r} with "
          f"{len(tasks)} tasks ({', '.join(sorted(tasks))}); a grant of epsilon {epsilon:g} "
          f"on {window} block(s); ledger at {KUBEFLOW_LEDGER_STORE}")
    return 0
