"""The BlockLedger: Sage Access Control (§3.2) persisted in ML Metadata.

Records in MLMD (custom properties only, so Kubeflow V2 accepts the types):

* `sage_tfx.Ledger` context, one per ledger context (Sage §3.2: independent ledgers for contexts
  assumed not to collude). Everything below is attributed to it.
* `sage_tfx.LedgerState` artifact: accounting mode, minimum request, waiting pipelines, version.
* `sage_tfx.Block` artifact per block: ceilings and the *materialised* balance (spent, reservations,
  retired, version), so reading a balance never scans the charge history.
* `sage_tfx.BlockVersion` artifact per change of a block (registration, charge, release), named
  `<context>/<block>/v<version>`: the append-only history. A charge's record is linked to the
  `sage_tfx.Grant` execution that spent it, and that execution to the pipeline run's context.
  The Grant execution is the source of truth about a grant: blocks, budget, its exact split among
  the iteration's DP steps and the dp-accounting event each step will run.
* `sage_tfx.GrantData` artifact per data location a grant released (the granted Examples, then
  what components derived from them), named `<context>/grant-<id>/data/<digest of the uri>`:
  components accept Examples only at a location their grant released.
* `sage_tfx.ShareUse` artifact per consumed share, named `<context>/grant-<id>/share/<step>`: the
  unique name makes a second consumer of the same share fail (see below), so one grant feeds
  one trainer and one validator, whatever DAG or Importer asks later.

Concurrency and crashes. ML Metadata has no multi-call transactions, and read-modify-write of a
property loses updates (STACK.md). Every ledger change is therefore a single `put_execution` call,
which MLMD commits atomically, and which creates a record with a *unique name* for every state it
replaces: the next `BlockVersion` of each block it charges (and the next `LedgerVersion` for
changes of the ledger state). Two writers that read the same version both try to create the same
name; MLMD rejects the second call as a whole (AlreadyExistsError, rolled back), and the loser
re-reads and re-checks. This is optimistic concurrency control with the name as compare-and-swap:
no lost update, and a process killed at any point leaves each grant whole or absent.
"""
from __future__ import annotations

import json
import random
import re
import time
import uuid
import hashlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Sequence, TypeVar

import numpy as np
from ml_metadata import errors as mlmd_errors
from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access import allocation
from sage_tfx.sage_access.accounting import (BudgetRequest, accounting_for, event_from_json,
                                             event_to_json, exact_fraction, rdp_curve_of,
                                             split_share)
from sage_tfx.sage_access.allocation import BlockState
from sage_tfx.sage_access.errors import BadRequest, BudgetExhausted, LedgerBusy
from sage_tfx.sage_access.store import STATE_TYPE, StoreSpec, connect, connect_read_only

LEDGER_CONTEXT_TYPE = "sage_tfx.Ledger"
RUN_CONTEXT_TYPE = "sage_tfx.PipelineRun"
TFX_RUN_CONTEXT_TYPE = "pipeline_run"  # the context TFX's orchestrators create per run
LEDGER_VERSION_TYPE = "sage_tfx.LedgerVersion"
BLOCK_TYPE = "sage_tfx.Block"
BLOCK_VERSION_TYPE = "sage_tfx.BlockVersion"
GRANT_TYPE = "sage_tfx.Grant"
GRANT_DATA_TYPE = "sage_tfx.GrantData"
SHARE_USE_TYPE = "sage_tfx.ShareUse"
UPDATE_TYPE = "sage_tfx.LedgerUpdate"

_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}$")
_MAX_ATTEMPTS = 400
_MAX_WAIT_SECONDS = 60.0

T = TypeVar("T")


@dataclass(frozen=True)
class BlockIds:
    """Select these blocks, by id."""
    ids: tuple[str, ...]

    def __init__(self, ids: Iterable[str]):
        object.__setattr__(self, "ids", tuple(ids))


@dataclass(frozen=True)
class RecentWindow:
    """Select the most recent `size` live blocks (by arrival) that can still pay the request."""
    size: int


@dataclass(frozen=True)
class Grant:
    """What the ledger granted: the blocks charged and the budget, in the ledger's relation."""
    grant_id: str
    context: str
    blocks: tuple[str, ...]
    epsilon: Optional[float]
    delta: Optional[float]
    rdp_curve: Optional[tuple[float, ...]]
    pipeline: Optional[str]
    execution_id: int
    # {step: exact decimal fraction} and {step: dp-accounting event as JSON}, when given.
    split: Mapping[str, str] = field(default_factory=dict)
    events: Mapping[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"granted": True, "grant_id": self.grant_id, "context": self.context,
                "blocks": list(self.blocks), "epsilon": self.epsilon, "delta": self.delta,
                "rdp_curve": list(self.rdp_curve) if self.rdp_curve else None,
                "pipeline": self.pipeline, "split": dict(self.split),
                "events": dict(self.events)}

    def share(self, step: str) -> tuple[float, float]:
        """(epsilon, delta) the grant allots to `step`: the exact fraction of the grant's budget,
        rounded down, so the shares never sum to more than the grant."""
        if step not in self.split:
            raise BadRequest(f"grant {self.grant_id} has no share for step {step!r}; its split "
                             f"is {dict(self.split)}")
        if self.epsilon is None:
            raise BadRequest(f"grant {self.grant_id} is an RDP curve; it has no (epsilon, delta) "
                             "shares")
        return split_share(self.epsilon, self.delta or 0.0, self.split, step)


class _Conflict(Exception):
    """Another writer committed first; re-read and retry."""


def _is_lock_error(error: Exception) -> bool:
    # SQLite reports a concurrent writer as a busy/locked database.
    text = str(error).lower()
    return "locked" in text or "busy" in text


def _check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME_PATTERN.match(value):
        raise BadRequest(f"{what} {value!r} must be 1-128 characters of letters, digits and ._:+- "
                         "(starting with a letter or digit)")
    return value


def _props(node, values: dict) -> None:
    for key, value in values.items():
        if value is None:
            continue
        target = node.custom_properties[key]
        if isinstance(value, bool):
            target.int_value = int(value)
        elif isinstance(value, int):
            target.int_value = value
        elif isinstance(value, float):
            # ML Metadata 1.17's SQLite backend keeps only 6 decimal places of a double_value
            # (1e-7 reads back as 0), so budgets are stored as exact decimal strings.
            target.string_value = repr(value)
        else:
            target.string_value = str(value)


def _get(node, key: str, default=None):
    if key not in node.custom_properties:
        return default
    value = node.custom_properties[key]
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else default


def _get_float(node, key: str) -> Optional[float]:
    value = _get(node, key)
    return None if value is None else float(value)


def _vector(values: np.ndarray) -> str:
    return json.dumps([float(v) for v in values])


class BlockLedger:
    """Per-block privacy budgets of one ledger context, persisted in ML Metadata."""

    def __init__(self, store: StoreSpec, context: str = "default", read_only: bool = False):
        """`read_only`: `store` is a string (path or grpc://), checked to be a sage-tfx ledger
        store and opened without writing (see store.connect_read_only); the ledger's reading
        methods work, its writing methods fail."""
        self._store = connect_read_only(store) if read_only else connect(store)
        self.store_spec = store
        self.context = _check_name(context, "ledger context")
        self._register_types(lookup_only=read_only)
        self._context_node = self._store.get_context_by_type_and_name(LEDGER_CONTEXT_TYPE, context)
        if self._context_node is None:
            raise BadRequest(f"no ledger context {context!r} in this store; run `init` first")
        state = self._read_state()
        self.accounting = accounting_for(_get(state, "accounting"))
        self.min_request_epsilon = _get_float(state, "min_request_epsilon")
        self._min_demand = self.accounting.demand(
            BudgetRequest(epsilon=self.min_request_epsilon, delta=0.0))

    # ----------------------------------------------------------------- creation
    @classmethod
    def create(cls, store: StoreSpec, context: str = "default", accounting: str = "basic",
               min_request_epsilon: float = 0.01) -> "BlockLedger":
        """Create a ledger context; BadRequest if it exists already."""
        _check_name(context, "ledger context")
        mode = accounting_for(accounting)
        BudgetRequest(epsilon=min_request_epsilon, delta=0.0)  # validates the number
        mlmd = connect(store)
        _register_types(mlmd)
        state = pb.Artifact(type_id=mlmd.get_artifact_type(STATE_TYPE).id,
                            name=f"{context}/state", external_id=f"state:{context}")
        _props(state, {"ledger": context, "accounting": mode.name,
                       "orders": json.dumps(list(mode.orders)),
                       "min_request_epsilon": float(min_request_epsilon),
                       "waiting": "[]", "version": 1})
        ledger_context = pb.Context(type_id=mlmd.get_context_type(LEDGER_CONTEXT_TYPE).id,
                                    name=context)
        execution = pb.Execution(type_id=mlmd.get_execution_type(UPDATE_TYPE).id,
                                 last_known_state=pb.Execution.COMPLETE)
        _props(execution, {"kind": "init", "ledger": context})
        try:
            mlmd.put_execution(execution, [(state, _event(pb.Event.OUTPUT))], [ledger_context])
        except mlmd_errors.AlreadyExistsError:
            raise BadRequest(f"ledger context {context!r} already exists in this store") from None
        ledger = cls(mlmd, context)
        ledger.store_spec = store
        return ledger

    def _register_types(self, lookup_only: bool = False) -> None:
        if not lookup_only:
            _register_types(self._store)
        self._types = {
            name: self._store.get_artifact_type(name).id
            for name in (STATE_TYPE, LEDGER_VERSION_TYPE, BLOCK_TYPE, BLOCK_VERSION_TYPE)}
        # Types a store made before grant binding lacks: a reader needs no id for them (it finds
        # none of their records), and a writer registered them above.
        for name in (GRANT_DATA_TYPE, SHARE_USE_TYPE):
            try:
                self._types[name] = self._store.get_artifact_type(name).id
            except mlmd_errors.NotFoundError:
                if not lookup_only:
                    raise
        self._types[GRANT_TYPE] = self._store.get_execution_type(GRANT_TYPE).id
        self._types[UPDATE_TYPE] = self._store.get_execution_type(UPDATE_TYPE).id

    # ----------------------------------------------------------------- reading
    @property
    def orders(self) -> tuple[float, ...]:
        """RDP orders on which grants give their curves."""
        return self.accounting.orders

    def _read_state(self) -> pb.Artifact:
        found = self._by_external_ids([f"state:{self.context}"])
        if not found:
            raise BadRequest(f"ledger context {self.context!r} has no state record")
        return found[0]

    def _by_external_ids(self, external_ids: list[str]) -> list[pb.Artifact]:
        try:
            return self._store.get_artifacts_by_external_ids(external_ids)
        except mlmd_errors.NotFoundError:  # MLMD raises instead of returning nothing
            return []

    def waiting_pipelines(self) -> list[str]:
        return json.loads(_get(self._read_state(), "waiting"))

    def _to_state(self, artifact: pb.Artifact) -> BlockState:
        epsilon_g = _get_float(artifact, "epsilon_ceiling")
        delta_g = _get_float(artifact, "delta_ceiling")
        return BlockState(
            block_id=_get(artifact, "block_id"), epsilon_ceiling=epsilon_g, delta_ceiling=delta_g,
            capacity=self.accounting.capacity(epsilon_g, delta_g),
            spent=np.array(json.loads(_get(artifact, "spent"))),
            reservations={k: np.array(v) for k, v in json.loads(_get(artifact, "reservations")).items()},
            retired=bool(_get(artifact, "retired")), charges=_get(artifact, "charges"),
            start=_get(artifact, "start"), end=_get(artifact, "end"),
            data_uri=_get(artifact, "data_uri"))

    def _write_state(self, artifact: pb.Artifact, block: BlockState) -> pb.Artifact:
        updated = pb.Artifact()
        updated.CopyFrom(artifact)
        epsilon_spent, delta_spent = self.accounting.guarantee(
            block.spent, block.epsilon_ceiling, block.delta_ceiling)
        _props(updated, {
            "spent": _vector(block.spent),
            "reservations": json.dumps({k: [float(x) for x in v]
                                        for k, v in block.reservations.items()}),
            "retired": block.retired, "charges": block.charges,
            # basic: the sums spent; rdp: the filter's guarantee (never an odometer reading).
            "guarantee_epsilon": epsilon_spent, "guarantee_delta": delta_spent,
            "version": _get(artifact, "version") + 1})
        return updated

    def _block_artifacts(self, block_ids: Sequence[str]) -> list[pb.Artifact]:
        external = [f"block:{self.context}/{b}" for b in block_ids]
        found = {_get(a, "block_id"): a for a in self._by_external_ids(external)}
        unknown = [b for b in block_ids if b not in found]
        if unknown:
            raise BadRequest(f"unknown block(s) in ledger {self.context!r}: {', '.join(unknown)}")
        return [found[b] for b in block_ids]

    def _live_blocks_newest_first(self, page: int) -> Iterable[pb.Artifact]:
        """Non-retired blocks, most recent arrival first, read page by page."""
        last_id = None
        while True:
            query = (f"type = '{BLOCK_TYPE}' AND custom_properties.ledger.string_value = "
                     f"'{self.context}' AND custom_properties.retired.int_value = 0")
            if last_id is not None:
                query += f" AND id < {last_id}"
            batch = self._store.get_artifacts(list_options=metadata_store.ListOptions(
                limit=page, order_by=metadata_store.OrderByField.ID, is_asc=False,
                filter_query=query))
            yield from batch
            if len(batch) < page:
                return
            last_id = batch[-1].id

    def block(self, block_id: str) -> BlockState:
        return self._to_state(self._block_artifacts([block_id])[0])

    def blocks(self, ids: Optional[Sequence[str]] = None) -> list[BlockState]:
        """Every block of this ledger, in arrival order (retired ones included); with `ids`, those
        blocks, in that order (BadRequest naming any this ledger does not have)."""
        if ids is not None:
            return [self._to_state(a) for a in self._block_artifacts(ids)] if ids else []
        return [self._to_state(a) for a in self._of_this_ledger(
            self._store.get_artifacts_by_type(BLOCK_TYPE))]

    def _of_this_ledger(self, nodes: list) -> list:
        """Those of `nodes` (all of one type) recorded for this ledger context, by id. Reading a
        whole type and keeping ours is several times faster in ML Metadata than a filter query
        on a custom property, which it pages 100 rows at a time (3x-4x at 10,000 blocks or
        20,000 grants)."""
        return sorted((node for node in nodes if _get(node, "ledger") == self.context),
                      key=lambda node: node.id)

    def live_blocks(self, page: int = 256) -> list[BlockState]:
        """Blocks not yet retired, most recent arrival first (what a window can draw on)."""
        return [self._to_state(a) for a in self._live_blocks_newest_first(page)]

    def payable_window(self, epsilon: float, delta: float, pipeline: Optional[str] = None,
                       size: Optional[int] = None, split: Optional[Mapping[str, str]] = None,
                       events: Optional[Mapping[str, object]] = None,
                       blocks: Optional[Sequence[BlockState]] = None) -> list[BlockState]:
        """The blocks a RecentWindow(size) request of (epsilon, delta) with this split and these
        events (see `request`) would take now, most recent first (all that can pay, without
        `size`), among `blocks` (default: the live blocks, read now). Planning only: nothing is
        charged, and a concurrent grant may change the answer before a request is made."""
        budget = BudgetRequest(epsilon=epsilon, delta=delta)
        demand = self._demand(budget, check_split(split) if split is not None else {},
                              dict(events or {}))
        payable = [block for block in (self.live_blocks() if blocks is None else blocks)
                   if allocation.can_pay(block, demand, pipeline, self.accounting)]
        return payable if size is None else payable[:size]

    def remaining(self, block: BlockState, pipeline: Optional[str] = None) -> str:
        """A readable account of what a block has left (for errors and the CLI): its guarantee,
        what `pipeline` may still draw and what is reserved for the other waiting pipelines
        (rdp: as shares of the filter's capacity at the order with the most room for it)."""
        epsilon_g, delta_g = self.accounting.guarantee(
            block.spent, block.epsilon_ceiling, block.delta_ceiling)
        view = budget_view(self.accounting, block, pipeline)
        who = pipeline or "unallocated grants"
        others = {name: value for name, value in view["reserved"].items()
                  if name != pipeline and value > 0}
        if self.accounting.name == "rdp":
            # The filter certifies its ceiling; its capacity at one order tells what is left.
            percent = lambda value: f"{value:.1%}"  # noqa: E731
            text = (f"filter guarantee ({epsilon_g:.6g}, {delta_g:.3g}) of ceiling "
                    f"({block.epsilon_ceiling:.6g}, {block.delta_ceiling:.3g}); at RDP order "
                    f"{view['order']:g} (most room for {who}): spent {percent(view['spent'])}, "
                    f"available to {who} {percent(view['available'])}")
        else:
            percent = lambda value: f"{value:.6g}"  # noqa: E731
            free = allocation.available_to(block, pipeline)
            text = (f"spent ({epsilon_g:.6g}, {delta_g:.3g}) of ceiling "
                    f"({block.epsilon_ceiling:.6g}, {block.delta_ceiling:.3g}), available to "
                    f"{who}: ({free[0]:.6g}, {free[1]:.3g})")
        text += ", reserved for other pipelines: " + (", ".join(
            f"{name} {percent(value)}" for name, value in others.items()) or "none")
        if block.retired:
            text += ", retired"
        return text

    # ----------------------------------------------------------------- writing
    def _commit(self, kind: str, execution_props: dict,
                artifact_and_events: list[tuple[pb.Artifact, pb.Event]],
                extra_contexts: Sequence[pb.Context] = (), name: Optional[str] = None) -> int:
        execution = pb.Execution(type_id=self._types[kind], last_known_state=pb.Execution.COMPLETE,
                                 name=name)
        _props(execution, dict(execution_props, ledger=self.context))
        try:
            execution_id, _, _ = self._store.put_execution(
                execution, artifact_and_events, [self._context_node, *extra_contexts],
                reuse_context_if_already_exist=True)
        except mlmd_errors.AlreadyExistsError as error:
            raise _Conflict(str(error)) from None
        return execution_id

    def _retrying(self, attempt: Callable[[], T]) -> T:
        """Run read-check-commit until it commits without a conflicting writer."""
        deadline = time.monotonic() + _MAX_WAIT_SECONDS
        for tries in range(_MAX_ATTEMPTS):
            try:
                return attempt()
            except _Conflict:
                pass
            except mlmd_errors.StatusError as error:
                if not _is_lock_error(error):
                    raise
            if time.monotonic() > deadline:
                break
            time.sleep(random.uniform(0, min(0.05, 0.001 * 2 ** min(tries, 6))))
        raise LedgerBusy(f"ledger {self.context!r}: gave up after repeated conflicts with "
                         "concurrent writers; nothing was charged")

    def _version_record(self, block: str, version: int) -> pb.Artifact:
        """The unique-named record of a block's next version: the compare-and-swap token.

        Deliberately without properties (each costs a row per write on the grant path); what
        changed is on the execution that created it (a Grant's blocks and demand, or an update's
        kind), linked by an OUTPUT event.
        """
        return pb.Artifact(type_id=self._types[BLOCK_VERSION_TYPE],
                           name=f"{self.context}/{block}/v{version}")

    def _ledger_version(self, state: pb.Artifact, kind: str, **changes) -> list:
        """The updated LedgerState plus its unique version record (the compare-and-swap)."""
        version = _get(state, "version") + 1
        updated = pb.Artifact()
        updated.CopyFrom(state)
        _props(updated, dict(changes, version=version))
        record = pb.Artifact(type_id=self._types[LEDGER_VERSION_TYPE],
                             name=f"{self.context}/ledger/v{version}")
        _props(record, {"ledger": self.context, "kind": kind, "version": version})
        return [(updated, _event(pb.Event.OUTPUT)), (record, _event(pb.Event.OUTPUT))]

    def add_block(self, block_id: str, epsilon: float, delta: float,
                  start: Optional[str] = None, end: Optional[str] = None,
                  data_uri: Optional[str] = None) -> BlockState:
        """Register a new block with ceiling (epsilon, delta); its budget is split evenly among the
        pipelines waiting now and reserved for them (Sage §3.3), the longest-waiting first when
        there are too many for every share to pay the minimum request (allocation.py).
        `data_uri` is where the block's Examples live (BlockExampleGen sets it; the BlockLedger
        component reads it)."""
        _check_name(block_id, "block id")
        capacity = self.accounting.capacity(epsilon, delta)
        for value, what in ((start, "start"), (end, "end")):
            if value is not None and not isinstance(value, str):
                raise BadRequest(f"block {what} must be an ISO string, got {value!r}")

        def attempt() -> BlockState:
            state = self._read_state()
            waiting = json.loads(_get(state, "waiting"))
            block = allocation.new_block(block_id, float(epsilon), float(delta), capacity,
                                         self.accounting.zero(), waiting, self._min_demand,
                                         self.accounting, start, end, data_uri)
            artifact = pb.Artifact(type_id=self._types[BLOCK_TYPE], name=f"{self.context}/{block_id}",
                                   external_id=f"block:{self.context}/{block_id}")
            _props(artifact, {"ledger": self.context, "block_id": block_id, "start": start,
                              "end": end, "data_uri": data_uri, "epsilon_ceiling": float(epsilon),
                              "delta_ceiling": float(delta), "version": 0})
            artifact = self._write_state(artifact, block)
            record = self._version_record(block_id, 1)
            try:
                self._commit(UPDATE_TYPE, {"kind": "add_block", "block_id": block_id},
                             [(artifact, _event(pb.Event.OUTPUT)), (record, _event(pb.Event.OUTPUT)),
                              *self._ledger_version(state, "add_block")])
            except _Conflict:
                if self._by_external_ids([f"block:{self.context}/{block_id}"]):
                    raise BadRequest(f"block {block_id!r} already exists in ledger "
                                     f"{self.context!r}") from None
                raise
            return block

        return self._retrying(attempt)

    def register_pipeline(self, pipeline: str) -> None:
        """Mark a pipeline as waiting: blocks arriving from now on reserve a share for it."""
        _check_name(pipeline, "pipeline")

        def attempt() -> None:
            state = self._read_state()
            waiting = json.loads(_get(state, "waiting"))
            if pipeline in waiting:
                return
            self._commit(UPDATE_TYPE, {"kind": "register_pipeline", "pipeline": pipeline},
                         self._ledger_version(state, "register_pipeline",
                                              waiting=json.dumps(waiting + [pipeline])))

        self._retrying(attempt)

    def finish_pipeline(self, pipeline: str) -> None:
        """The pipeline was accepted or abandoned: its unused reservations return and are re-split
        evenly among the pipelines still waiting."""
        _check_name(pipeline, "pipeline")

        def attempt() -> None:
            state = self._read_state()
            waiting = json.loads(_get(state, "waiting"))
            if pipeline not in waiting:
                raise BadRequest(f"pipeline {pipeline!r} is not waiting in ledger {self.context!r}")
            still_waiting = [p for p in waiting if p != pipeline]
            changes = self._ledger_version(state, "finish_pipeline",
                                           waiting=json.dumps(still_waiting))
            for artifact in self._live_blocks_newest_first(page=500):
                block = self._to_state(artifact)
                if pipeline not in block.reservations:
                    continue
                released = allocation.release(block, pipeline, still_waiting)
                version = _get(artifact, "version") + 1
                changes.append((self._write_state(artifact, released), _event(pb.Event.INPUT)))
                changes.append((self._version_record(block.block_id, version),
                                _event(pb.Event.OUTPUT)))
            self._commit(UPDATE_TYPE, {"kind": "finish_pipeline", "pipeline": pipeline}, changes)

        self._retrying(attempt)

    def request(self, selector: BlockIds | RecentWindow, epsilon: Optional[float] = None,
                delta: Optional[float] = None, rdp_curve: Optional[Sequence[float]] = None,
                pipeline: Optional[str] = None, run_id: Optional[str] = None,
                split: Optional[Mapping[str, str]] = None,
                events: Optional[Mapping[str, object]] = None,
                data_uri: Optional[str] = None) -> Grant:
        """Grant (epsilon, delta) or an RDP curve on the selected blocks, all or nothing.

        `split` ({step: fraction}, exact, summing to at most 1) divides the grant among the
        iteration's DP steps and `events` ({step: dp-accounting DpEvent}) says what each step
        will run; both are recorded on the grant. On an `rdp` ledger an (epsilon, delta) grant
        needs `events` for every step of the split: it charges the RDP curve of their
        composition, and (epsilon, delta) is the target the steps were calibrated to. A `basic`
        ledger charges (epsilon, delta). `data_uri` is where the granted Examples will be
        written (recorded as the grant's data; see `require_data`).

        Raises BadRequest for malformed input (nothing charged) and BudgetExhausted when the
        blocks cannot pay (nothing charged; the error names each block and what it has left).
        `run_id` links the charge to the pipeline run that spends it (TFX's `pipeline_run`
        context of that name when it is in the same store).
        """
        budget = BudgetRequest(epsilon=epsilon, delta=delta,
                               rdp_curve=tuple(rdp_curve) if rdp_curve is not None else None)
        split = check_split(split) if split is not None else {}
        events = dict(events or {})
        demand = self._demand(budget, split, events)
        recorded_events = {step: event_to_json(event) for step, event in events.items()}
        if pipeline is not None:
            _check_name(pipeline, "pipeline")
        if isinstance(selector, BlockIds):
            if not selector.ids:
                raise BadRequest("the block selector is empty")
            for block_id in selector.ids:
                _check_name(block_id, "block id")
            if len(set(selector.ids)) != len(selector.ids):
                raise BadRequest(f"the block selector names a block twice: {list(selector.ids)}")
        elif isinstance(selector, RecentWindow):
            if not isinstance(selector.size, int) or selector.size < 1:
                raise BadRequest(f"window size must be a positive integer, got {selector.size!r}")
        else:
            raise BadRequest(f"unknown selector {selector!r}")
        run_contexts = self._run_contexts(run_id)

        def attempt() -> Grant:
            chosen = self._choose(selector, demand, pipeline)
            grant_id = uuid.uuid4().hex
            changes = []
            for artifact, block in chosen:
                version = _get(artifact, "version") + 1
                charged = allocation.charge(block, demand, pipeline, self.accounting,
                                            self._min_demand)
                changes.append((self._write_state(artifact, charged), _event(pb.Event.INPUT)))
                changes.append((self._version_record(block.block_id, version),
                                _event(pb.Event.OUTPUT)))
            block_ids = tuple(block.block_id for _, block in chosen)
            if budget.epsilon is not None:
                granted_epsilon = budget.epsilon
            else:  # an RDP curve: basic accounting charged its (epsilon, delta) conversion
                granted_epsilon = float(demand[0]) if self.accounting.name == "basic" else None
            if data_uri is not None:
                changes.append((self._data_record(grant_id, data_uri, "BlockLedger"),
                                _event(pb.Event.OUTPUT)))
            execution_id = self._commit(GRANT_TYPE, {
                "grant_id": grant_id, "pipeline": pipeline, "run_id": run_id,
                "blocks": json.dumps(list(block_ids)), "demand": _vector(demand),
                "epsilon": granted_epsilon,
                "delta": budget.delta, "rdp_curve": json.dumps(list(budget.rdp_curve))
                if budget.rdp_curve else None, "split": json.dumps(split),
                "events": json.dumps(recorded_events)}, changes, run_contexts,
                name=f"grant-{grant_id}")
            return Grant(grant_id=grant_id, context=self.context, blocks=block_ids,
                         epsilon=granted_epsilon, delta=budget.delta, rdp_curve=budget.rdp_curve,
                         pipeline=pipeline, execution_id=execution_id, split=split,
                         events=recorded_events)

        return self._retrying(attempt)

    def _demand(self, budget: BudgetRequest, split: Mapping[str, str],
                events: Mapping[str, object]) -> np.ndarray:
        """What a grant charges: on an rdp ledger, an (epsilon, delta > 0) grant charges the RDP
        curve of its steps' events; otherwise the accounting's demand for the budget."""
        if set(events) - set(split):
            raise BadRequest(f"events for step(s) {sorted(set(events) - set(split))} that the "
                             f"split {split} does not name")
        if self.accounting.name == "rdp" and budget.rdp_curve is None and budget.delta > 0:
            missing = sorted(set(split) - set(events))
            if not split or missing:
                raise BadRequest(
                    "an rdp ledger charges the RDP curve of what the steps run: give the DP "
                    f"event of every step of the split (missing: {missing or 'a split'})")
            return self.accounting.demand(BudgetRequest(
                rdp_curve=tuple(rdp_curve_of(list(events.values()), self.orders)),
                delta=budget.delta))
        return self.accounting.demand(budget)

    def _choose(self, selector, demand: np.ndarray,
                pipeline: Optional[str]) -> list[tuple[pb.Artifact, BlockState]]:
        """The selected blocks (artifact and decoded state) that can all pay, or an error."""
        if isinstance(selector, BlockIds):
            chosen = [(a, self._to_state(a)) for a in self._block_artifacts(selector.ids)]
            retired = [block.block_id for _, block in chosen if block.retired]
            if retired:
                raise BadRequest(f"retired block(s) in ledger {self.context!r} are never offered "
                                 f"again: {', '.join(retired)}")
            short = {block.block_id: self.remaining(block, pipeline) for _, block in chosen
                     if not allocation.can_pay(block, demand, pipeline, self.accounting)}
            if short:
                raise BudgetExhausted(
                    f"denied: {len(short)} of {len(chosen)} block(s) cannot pay the request; "
                    + "; ".join(f"{b}: {text}" for b, text in short.items()), short)
            return chosen
        chosen = []
        for artifact in self._live_blocks_newest_first(page=max(2 * selector.size, 64)):
            block = self._to_state(artifact)
            if allocation.can_pay(block, demand, pipeline, self.accounting):
                chosen.append((artifact, block))
                if len(chosen) == selector.size:
                    return chosen
        raise BudgetExhausted(f"denied: only {len(chosen)} live block(s) in ledger {self.context!r} "
                              f"can pay the request; the window needs {selector.size}",
                              {block.block_id: "can pay" for _, block in chosen})

    def find_grant(self, grant_id: str) -> Grant:
        """The grant recorded under `grant_id`; BadRequest if this ledger never issued it."""
        execution = self._store.get_execution_by_type_and_name(GRANT_TYPE, f"grant-{grant_id}")
        if execution is None or _get(execution, "ledger") != self.context:
            raise BadRequest(f"ledger {self.context!r} has no grant {grant_id!r}")
        return self._grant_of(execution)

    def _grant_of(self, execution: pb.Execution) -> Grant:
        """A Grant execution of this ledger, decoded."""
        curve = _get(execution, "rdp_curve")
        return Grant(grant_id=_get(execution, "grant_id"), context=self.context,
                     blocks=tuple(json.loads(_get(execution, "blocks"))),
                     epsilon=_get_float(execution, "epsilon"),
                     delta=_get_float(execution, "delta"),
                     rdp_curve=tuple(json.loads(curve)) if curve else None,
                     pipeline=_get(execution, "pipeline"), execution_id=execution.id,
                     split=json.loads(_get(execution, "split", "{}")),
                     events=json.loads(_get(execution, "events", "{}")))

    def grant_event(self, grant: Grant, step: str):
        """The dp-accounting event recorded for `step` of `grant` (None if none was)."""
        recorded = grant.events.get(step)
        return None if recorded is None else event_from_json(recorded)

    # ------------------------------------------------- what a grant released and who used it
    def _data_name(self, grant_id: str, uri: str) -> str:
        """The unique name of the record that `grant_id` released (or derived) data at `uri`."""
        digest = hashlib.sha256(uri.encode()).hexdigest()[:32]
        return f"{self.context}/grant-{grant_id}/data/{digest}"

    def _data_record(self, grant_id: str, uri: str, producer: str) -> pb.Artifact:
        record = pb.Artifact(type_id=self._types[GRANT_DATA_TYPE],
                             name=self._data_name(grant_id, uri))
        _props(record, {"ledger": self.context, "grant_id": grant_id, "uri": uri,
                        "producer": producer})
        return record

    def record_data(self, grant: Grant, uri: str, producer: str) -> None:
        """Record that `producer` wrote data derived from `grant`'s data at `uri` (e.g. the
        samples ObliviousSampleGen draws from the granted Examples). Append-only."""
        try:
            self._commit(UPDATE_TYPE, {"kind": "grant_data", "grant_id": grant.grant_id},
                         [(self._data_record(grant.grant_id, uri, producer),
                           _event(pb.Event.OUTPUT))])
        except _Conflict:
            raise BadRequest(f"grant {grant.grant_id} already has data at {uri}") from None

    def require_data(self, grant: Grant, uri: str) -> None:
        """BadRequest unless `grant` released (or a component derived from it) the data at
        `uri`: Examples are a grant's own output, never matched by copied properties."""
        record = self._store.get_artifact_by_type_and_name(
            GRANT_DATA_TYPE, self._data_name(grant.grant_id, uri))
        if record is None or _get(record, "uri") != uri:
            raise BadRequest(f"the Examples at {uri} are not the output of grant "
                             f"{grant.grant_id} (nor derived from it) in ledger {self.context!r}")

    def use_share(self, grant: Grant, step: str, consumer: str) -> tuple[float, float]:
        """Consume `step`'s share of `grant`, once: the append-only record
        `<context>/grant-<id>/share/<step>` is created in one MLMD call, so of two consumers
        (same DAG, another run, an Importer later) exactly one succeeds and the other gets
        BadRequest naming the first. Returns the share's (epsilon, delta)."""
        share = grant.share(step)
        name = f"{self.context}/grant-{grant.grant_id}/share/{step}"
        record = pb.Artifact(type_id=self._types[SHARE_USE_TYPE], name=name)
        _props(record, {"ledger": self.context, "grant_id": grant.grant_id, "step": step,
                        "consumer": consumer})
        try:
            self._commit(UPDATE_TYPE, {"kind": "use_share", "grant_id": grant.grant_id,
                                       "step": step}, [(record, _event(pb.Event.OUTPUT))])
        except _Conflict:
            first = self._store.get_artifact_by_type_and_name(SHARE_USE_TYPE, name)
            raise BadRequest(f"the {step!r} share of grant {grant.grant_id} was already used "
                             f"(by {_get(first, 'consumer') if first else 'another consumer'}); "
                             "a share is spent once: request a new grant") from None
        return share

    def grant_records(self, after: int = 0) -> list[dict]:
        """Every grant of this ledger, oldest first, as recorded: time (ms since the epoch),
        grant id, pipeline, run id, blocks, epsilon, delta, and the split among DP steps, the
        dp-accounting event of each step (as JSON) and the RDP curve when the grant recorded them.
        `execution_id` orders them; `after` reads only the grants whose execution_id is larger
        (grants are append-only, so a reader that keeps what it read extends it with these).
        Without `after`, reads the whole history (operators, the CLI)."""
        if after:
            executions = self._store.get_executions(list_options=metadata_store.ListOptions(
                order_by=metadata_store.OrderByField.ID, is_asc=True,
                filter_query=f"type = '{GRANT_TYPE}' AND id > {int(after)} AND "
                             f"custom_properties.ledger.string_value = '{self.context}'"))
        else:
            executions = self._of_this_ledger(self._store.get_executions_by_type(GRANT_TYPE))
        records = []
        for execution in executions:
            grant = self._grant_of(execution)
            records.append({
                "execution_id": execution.id,
                "time_ms": execution.create_time_since_epoch, "grant_id": grant.grant_id,
                "pipeline": grant.pipeline, "run_id": _get(execution, "run_id"),
                "blocks": list(grant.blocks), "epsilon": grant.epsilon, "delta": grant.delta,
                # None when the grant recorded none (made before grants recorded them).
                "split": grant.split if _get(execution, "split") else None,
                "events": grant.events if _get(execution, "events") else None,
                "rdp_curve": list(grant.rdp_curve) if grant.rdp_curve else None})
        return records

    def latest_change(self) -> int:
        """The id of the newest execution recorded in this ledger context (a grant, a new block,
        a pipeline registered or finished, ...): every change of a balance is one, so a reader
        whose value did not move has nothing new to read. 0 for a ledger without any."""
        newest = self._store.get_executions_by_context(
            self._context_node.id, list_options=metadata_store.ListOptions(
                limit=1, order_by=metadata_store.OrderByField.ID, is_asc=False))
        return newest[0].id if newest else 0

    def changes(self, after: int = 0) -> list[dict]:
        """The changes recorded in this ledger context after execution id `after` (see
        `latest_change`), oldest first: {"execution_id", "kind", "blocks", "pipeline"}. `kind` is
        "grant", "add_block", "register_pipeline", "finish_pipeline", "grant_data", "use_share" or
        "init"; `blocks` names the blocks whose balance it changed ([] for none, None for any:
        finishing a pipeline returns its reservations on every block holding one)."""
        executions = self._store.get_executions_by_context(
            self._context_node.id, list_options=metadata_store.ListOptions(
                order_by=metadata_store.OrderByField.ID, is_asc=True,
                filter_query=f"id > {int(after)}"))
        found = []
        for execution in executions:
            if execution.type_id == self._types[GRANT_TYPE]:
                kind, blocks = "grant", json.loads(_get(execution, "blocks"))
            else:
                kind = _get(execution, "kind")
                blocks = {"add_block": [_get(execution, "block_id")],
                          "finish_pipeline": None}.get(kind, [])
            found.append({"execution_id": execution.id, "kind": kind, "blocks": blocks,
                          "pipeline": _get(execution, "pipeline")})
        return found

    def grant_run(self, grant_id: str) -> dict:
        """The pipeline run that spent `grant_id` and what it produced: the run contexts the
        grant is attributed to (TFX's `pipeline_run`, Kubeflow's run, or the ledger's own
        `sage_tfx.PipelineRun`) and every artifact of those runs but the ledger's own records
        (type, name, uri, state, time), oldest first. A grant without a run has none."""
        grant = self.find_grant(grant_id)
        runs = [c for c in self._store.get_contexts_by_execution(grant.execution_id)
                if c.id != self._context_node.id]
        # The grant's own records (blocks, versions, data) are attributed to the run too.
        ledger_types = set(self._types.values())
        artifacts = sorted({artifact.id: artifact for run in runs
                            for artifact in self._store.get_artifacts_by_context(run.id)
                            if artifact.type_id not in ledger_types}.values(),
                           key=lambda artifact: artifact.id)
        type_names = {t.id: t.name for t in self._store.get_context_types_by_id(
            sorted({c.type_id for c in runs}))} if runs else {}
        if artifacts:
            type_names.update((t.id, t.name) for t in self._store.get_artifact_types_by_id(
                sorted({a.type_id for a in artifacts})))
        return {"grant_id": grant.grant_id, "pipeline": grant.pipeline,
                "runs": [{"type": type_names[c.type_id], "name": c.name} for c in runs],
                "artifacts": [{"id": a.id, "type": type_names[a.type_id], "name": a.name,
                               "uri": a.uri, "state": pb.Artifact.State.Name(a.state),
                               "time_ms": a.create_time_since_epoch}
                              for a in artifacts]}

    def audit(self) -> list[str]:
        """Re-derive every balance from the append-only history; return the inconsistencies found.

        Checks: each block's materialised spending equals the sum of the demands of the grants
        that name it, no block is above its ceiling, and every grant created the next version of
        each block it names (grants are whole). Reads the whole history: for tests and operators,
        never on the grant path.
        """
        problems = []
        charged: dict[str, list[np.ndarray]] = {}
        grants = self._store.get_executions(list_options=metadata_store.ListOptions(
            filter_query=f"type = '{GRANT_TYPE}' AND "
                         f"custom_properties.ledger.string_value = '{self.context}'"))
        events = self._store.get_events_by_execution_ids([g.id for g in grants]) if grants else []
        outputs: dict[int, list[int]] = {}
        for event in events:
            if event.type == pb.Event.OUTPUT:
                outputs.setdefault(event.execution_id, []).append(event.artifact_id)
        records = {a.id: a.name for a in self._store.get_artifacts_by_id(
            [i for ids in outputs.values() for i in ids])
            if a.type_id == self._types[BLOCK_VERSION_TYPE]} if outputs else {}
        for execution in grants:
            named = json.loads(_get(execution, "blocks"))
            demand = np.array(json.loads(_get(execution, "demand")))
            versioned = sorted(records[i].split("/")[1] for i in outputs.get(execution.id, [])
                               if i in records)
            if versioned != sorted(named):
                problems.append(f"grant {_get(execution, 'grant_id')}: versioned blocks {versioned} "
                                f"but names {sorted(named)}")
            for block_id in named:
                charged.setdefault(block_id, []).append(demand)
        for block in self.blocks():
            history = charged.get(block.block_id, [])
            total = sum(history, self.accounting.zero())
            if not np.allclose(total, block.spent, rtol=1e-9, atol=0):
                problems.append(f"block {block.block_id}: spent {list(block.spent)} but its grants "
                                f"sum to {list(total)}")
            if len(history) != block.charges:
                problems.append(f"block {block.block_id}: {block.charges} charges counted, "
                                f"{len(history)} grants name it")
            if not self.accounting.fits(self.accounting.zero(), block.spent, block.capacity):
                problems.append(f"block {block.block_id}: spent {list(block.spent)} is above its "
                                "ceiling")
        return problems

    def _run_contexts(self, run_id: Optional[str]) -> list[pb.Context]:
        if run_id is None:
            return []
        _check_name(run_id, "run id")
        try:
            tfx_run = self._store.get_context_by_type_and_name(TFX_RUN_CONTEXT_TYPE, run_id)
        except mlmd_errors.NotFoundError:
            tfx_run = None
        if tfx_run is not None:
            return [tfx_run]
        return [pb.Context(type_id=self._store.get_context_type(RUN_CONTEXT_TYPE).id, name=run_id)]


def budget_view(accounting, block: BlockState, pipeline: Optional[str] = None) -> dict:
    """A block's spent, reserved (per waiting pipeline), free and available-to-`pipeline` budget,
    in the unit the ledger grants (what `show`, `plot` and denial messages say).

    basic: epsilon (a request fits when its epsilon is within its pipeline's reservation plus
    the free budget, and likewise for delta). rdp: shares of the filter's capacity at one order,
    the order with the most room for `pipeline` (the filter admits a curve while some order
    still fits, so no single epsilon describes a spent curve; ties go to the least spent order).
    A retired block has nothing free."""
    reservations = {name: np.maximum(v, 0.0) for name, v in sorted(block.reservations.items())}
    # A retired block grants nothing again: its leftover (below the minimum request) is not free.
    live = not block.retired
    free = np.maximum(allocation.free_budget(block), 0.0) * live
    available = allocation.available_to(block, pipeline) * live
    if accounting.name == "basic":
        return {"unit": "epsilon", "total": block.epsilon_ceiling, "spent": float(block.spent[0]),
                "reserved": {k: float(v[0]) for k, v in reservations.items()},
                "delta_reserved": {k: float(v[1]) for k, v in reservations.items()},
                "free": float(free[0]), "delta_free": float(free[1]),
                "available": float(max(available[0], 0.0))}
    capacity = block.capacity
    usable = capacity > 0
    fraction = lambda v: np.where(usable, v / np.where(usable, capacity, 1.0), 0.0)  # noqa: E731
    room = np.where(usable, fraction(available), -np.inf)
    best = int(np.lexsort((fraction(block.spent), -room))[0])
    share = lambda v: float(min(1.0, max(0.0, fraction(v)[best])))  # noqa: E731
    return {"unit": f"share of RDP capacity at order {accounting.orders[best]:g}", "total": 1.0,
            "order": accounting.orders[best], "spent": share(block.spent) if usable[best] else 1.0,
            "reserved": {k: share(v) for k, v in reservations.items()},
            "free": share(free), "available": share(available)}


def ledger_contexts(store: StoreSpec) -> list[str]:
    """The names of the ledger contexts in `store` (read only)."""
    mlmd = connect(store)
    return [c.name for c in mlmd.get_contexts_by_type(LEDGER_CONTEXT_TYPE)]


def check_split(split: Mapping[str, object]) -> dict[str, str]:
    """A split of a grant among named DP steps: positive fractions summing to at most 1 in exact
    arithmetic (decimal fractions as written: 0.1 + 0.5 + 0.4 is exactly 1). Returned as
    {step: exact decimal string}."""
    if not split:
        raise BadRequest("the budget split is empty")
    clean = {}
    for step, fraction in split.items():
        if not isinstance(step, str) or not step:
            raise BadRequest(f"split step {step!r} must be a non-empty name")
        exact = exact_fraction(fraction)
        if exact <= 0:
            raise BadRequest(f"split step {step!r} needs a positive fraction, got {fraction!r}")
        clean[step] = str(fraction) if isinstance(fraction, str) else repr(float(fraction))
    total = sum(exact_fraction(f) for f in clean.values())
    if total > 1:
        raise BadRequest(f"the split fractions sum to {float(total)!r} > 1 (exactly {total}): "
                         f"{clean}")
    return clean


def _event(kind) -> pb.Event:
    return pb.Event(type=kind)


def _register_types(mlmd: metadata_store.MetadataStore) -> None:
    for name in (STATE_TYPE, LEDGER_VERSION_TYPE, BLOCK_TYPE, BLOCK_VERSION_TYPE,
                 GRANT_DATA_TYPE, SHARE_USE_TYPE):
        mlmd.put_artifact_type(pb.ArtifactType(name=name))
    for name in (GRANT_TYPE, UPDATE_TYPE):
        mlmd.put_execution_type(pb.ExecutionType(name=name))
    for name in (LEDGER_CONTEXT_TYPE, RUN_CONTEXT_TYPE):
        mlmd.put_context_type(pb.ContextType(name=name))
