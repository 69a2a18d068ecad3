"""BlockLedger component's executor: obtain a grant, then release the granted blocks' Examples.

Order matters (docs/architecture.md, "charge before release"): the checks of the components the
grant pays for run first (preflight.py), then the ledger charges every selected block (all or
nothing) before a single record is copied to the output. A refused check, a denied or a malformed
request fails the component with nothing charged and nothing written.
"""
from __future__ import annotations

import json
import os
from typing import Any

import tensorflow as tf
from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils

from sage_tfx import console, release
from sage_tfx.components.block_ledger import preflight
from sage_tfx.components.privacy_grant import (mark_examples, planned_additional_delta,
                                               step_events, write_grant)
from sage_tfx.components.util.examples_io import SPLITS
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.accounting import check_split
from sage_tfx.sage_access.ledger import EXAMPLES, BlockIds, BlockLedger, RecentWindow
from sage_tfx.sage_access.store import parse


def _selector(exec_properties: dict[str, Any]):
    window = exec_properties.get("window") or 0
    block_ids = json.loads(exec_properties.get("block_ids") or "[]")
    if bool(window) == bool(block_ids):
        raise BadRequest("give exactly one selector: window (most recent W blocks) or block_ids")
    # Only blocks holding Examples: a table ingested into the same ledger context
    # (dp_statistics) is skipped by a window and refused by name, before the charge.
    return (RecentWindow(int(window), data_format=EXAMPLES) if window
            else BlockIds(block_ids, data_format=EXAMPLES))


def _link_or_copy(source: str, target: str) -> None:
    """A hard link on a local disk; else a copy through TF's filesystems (gfile), which open
    what a pipeline root may be (gs://, s3://, hdfs://), as every read after the charge must."""
    try:
        os.link(source, target)
    except OSError:
        tf.io.gfile.copy(source, target, overwrite=True)


FRONT_DOOR = "BlockLedger component"


def _run_and_node(context, output_uri: str, pipeline: str | None) -> tuple[str | None,
                                                                          str | None]:
    """The pipeline run this execution belongs to and the component's id in its pipeline
    (None, None outside a pipeline). TFX's own runners give both in the executor's context.
    TFX's Kubeflow V2 entrypoint (kubeflow_v2_run_executor) gives neither: its context holds
    only a unique id, the name of the directory of the task's output metadata file, which
    Kubeflow Pipelines 2 puts at /tmp/kfp_outputs for every task. What the task does know is
    where Kubeflow's launcher placed its outputs: `<pipeline root>/<pipeline name>/<run id>/
    <task>/<output key>` (the run's pipeline root is the job's root joined with the pipeline's
    name and the run id, each output under the task's name); the run and the task are read
    from there, when the path has that shape."""
    if context is not None and context.pipeline_run_id:
        node = context.pipeline_node
        return context.pipeline_run_id, node.node_info.id if node is not None else None
    parts = output_uri.rstrip("/").split("/")
    if pipeline and len(parts) >= 4 and parts[-4] == pipeline:
        return parts[-3], parts[-2]
    return None, None


class Executor(base_executor.BaseExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        budget_split = check_split(json.loads(exec_properties["split"]))
        selector = _selector(exec_properties)
        store = exec_properties["ledger_store"]
        ledger = BlockLedger(parse(store), exec_properties["ledger_context"])
        pipeline = exec_properties.get("pipeline_name") or (
            self._context.pipeline_info.id if self._context and self._context.pipeline_info else None)

        epsilon, delta = float(exec_properties["epsilon"]), float(exec_properties["delta"])
        mechanisms = json.loads(exec_properties.get("step_mechanisms") or "{}")
        events = step_events(mechanisms, budget_split, epsilon, delta, ledger.accounting.name)
        preflight.run(preflight.parse(exec_properties.get(preflight.PROPERTY)), epsilon, delta,
                      budget_split, events)
        examples = artifact_utils.get_single_instance(output_dict["examples"])
        run_id, node_id = _run_and_node(self._context, examples.uri, pipeline)
        # What the ledger records as the request: the pipeline and this component's terms (the
        # steps' outcomes are recorded by the components that spend them).
        request = json.dumps({"pipeline": pipeline, "run": run_id, "component": node_id,
                              "split": budget_split, "step_mechanisms": json.loads(
                                  exec_properties.get("step_mechanisms") or "{}")},
                             sort_keys=True)
        plan = release.ReleasePlan(FRONT_DOOR, request, epsilon, delta, budget_split, events,
                                   additional_delta=planned_additional_delta(
                                       mechanisms, budget_split, epsilon, delta),
                                   pipeline=pipeline, run_id=run_id, data_uri=examples.uri,
                                   require_data=True)
        charged = release.charge(ledger, plan, selector)
        grant = charged.grant
        # The components downstream record their steps' outcomes; a failure before the grant
        # is handed on (copying the Examples, writing the PrivacyGrant) is recorded here.
        with charged:
            charged.phase = "releasing the granted Examples"
            blocks = ", ".join(grant.blocks) if len(grant.blocks) <= 4 else \
                f"{grant.blocks[0]} .. {grant.blocks[-1]} ({len(grant.blocks)} blocks)"
            console.report("BlockLedger: grant %s charged (%s, %s) on %s for pipeline %s",
                           grant.grant_id, grant.epsilon, grant.delta, blocks, pipeline)

            examples.split_names = artifact_utils.encode_split_names(list(SPLITS))
            for block_id in grant.blocks:
                data_uri = ledger.block(block_id).data_uri  # required by the grant
                for split in SPLITS:
                    source_dir = os.path.join(data_uri, f"Split-{split}")
                    target_dir = os.path.join(examples.uri, f"Split-{split}")
                    tf.io.gfile.makedirs(target_dir)
                    for name in sorted(tf.io.gfile.listdir(source_dir)):
                        _link_or_copy(os.path.join(source_dir, name),
                                      os.path.join(target_dir, f"{block_id}-{name}"))
            mark_examples(examples, grant, grant.blocks)
            write_grant(artifact_utils.get_single_instance(output_dict["grant"]), grant, store)
            charged.handed_on()
