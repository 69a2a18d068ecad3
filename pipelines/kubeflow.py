"""Any TFX pipeline as a Kubeflow Pipelines V2 PipelineJob (TFX's KubeflowV2DagRunner).

    sage-tfx compile --kubeflow --out job.json --image IMAGE --pipeline-root gs://... \
        --pipeline-module my_pipeline.py[:create_pipeline]

`compile_kubeflow` takes a pipeline object, a function returning one, or where to find that
function (`PATH.py[:FUNCTION]` or `package.module[:FUNCTION]`), after the DAG guard
(components/dag_guard: private records reach only components that spend a grant). Pipelines
built from sage-tfx components keep their ledger in the cluster's ML Metadata, reached over gRPC
(sage_access/store.KUBEFLOW_LEDGER_STORE), the store the Kubeflow UI reads, so each grant
appears next to its run. The image must have sage-tfx installed, TF_USE_LEGACY_KERAS=1 in its
environment (tensorflow-privacy needs Keras 2), and any module file at the path given: the
compiler refuses a `module_file` that names a file of the compiling machine (check_module_files).
The CLI's default pipeline (the taxi example) is chosen in sage_tfx/cli/compile.py, not here.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import posixpath
import sys
from typing import Callable, Union

from tfx.orchestration import pipeline as tfx_pipeline_module
from tfx.orchestration.kubeflow.v2 import kubeflow_v2_dag_runner

from sage_tfx.components.block_example_gen import BlockExampleGen
from sage_tfx.components.dag_guard import check_pipeline
from sage_tfx.components.util.user_module import is_module_path
from sage_tfx.sage_access.store import KUBEFLOW_LEDGER_STORE

PipelineSource = Union[tfx_pipeline_module.Pipeline, Callable[..., tfx_pipeline_module.Pipeline],
                       str]
__all__ = ["IMAGE_ROOT", "KUBEFLOW_LEDGER_STORE", "check_module_files", "compile_kubeflow",
           "compile_command", "load_pipeline", "resolve_pipeline"]
# Where the image has sage-tfx's files (the Dockerfile's WORKDIR, which it copies the repository
# to and installs from): the only files of a compiled job's steps that this compiler knows of.
IMAGE_ROOT = "/opt/sage-tfx"


def load_pipeline(source: str) -> Callable[..., tfx_pipeline_module.Pipeline]:
    """`PATH.py[:FUNCTION]` or `package.module[:FUNCTION]` -> the function (default
    `create_pipeline`); ValueError naming what is missing."""
    location, _, function = source.partition(":")
    function = function or "create_pipeline"
    if location.endswith(".py"):
        if not os.path.isfile(location):
            raise ValueError(f"pipeline {source!r}: no Python file {location!r}")
        loaded = importlib.util.spec_from_file_location("sage_tfx_user_pipeline", location)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise ValueError(f"pipeline {source!r}: cannot import {location!r}: {error}") from None
    if not callable(getattr(module, function, None)):
        raise ValueError(f"pipeline {source!r}: {location} defines no function {function}")
    return getattr(module, function)


def resolve_pipeline(source: PipelineSource, **arguments) -> tfx_pipeline_module.Pipeline:
    """The tfx Pipeline `source` names: itself, or what its function returns when called with
    `arguments` (e.g. pipeline_root=...); ValueError if that is not a tfx Pipeline."""
    if isinstance(source, tfx_pipeline_module.Pipeline):
        return source
    function = load_pipeline(source) if isinstance(source, str) else source
    built = function(**arguments)
    if not isinstance(built, tfx_pipeline_module.Pipeline):
        raise ValueError(f"pipeline {getattr(source, '__name__', source)!r} returned "
                         f"{type(built).__name__}, not a tfx Pipeline")
    return built


def check_module_files(tfx_pipeline: tfx_pipeline_module.Pipeline) -> None:
    """ValueError unless every component's `module_file` is a module path (`package.module`,
    found wherever the image installed it) or a file under IMAGE_ROOT. Any other path names a
    file of the compiling machine that the cluster's containers do not have: the step would
    fail there, after the BlockLedger charged its grant."""
    for component in tfx_pipeline.components:
        path = component.exec_properties.get("module_file")
        if path is None or is_module_path(path):
            continue
        if posixpath.isabs(path) and posixpath.normpath(path).startswith(IMAGE_ROOT + "/"):
            continue
        raise ValueError(
            f"{component.id}'s module_file {path!r} is a path on this machine, which the "
            f"job's containers do not have (the image holds sage-tfx under {IMAGE_ROOT}); the "
            "step would fail there after the grant was charged. Pass a path inside the image "
            f"(under {IMAGE_ROOT}/; for the taxi example, --module-file) or a module path "
            "installed in the image (package.module, e.g. sage_tfx.examples.trip_model)")


class _NoInfraValidator:
    """Stands in for tfx.components.InfraValidator when its import failed (see below)."""


def compile_kubeflow(source: PipelineSource, out: str, image: str, **arguments) -> dict:
    """Write the PipelineJob JSON of the pipeline `source` names (resolve_pipeline, called with
    `arguments`) to `out` and return it."""
    tfx_pipeline = resolve_pipeline(source, **arguments)
    check_pipeline(tfx_pipeline)  # private records reach only components that spend a grant
    check_module_files(tfx_pipeline)
    for component in tfx_pipeline.components:
        if isinstance(component, BlockExampleGen):
            # TFX's Kubeflow V2 entrypoint publishes exactly one artifact per output
            # (translate_executor_output); one per block failed the task after the blocks
            # were registered.
            component.exec_properties["per_block_artifacts"] = 0
    from tfx import components
    if components.InfraValidator is None:
        # TFX 1.21's V2 step builder tests isinstance(node, components.InfraValidator), which
        # is None here because InfraValidator needs the kubernetes client we do not install.
        # These pipelines have no InfraValidator, so a class nothing is an instance of is exact.
        components.InfraValidator = _NoInfraValidator
    directory, filename = os.path.split(os.path.abspath(out))
    # Pipeline spec 2.1: Kubeflow Pipelines 2's driver resolves constant parameters only in
    # its form (runtimeValue.constant); 2.0's constantValue fails there ("param runtime value
    # spec of type ... not implemented"). TFX's executor entrypoint reads both.
    runner = kubeflow_v2_dag_runner.KubeflowV2DagRunner(
        config=kubeflow_v2_dag_runner.KubeflowV2DagRunnerConfig(default_image=image,
                                                                use_pipeline_spec_2_1=True),
        output_dir=directory, output_filename=filename)
    runner.run(tfx_pipeline)
    with open(out) as handle:
        return json.load(handle)


def compile_command(source: PipelineSource, out: str, image: str, pipeline_root: str,
                    summary: str = "") -> int:
    """`sage-tfx compile --kubeflow` (arguments in sage_tfx/cli/compile.py): compile the pipeline
    `source` names, its function called with pipeline_root; exit status 2 if it is refused."""
    try:
        job = compile_kubeflow(source, out, image, pipeline_root=pipeline_root)
    except ValueError as error:
        print(f"sage-tfx compile: {error}; nothing written", file=sys.stderr)
        return 2
    tasks = job["pipelineSpec"]["root"]["dag"]["tasks"]
    print(f"wrote {out}: Kubeflow V2 PipelineJob {job['displayName']!r} with "
          f"{len(tasks)} tasks ({', '.join(sorted(tasks))}), image {image}, pipeline root "
          f"{pipeline_root}{summary}")
    return 0
