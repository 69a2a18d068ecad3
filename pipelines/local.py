"""Run a pipeline on TFX's LocalDagRunner behind the DAG guard, and say what TFX's cache served.

    from sage_tfx.pipelines.local import run_local
    run_local(my_pipeline)

1. `check_pipeline` (components/dag_guard) refuses, before anything runs or is charged, a
   component that would read private records without spending a grant.
2. LocalDagRunner runs the pipeline.
3. With `enable_cache=True`, TFX serves a component whose inputs and parameters match an earlier
   execution from its cache: the executor does not run, so a cached BlockLedger charges
   nothing and hands on the grant the earlier run charged (whose shares that run's components
   consumed; a component that is not cached refuses to consume one twice). One line per run
   says which components the cache served and which grant they reuse.
"""
from __future__ import annotations

from typing import Callable, Optional

from ml_metadata.proto import metadata_store_pb2
from tfx.orchestration import metadata
from tfx.orchestration.local.local_dag_runner import LocalDagRunner

from sage_tfx import console
from sage_tfx.components.dag_guard import check_pipeline
from sage_tfx.components.privacy_grant import PrivacyGrant

__all__ = ["cached_components", "latest_run", "run_local"]


def latest_run(store, pipeline_name: str):
    """The pipeline's most recent `pipeline_run` context (LocalDagRunner runs synchronously,
    so right after a run it is that run's)."""
    runs = [c for c in store.get_contexts_by_type("pipeline_run")
            if any(p.name == pipeline_name for p in store.get_parent_contexts_by_context(c.id))]
    if not runs:
        raise RuntimeError(f"no run of pipeline {pipeline_name!r} in the metadata store")
    return max(runs, key=lambda c: c.id)


def cached_components(store, pipeline_name: str) -> tuple[list[str], list[str]]:
    """(the components TFX's cache served in the pipeline's latest run, the grant ids of the
    PrivacyGrants they handed on)."""
    run = latest_run(store, pipeline_name)
    cached = sorted((e for e in store.get_executions_by_context(run.id)
                     if e.last_known_state == metadata_store_pb2.Execution.CACHED),
                    key=lambda e: e.id)  # in the order they ran
    if not cached:
        return [], []
    names = [e.type.rsplit(".", 1)[-1] for e in cached]
    outputs = {event.artifact_id for event in store.get_events_by_execution_ids(
        [e.id for e in cached]) if event.type == metadata_store_pb2.Event.OUTPUT}
    grants = sorted({a.custom_properties["grant_id"].string_value
                     for a in store.get_artifacts_by_id(sorted(outputs))
                     if a.type == PrivacyGrant.TYPE_NAME})
    return names, grants


def run_local(tfx_pipeline, runner: Optional[LocalDagRunner] = None,
              report: Callable[[str], None] = console.report) -> None:
    """Guard, run and report (the module docstring)."""
    check_pipeline(tfx_pipeline)
    (runner or LocalDagRunner()).run(tfx_pipeline)
    if not tfx_pipeline.enable_cache or tfx_pipeline.metadata_connection_config is None:
        return
    with metadata.Metadata(tfx_pipeline.metadata_connection_config) as handle:
        names, grants = cached_components(handle.store, tfx_pipeline.pipeline_info.pipeline_name)
    if names:
        reused = (f"; grant {', '.join(grants)} was charged once, by the run that made it"
                  if grants else "")
        report(f"served from TFX's cache, nothing run and nothing charged: "
               f"{', '.join(names)}{reused}")
