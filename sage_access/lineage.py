"""Audit and lineage of a BlockLedger: the grant history, its re-derivation, and run contexts.

Reads the whole history (operators, the CLI, tests); on the grant path only `check_balances`,
which reads the last change of each block a grant charges.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from ml_metadata import errors as mlmd_errors
from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access.allocation import BlockState
from sage_tfx.sage_access.errors import BalanceTampered
from sage_tfx.sage_access.exact import exact_vector
from sage_tfx.sage_access.mysql_commit import VersionRecords
from sage_tfx.sage_access.records import (BLOCK_VERSION_TYPE, GRANT_TYPE, KFP_RUN_CONTEXT_TYPE,
                                          LEDGER_CONTEXT_TYPE,
                                          RUN_CONTEXT_TYPE, TFX_RUN_CONTEXT_TYPE, Grant,
                                          LedgerRecords, WHOLE_GRANT, check_name, decode_vector,
                                          encode_vector,
                                          get_float, get_property)
from sage_tfx.sage_access.store import StoreSpec, connect
from sage_tfx.sage_access.transaction import Conflict


def grant_records(records: LedgerRecords, after: int = 0) -> list[dict]:
    """Every grant of the ledger (`kind` "grant"), oldest first, as recorded: time (ms since the
    epoch), grant id, pipeline, run id, blocks, epsilon, delta, and the split among DP steps,
    the dp-accounting event of each step (as JSON) and the RDP curve when the grant recorded
    them; its front door, request text, outcome and each step's record (grant_outcome).
    `execution_id` orders them; `after` reads only the grants whose execution_id is larger
    (grants are append-only, so a reader that keeps what it read extends it with these)."""
    executions = records.grant_executions(after)
    outcomes = records.outcomes({get_property(e, "grant_id") for e in executions})
    history = []
    for execution in executions:
        grant = records.grant_of(execution)
        steps = outcomes.get(grant.grant_id, {})
        history.append({
            "kind": "grant", "execution_id": execution.id,
            "time_ms": execution.create_time_since_epoch, "grant_id": grant.grant_id,
            "pipeline": grant.pipeline, "run_id": get_property(execution, "run_id"),
            "blocks": list(grant.blocks), "epsilon": grant.epsilon, "delta": grant.delta,
            # None when the grant recorded none (made before grants recorded them).
            "split": grant.split if get_property(execution, "split") else None,
            "events": grant.events if get_property(execution, "events") else None,
            "rdp_curve": list(grant.rdp_curve) if grant.rdp_curve else None,
            "front_door": get_property(execution, "front_door"),
            "request": get_property(execution, "request"),
            "outcome": grant_outcome(grant.split, steps, get_property(execution, "front_door")),
            "steps": steps})
    return history


def grant_outcome(split, steps: dict, front_door: Optional[str]) -> str:
    """A grant's outcome from its steps' records (release.Outcome's values): `failed` or
    `interrupted` if a step was, `released` once every step of the split released (`issued`
    for a bare grant handed to its caller), else
    `incomplete` (a step still running, or whose process was killed: its budget is spent all
    the same). A grant charged outside the release protocol (no front door recorded: made
    before release records existed, or by `BlockLedger.request` directly, as `sage-tfx ledger
    request` did) that has no step record is `unrecorded`: nothing will ever record one."""
    recorded = {record["outcome"] for record in steps.values()}
    for outcome in ("interrupted", "failed"):
        if outcome in recorded:
            return outcome
    if steps and set(steps) >= set(split or {WHOLE_GRANT: "1"}):
        return "issued" if recorded == {"issued"} else "released"
    return "incomplete" if steps or front_door else "unrecorded"


def denial_records(records: LedgerRecords, after: int = 0) -> list[dict]:
    """Every request refused for lack of budget (`kind` "denial", `outcome` "denied"), oldest
    first: time, front door, pipeline, request text, (epsilon, delta) asked for, what each block
    short of it had free, and why.
    `after`: only those whose execution_id is larger (denials are append-only, as grants)."""
    return [{"kind": "denial", "outcome": "denied", "execution_id": execution.id,
             "time_ms": execution.create_time_since_epoch,
             "front_door": get_property(execution, "front_door"),
             "pipeline": get_property(execution, "pipeline"),
             "request": get_property(execution, "request"),
             "epsilon": get_float(execution, "epsilon"), "delta": get_float(execution, "delta"),
             "free": json.loads(get_property(execution, "free", "{}")),
             "reason": get_property(execution, "reason")}
            for execution in records.denial_executions(after)]


@dataclass(frozen=True)
class Audit:
    """What `audit` found (`problems`, empty when the history agrees) and how many blocks and
    grants it read."""
    problems: list[str]
    blocks: int
    grants: int


def audit(records: LedgerRecords, accounting, blocks: list[BlockState]) -> Audit:
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
        demand = decode_vector(get_property(execution, "demand"))
        versioned = sorted(versions[i].split("/")[1] for i in outputs.get(execution.id, [])
                           if i in versions)
        if versioned != sorted(named):
            problems.append(f"grant {get_property(execution, 'grant_id')}: versioned blocks "
                            f"{versioned} but names {sorted(named)}")
        for block_id in named:
            charged.setdefault(block_id, []).append(demand)
    for block in blocks:
        history = charged.get(block.block_id, [])
        problems += balance_problems(block, sum(history, accounting.zero()), len(history),
                                     accounting)
    return Audit(problems, len(blocks), len(grants))


def balance_problems(block: BlockState, total: np.ndarray, charges: int,
                     accounting) -> list[str]:
    """Where `block`'s stored balance disagrees with `total` and `charges`, what the grants that
    charged it add up to (audit's per-block checks; `check_balances` runs them before every
    grant)."""
    problems = []
    # Equal, or within 1e-9: a ledger written before budgets were exact summed doubles.
    if not (np.array_equal(total, block.spent) or np.allclose(
            total.astype(float), block.spent.astype(float), rtol=1e-9, atol=0)):
        problems.append(f"block {block.block_id}: spent {encode_vector(block.spent)} but its "
                        f"grants sum to {encode_vector(total)}")
    if charges != block.charges:
        problems.append(f"block {block.block_id}: {block.charges} charges counted, "
                        f"{charges} grants name it")
    if not accounting.fits(accounting.zero(), block.spent, block.capacity):
        problems.append(f"block {block.block_id}: spent {encode_vector(block.spent)} is above "
                        "its ceiling")
    return problems


def recorded_balances(blocks: Sequence[BlockState]) -> str:
    """The `balances` property of a change that versions `blocks`: each block's spent and
    number of charges once the change is made, which `check_balances` compares the stored
    balance with (the running sum of the grants, carried from change to change)."""
    return json.dumps({block.block_id: [json.loads(encode_vector(block.spent)), block.charges]
                       for block in blocks})


def check_balances(records: LedgerRecords, accounting,
                   chosen: list[tuple[pb.Artifact, BlockState]], reader=None) -> None:
    """Before a grant charges the `chosen` blocks (artifact as read, decoded state): each stored
    balance must be what the grants recorded on it add up to, or the grant is refused
    (BalanceTampered, nothing charged). A balance is a materialised sum that anyone able to
    write the store can overwrite (set `spent` back to 0 and the block pays again); the
    ledger's own history is the record it must agree with.

    Bounded, whatever the history's length: every change of a block creates its next version
    record `<block>/v<n>` (transaction.py) and records on its execution the block's balance
    after it (`balances`: the previous one plus the grant's demand, computed by the writer that
    holds version n-1; a new block starts at zero). So the stored balance of version n must be
    the one recorded by the change that created `v<n>`, and `v<n+1>` must not exist: a balance
    rewritten alone disagrees with the record; one rolled back with its version (or a store
    restored from a partial backup) finds a later version, or none and then its history. `audit` checks the chain
    itself (each block's balance against the sum of all its grants). A block whose version
    record is not found by its external id (written before version records had one; or
    removed) or whose last change recorded no balance (written before changes did) is checked
    against its whole history, as `audit` does.

    A grant committed by another writer after `chosen` was read shows in the history but not in
    the balance read: if a block's version has moved since, the grant would conflict anyway
    (transaction.py), so this raises Conflict and the request re-reads. `reader`: where to read
    (default: the store; the grant's MySQL transaction, see Transactions.session)."""
    store = reader or records.store
    names = {}
    for artifact, block in chosen:
        version = get_property(artifact, "version")
        names[records.version_external_id(block.block_id, version)] = (block.block_id, "current")
        names[records.version_external_id(block.block_id, version + 1)] = (block.block_id, "next")
    creators, changes = _creations(records, list(names), store)
    found = {names[external_id]: creator for external_id, creator in creators.items()}
    problems, unrecorded = [], []
    # Each change's balances, parsed once (a grant's last change is often one for all its
    # blocks, recording them all).
    balances = {execution_id: json.loads(get_property(change, "balances", "{}"))
                for execution_id, change in changes.items()}
    for artifact, block in chosen:
        if (block.block_id, "next") in found:
            problems.append(f"block {block.block_id}: a later version than its stored one "
                            f"(v{get_property(artifact, 'version')}) exists")
            continue
        creator = found.get((block.block_id, "current"))
        change = changes.get(creator)
        recorded = None if change is None else balances[creator].get(block.block_id)
        if recorded is not None:
            total, charges = exact_vector(recorded[0]), recorded[1]
        elif change is not None and get_property(change, "kind") == "add_block":
            total, charges = accounting.zero(), 0
        else:  # a version recorded before versions had external ids and changes balances
            unrecorded.append((artifact, block))
            continue
        problems += balance_problems(block, total, charges, accounting)
    problems += _history_problems(records, accounting, unrecorded, store)
    if not problems:
        return
    versions = {artifact.id: get_property(artifact, "version") for artifact, _ in chosen}
    if any(get_property(artifact, "version") != versions[artifact.id]
           for artifact in store.get_artifacts_by_id(list(versions))):
        raise Conflict("a block changed while its balance was checked")
    raise BalanceTampered(
        f"ledger {records.context!r}: the stored balance of a block disagrees with the grants "
        f"recorded on it, so the store was written outside sage-tfx; nothing was charged. "
        f"{'; '.join(problems)}. Run `sage-tfx ledger audit` and restore the store from a "
        "trusted copy")


# What check_balances reads of each change that created a block's version.
_CHANGE_KEYS = ("balances", "kind")


def balance_check_reads(records: LedgerRecords) -> VersionRecords:
    """What `check_balances` reads about the blocks it checks (the records of each block's
    current and next version, their creators, those creators' `_CHANGE_KEYS`), for a MySQL
    transaction to read in the round trip that locks the blocks (records.block_artifacts):
    a grant's reads are then one round trip. The names are records.version_external_id's."""
    return VersionRecords(prefix=records.version_prefix, key="block_id", infix="/v",
                          steps=(0, 1), properties=_CHANGE_KEYS)


def _creations(records: LedgerRecords, external_ids: list[str], store) -> tuple[dict, dict]:
    """({external id: the id of the execution that created the artifact (its OUTPUT event), or
    None} of the artifacts found with these external ids, {execution id: that execution}), read
    from `store`: in one round trip from a MySQL transaction (mysql_commit.Transaction, which
    reads of each execution only the properties read here), in three MLMD calls elsewhere."""
    if hasattr(store, "get_creations_by_external_ids"):
        return store.get_creations_by_external_ids(external_ids, _CHANGE_KEYS)
    artifacts = records.by_external_ids(external_ids, store)
    creators = {event.artifact_id: event.execution_id
                for event in store.get_events_by_artifact_ids([a.id for a in artifacts])
                if event.type == pb.Event.OUTPUT} if artifacts else {}
    found = {artifact.external_id: creators.get(artifact.id) for artifact in artifacts}
    creating = sorted({creator for creator in found.values() if creator is not None})
    return found, {execution.id: execution
                   for execution in store.get_executions_by_id(creating)} if creating else {}


def _history_problems(records: LedgerRecords, accounting,
                      chosen: list[tuple[pb.Artifact, BlockState]], store) -> list[str]:
    """`balance_problems` of the `chosen` blocks against their whole history (the Grant
    executions that took each as an INPUT), read from `store`: for blocks whose last change
    recorded no balance."""
    if not chosen:
        return []
    by_id = {artifact.id: block for artifact, block in chosen}
    # A grant takes each block it charges as an INPUT (ledger.request); so does a finished
    # pipeline's release of its reservations (an update, not a grant: skipped).
    charging = [event for event in store.get_events_by_artifact_ids(list(by_id))
                if event.type == pb.Event.INPUT]
    grants = {execution.id: execution for execution in store.get_executions_by_id(
        sorted({event.execution_id for event in charging})) if charging
        and execution.type_id == records.types[GRANT_TYPE]}
    history: dict[int, list[np.ndarray]] = {artifact_id: [] for artifact_id in by_id}
    for event in charging:
        if event.execution_id in grants:
            history[event.artifact_id].append(
                decode_vector(get_property(grants[event.execution_id], "demand")))
    return [problem for artifact_id, block in by_id.items()
            for problem in balance_problems(block, sum(history[artifact_id], accounting.zero()),
                                            len(history[artifact_id]), accounting)]


def latest_change(records: LedgerRecords) -> int:
    """The id of the newest execution recorded in the ledger context (a grant, a new block, a
    pipeline registered or finished, ...): every change of a balance is one, so a reader whose
    value did not move has nothing new to read. 0 for a ledger without any."""
    newest = records.store.get_executions_by_context(
        records.context_node.id, list_options=metadata_store.ListOptions(
            limit=1, order_by=metadata_store.OrderByField.ID, is_asc=False))
    return newest[0].id if newest else 0


def changes(records: LedgerRecords, after: int = 0) -> list[dict]:
    """The changes recorded in the ledger context after execution id `after`, oldest first:
    {"execution_id", "kind", "blocks", "pipeline", "grant_id"}. `kind` is "grant", "add_block",
    "register_pipeline", "finish_pipeline", "grant_data", "use_share", "release_outcome",
    "denial" or "init"; `blocks` names the blocks whose balance it changed ([] for none, None for
    any: finishing a pipeline returns its reservations on every block holding one); `grant_id`
    the grant a grant or a release outcome is about (else None)."""
    executions = records.store.get_executions_by_context(
        records.context_node.id, list_options=metadata_store.ListOptions(
            order_by=metadata_store.OrderByField.ID, is_asc=True,
            filter_query=f"id > {int(after)}"))
    found = []
    for execution in executions:
        if execution.type_id == records.types[GRANT_TYPE]:
            kind, blocks = "grant", json.loads(get_property(execution, "blocks"))
        else:
            kind = get_property(execution, "kind")
            blocks = {"add_block": _added_blocks(execution), "finish_pipeline": None}.get(kind, [])
        found.append({"execution_id": execution.id, "kind": kind, "blocks": blocks,
                      "pipeline": get_property(execution, "pipeline"),
                      "grant_id": get_property(execution, "grant_id")})
    return found


def _added_blocks(execution: pb.Execution) -> list[str]:
    """The blocks an add_block change registered (one `block_id` in stores written before
    blocks were added together)."""
    ids = get_property(execution, "block_ids")
    return json.loads(ids) if ids is not None else [get_property(execution, "block_id")]


def grant_run(records: LedgerRecords, grant: Grant) -> dict:
    """The pipeline run that spent `grant` and what it produced: the run contexts the grant is
    attributed to (TFX's `pipeline_run`, Kubeflow's run, or the ledger's own
    `sage_tfx.PipelineRun`) and every artifact of those runs but the ledger's own records (type,
    name, uri, state, time), oldest first. A grant without a run has none."""
    store = records.store
    runs = [c for c in store.get_contexts_by_execution(grant.execution_id)
            if c.id != records.context_node.id]
    # The grant's own records (blocks, versions, data) are attributed to the run too.
    ledger_types = set(records.types.values())
    artifacts = sorted({artifact.id: artifact for run in runs
                        for artifact in store.get_artifacts_by_context(run.id)
                        if artifact.type_id not in ledger_types}.values(),
                       key=lambda artifact: artifact.id)
    type_names = {t.id: t.name for t in store.get_context_types_by_id(
        sorted({c.type_id for c in runs}))} if runs else {}
    if artifacts:
        type_names.update((t.id, t.name) for t in store.get_artifact_types_by_id(
            sorted({a.type_id for a in artifacts})))
    return {"grant_id": grant.grant_id, "pipeline": grant.pipeline,
            "runs": [{"type": type_names[c.type_id], "name": c.name} for c in runs],
            "artifacts": [{"id": a.id, "type": type_names[a.type_id], "name": a.name,
                           "uri": a.uri, "state": pb.Artifact.State.Name(a.state),
                           "time_ms": a.create_time_since_epoch}
                          for a in artifacts]}


def run_contexts(store: metadata_store.MetadataStore, run_id: Optional[str]) -> list[pb.Context]:
    """The context a charge for pipeline run `run_id` is attributed to: the run's own context
    when the store holds it (TFX's `pipeline_run`, or Kubeflow Pipelines' `system.PipelineRun`
    on a cluster whose metadata service is the ledger's store), else a `sage_tfx.PipelineRun`."""
    if run_id is None:
        return []
    check_name(run_id, "run id")
    for run_type in (TFX_RUN_CONTEXT_TYPE, KFP_RUN_CONTEXT_TYPE):
        try:
            run = store.get_context_by_type_and_name(run_type, run_id)
        except mlmd_errors.NotFoundError:
            run = None
        if run is not None:
            return [run]
    return [pb.Context(type_id=store.get_context_type(RUN_CONTEXT_TYPE).id, name=run_id)]


def ledger_contexts(store: StoreSpec) -> list[str]:
    """The names of the ledger contexts in `store` (read only)."""
    mlmd = connect(store)
    return [c.name for c in mlmd.get_contexts_by_type(LEDGER_CONTEXT_TYPE)]
