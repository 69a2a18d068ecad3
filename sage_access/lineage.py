"""Audit and lineage of a BlockLedger: the grant history, its re-derivation, and run contexts.

Reads the whole history (operators, the CLI, tests); nothing here is on the grant path.
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np
from ml_metadata import errors as mlmd_errors
from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access.allocation import BlockState
from sage_tfx.sage_access.records import (BLOCK_VERSION_TYPE, LEDGER_CONTEXT_TYPE,
                                          RUN_CONTEXT_TYPE, TFX_RUN_CONTEXT_TYPE, LedgerRecords,
                                          check_name, get_property)
from sage_tfx.sage_access.store import StoreSpec, connect


def grant_records(records: LedgerRecords) -> list[dict]:
    """Every grant of the ledger, oldest first, as recorded: time (ms since the epoch), grant id,
    pipeline, run id, blocks, epsilon, delta, and the split among DP steps, the dp-accounting
    event of each step (as JSON) and the RDP curve when the grant recorded them."""
    history = []
    for execution in records.grant_executions(oldest_first=True):
        grant = records.grant_of(execution)
        history.append({
            "time_ms": execution.create_time_since_epoch, "grant_id": grant.grant_id,
            "pipeline": grant.pipeline, "run_id": get_property(execution, "run_id"),
            "blocks": list(grant.blocks), "epsilon": grant.epsilon, "delta": grant.delta,
            # None when the grant recorded none (made before grants recorded them).
            "split": grant.split if get_property(execution, "split") else None,
            "events": grant.events if get_property(execution, "events") else None,
            "rdp_curve": list(grant.rdp_curve) if grant.rdp_curve else None})
    return history


def audit(records: LedgerRecords, accounting, blocks: list[BlockState]) -> list[str]:
    """Re-derive every balance of `blocks` (all the ledger's) from the append-only history;
    return the inconsistencies found.

    Checks: each block's materialised spending equals the sum of the demands of the grants that
    name it, no block is above its ceiling, and every grant created the next version of each
    block it names (grants are whole).
    """
    problems = []
    charged: dict[str, list[np.ndarray]] = {}
    store = records.store
    grants = records.grant_executions()
    events = store.get_events_by_execution_ids([g.id for g in grants]) if grants else []
    outputs: dict[int, list[int]] = {}
    for event in events:
        if event.type == pb.Event.OUTPUT:
            outputs.setdefault(event.execution_id, []).append(event.artifact_id)
    versions = {a.id: a.name for a in store.get_artifacts_by_id(
        [i for ids in outputs.values() for i in ids])
        if a.type_id == records.types[BLOCK_VERSION_TYPE]} if outputs else {}
    for execution in grants:
        named = json.loads(get_property(execution, "blocks"))
        demand = np.array(json.loads(get_property(execution, "demand")))
        versioned = sorted(versions[i].split("/")[1] for i in outputs.get(execution.id, [])
                           if i in versions)
        if versioned != sorted(named):
            problems.append(f"grant {get_property(execution, 'grant_id')}: versioned blocks "
                            f"{versioned} but names {sorted(named)}")
        for block_id in named:
            charged.setdefault(block_id, []).append(demand)
    for block in blocks:
        history = charged.get(block.block_id, [])
        total = sum(history, accounting.zero())
        if not np.allclose(total, block.spent, rtol=1e-9, atol=0):
            problems.append(f"block {block.block_id}: spent {list(block.spent)} but its grants "
                            f"sum to {list(total)}")
        if len(history) != block.charges:
            problems.append(f"block {block.block_id}: {block.charges} charges counted, "
                            f"{len(history)} grants name it")
        if not accounting.fits(accounting.zero(), block.spent, block.capacity):
            problems.append(f"block {block.block_id}: spent {list(block.spent)} is above its "
                            "ceiling")
    return problems


def run_contexts(store: metadata_store.MetadataStore, run_id: Optional[str]) -> list[pb.Context]:
    """The context a charge for pipeline run `run_id` is attributed to: TFX's `pipeline_run`
    context of that name when it is in the same store, else a `sage_tfx.PipelineRun` one."""
    if run_id is None:
        return []
    check_name(run_id, "run id")
    try:
        tfx_run = store.get_context_by_type_and_name(TFX_RUN_CONTEXT_TYPE, run_id)
    except mlmd_errors.NotFoundError:
        tfx_run = None
    if tfx_run is not None:
        return [tfx_run]
    return [pb.Context(type_id=store.get_context_type(RUN_CONTEXT_TYPE).id, name=run_id)]


def ledger_contexts(store: StoreSpec) -> list[str]:
    """The names of the ledger contexts in `store` (read only)."""
    mlmd = connect(store)
    return [c.name for c in mlmd.get_contexts_by_type(LEDGER_CONTEXT_TYPE)]
