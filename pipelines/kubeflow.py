"""The taxi pipeline as a Kubeflow Pipelines V2 PipelineJob (TFX's KubeflowV2DagRunner).

    sage-tfx compile --kubeflow --out taxi.json --image IMAGE --pipeline-root gs://... \
        (--data-root gs://... | --pipeline-module my_pipeline.py[:create_pipeline])

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
from sage_tfx.sage_access.store import KUBEFLOW_LEDGER_STORE



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


def load_pipeline_function(spec: str):
    """`PATH.py[:FUNCTION]` -> the function (default `create_pipeline`); ValueError naming what
    is missing."""
    import importlib.util

    path, _, function = spec.partition(":")
    function = function or "create_pipeline"
    if not path.endswith(".py") or not os.path.isfile(path):
        raise ValueError(f"--pipeline-module {spec!r}: no Python file {path!r}")
    loaded = importlib.util.spec_from_file_location("sage_tfx_user_pipeline", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    if not callable(getattr(module, function, None)):
        raise ValueError(f"--pipeline-module {spec!r}: {path} defines no function {function}")
    return getattr(module, function)


def _taxi_from_args(args):
    import dataclasses

    from sage_tfx.examples.taxi.pipeline import (INITIAL_EPSILON, MIN_WINDOW, adassp_spec,
                                                 dp_sgd_spec)
    spec = (adassp_spec if args.mode == "adassp" else dp_sgd_spec)()
    if args.module_file:
        spec = dataclasses.replace(spec, module_file=args.module_file)
    window = MIN_WINDOW[args.mode] if args.window is None else args.window
    epsilon = INITIAL_EPSILON[args.mode] if args.epsilon is None else args.epsilon
    summary = (f"; a grant of epsilon {epsilon:g} on {window} block(s); ledger at "
               f"{KUBEFLOW_LEDGER_STORE}")
    return taxi_pipeline(spec, args.pipeline_root, args.data_root, window, epsilon,
                         months=(args.first_month, args.last_month)), summary


def compile_command(args) -> int:
    """`sage-tfx compile --kubeflow` (arguments in sage_tfx/cli.py): the taxi example, or the
    pipeline a user's module returns."""
    from tfx.orchestration import pipeline as tfx_pipeline_module

    try:
        if args.pipeline_module:
            tfx_pipeline = load_pipeline_function(args.pipeline_module)(
                pipeline_root=args.pipeline_root)
            if not isinstance(tfx_pipeline, tfx_pipeline_module.Pipeline):
                raise ValueError(f"--pipeline-module {args.pipeline_module!r} returned "
                                 f"{type(tfx_pipeline).__name__}, not a tfx Pipeline")
            summary = ""
        else:
            tfx_pipeline, summary = _taxi_from_args(args)
    except ValueError as error:
        print(f"sage-tfx compile: {error}; nothing written", file=sys.stderr)
        return 2
    job = compile_kubeflow(tfx_pipeline, args.out, args.image)
    tasks = job["pipelineSpec"]["root"]["dag"]["tasks"]
    print(f"wrote {args.out}: Kubeflow V2 PipelineJob {job['displayName']!r} with "
          f"{len(tasks)} tasks ({', '.join(sorted(tasks))}), image {args.image}, pipeline root "
          f"{args.pipeline_root}{summary}")
    return 0
