"""The BlockLedger: Sage Access Control (§3.2) persisted in ML Metadata.

The operations users call: create a ledger context, add blocks, register and finish pipelines,
request grants (all or nothing), and bind grants to their data and their steps' shares. The
ledger's parts live beside it:

* records.py: the MLMD record types and how the ledger's state is encoded in them;
* transaction.py: every change is one atomic MLMD call, made safe against concurrent writers by
  uniquely named version records (optimistic concurrency), and retried on conflict;
* accounting.py: the accounting mode (basic composition or a Rényi filter), one object chosen
  when the ledger opens, which the ledger calls and never branches on;
* allocation.py: the reservation policy among waiting pipelines (Sage §3.3);
* lineage.py: the grant history, its audit, and the run contexts charges are attributed to.

Grant binding. A grant records the data location it released (`request(data_uri=...)`) and the
components' derived data (`record_data`); components accept Examples only at a location their
grant released (`require_data`). A consumed share is an append-only record with a unique name
(`use_share`), so one grant feeds one trainer and one validator, whatever DAG or Importer asks
later.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import uuid
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
from ml_metadata import errors as mlmd_errors
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access import allocation, lineage
from sage_tfx.sage_access.accounting import (AccountingMode, BudgetRequest, accounting_for,
                                             check_split, event_from_json, event_to_json)
from sage_tfx.sage_access.allocation import BlockState
from sage_tfx.sage_access.errors import BadRequest, BudgetExhausted
from sage_tfx.sage_access.records import (DENIAL_TYPE, GRANT_TYPE, WHOLE_GRANT, LEDGER_CONTEXT_TYPE, UPDATE_TYPE, Grant,
                                          LedgerRecords, check_name, get_float, get_property,
                                          input_event, new_ledger_state, output_event,
                                          register_types, set_properties)
from sage_tfx.sage_access.store import CommitUnknown, StoreSpec, connect, connect_read_only
from sage_tfx.sage_access.transaction import Conflict, Transactions


# What a block's data_uri holds (add_block's `data_format`): TFX Examples with train/test
# splits (BlockExampleGen), or a table's rows (dp_statistics ingest).
EXAMPLES, TABLE = "examples", "table"
DATA_FORMATS = (EXAMPLES, TABLE)


@dataclass(frozen=True)
class BlockIds:
    """Select these blocks, by id. With `data_format`, a request naming a block whose data is
    not in that format is refused (BadRequest, nothing charged)."""
    ids: tuple[str, ...]
    data_format: Optional[str] = None

    def __init__(self, ids: Iterable[str], data_format: Optional[str] = None):
        object.__setattr__(self, "ids", tuple(ids))
        object.__setattr__(self, "data_format", data_format)


@dataclass(frozen=True)
class RecentWindow:
    """Select the most recent `size` live blocks (by arrival) that can still pay the request;
    with `data_format`, only blocks whose data is in that format (a window of Examples skips
    the blocks of ingested tables in the same ledger context)."""
    size: int
    data_format: Optional[str] = None


@dataclass(frozen=True)
class NewBlock:
    """A block to register (add_blocks): ceiling (epsilon, delta), its period [start, end) as
    ISO strings, where its data lives and in which of DATA_FORMATS."""
    block_id: str
    epsilon: float
    delta: float
    start: Optional[str] = None
    end: Optional[str] = None
    data_uri: Optional[str] = None
    data_format: Optional[str] = None


def holds(block: BlockState, data_format: str) -> bool:
    """Whether the block's data is in `data_format`. A block registered with data but without
    a format (before formats were recorded, or by add_block without one) counts as Examples."""
    return block.data_uri is not None and (block.data_format or EXAMPLES) == data_format


class BlockLedger:
    """Per-block privacy budgets of one ledger context, persisted in ML Metadata."""

    def __init__(self, store: StoreSpec, context: str = "default", read_only: bool = False):
        """`read_only`: `store` is a string (path or grpc://), checked to be a sage-tfx ledger
        store and opened without writing (see store.connect_read_only); the ledger's reading
        methods work, its writing methods fail."""
        self._store = connect_read_only(store) if read_only else connect(store)
        self._records = LedgerRecords(self._store, context, lookup_only=read_only)
        self._transactions = Transactions(self._records)
        self.context = self._records.context
        state = self._records.read_state()
        self.accounting = accounting_for(get_property(state, "accounting"))
        self.min_request_epsilon = get_float(state, "min_request_epsilon")
        # Created for tests (`create(for_tests=True)`): fixed seeds are accepted and every
        # guarantee it issues says so (refuse_fixed_seed, release.Charged.guarantee).
        self.for_tests = bool(get_property(state, "for_tests", 0))
        self._min_demand = self.accounting.demand(
            BudgetRequest(epsilon=self.min_request_epsilon, delta=0.0))
        self._decoded_states = functools.lru_cache(maxsize=4096)(self._decode_state)

    # ----------------------------------------------------------------- creation
    @classmethod
    def create(cls, store: StoreSpec, context: str = "default",
               accounting: str = AccountingMode.BASIC,
               min_request_epsilon: float = 0.01, for_tests: bool = False) -> "BlockLedger":
        """Create a ledger context; BadRequest if it exists already. `for_tests`: a ledger for
        tests, the only kind that accepts a fixed seed for noise or sampling on its grants
        (refuse_fixed_seed); it is recorded on the ledger and stated in every guarantee it
        issues. Never for real data: a seed is public (compiled jobs, ML Metadata), and noise
        drawn from a known seed protects nothing."""
        check_name(context, "ledger context")
        mode = accounting_for(accounting)
        BudgetRequest(epsilon=min_request_epsilon, delta=0.0)  # validates the number
        mlmd = connect(store)
        register_types(mlmd)
        state = new_ledger_state(mlmd, context, mode, min_request_epsilon, for_tests)
        ledger_context = pb.Context(type_id=mlmd.get_context_type(LEDGER_CONTEXT_TYPE).id,
                                    name=context)
        execution = pb.Execution(type_id=mlmd.get_execution_type(UPDATE_TYPE).id,
                                 last_known_state=pb.Execution.COMPLETE)
        set_properties(execution, {"kind": "init", "ledger": context})
        try:
            mlmd.put_execution(execution, [(state, output_event())], [ledger_context])
        except mlmd_errors.AlreadyExistsError:
            raise BadRequest(f"ledger context {context!r} already exists in this store") from None
        except CommitUnknown:  # the store reconnected: the context exists iff the call landed
            if mlmd.get_context_by_type_and_name(LEDGER_CONTEXT_TYPE, context) is None:
                return cls.create(mlmd, context, accounting, min_request_epsilon, for_tests)
        return cls(mlmd, context)

    # ----------------------------------------------------------------- reading
    @property
    def store(self):
        """The ledger's open ML Metadata store (read-only if the ledger is), for the records
        kept beside the ledger's own (dp_statistics/tables.py: table definitions)."""
        return self._store

    @property
    def retries(self) -> int:
        """How many times this ledger object re-ran a change because a concurrent writer
        committed first or the store rolled it back (a lock wait, a deadlock): what
        overlapping writers cost each other (benchmarks/ledger.py reports it)."""
        return self._transactions.retries

    @property
    def orders(self) -> tuple[float, ...]:
        """RDP orders on which grants give their curves."""
        return self.accounting.orders

    def waiting_pipelines(self) -> list[str]:
        return json.loads(get_property(self._records.read_state(), "waiting"))

    def _to_state(self, artifact: pb.Artifact) -> BlockState:
        # Decoded once per stored content: planning reads every live block again after each
        # change (a window's grant, then the next pipeline's plan), and decoding the fractions
        # costs far more than reading. Keyed on the artifact's whole serialized record (id,
        # properties, update time), so equal keys are equal records, and a record changed in
        # any way, even behind the ledger's back, is decoded anew (audit sees what is stored).
        return self._decoded_states(artifact.SerializeToString(deterministic=True))

    def _decode_state(self, record: bytes) -> BlockState:
        block = self._records.block_state(pb.Artifact.FromString(record), self.accounting)
        # Shared by every reader of that content: read-only, so no caller can change another's.
        for vector in (block.capacity, block.spent, *block.reservations.values()):
            vector.flags.writeable = False
        return dataclasses.replace(block, reservations=MappingProxyType(dict(block.reservations)))

    def _write_state(self, artifact: pb.Artifact, block: BlockState) -> pb.Artifact:
        return self._records.updated_block(artifact, block, self.accounting)

    def block(self, block_id: str) -> BlockState:
        return self._to_state(self._records.block_artifacts([block_id])[0])

    def blocks(self, ids: Optional[Sequence[str]] = None) -> list[BlockState]:
        """Every block of this ledger, in arrival order (retired ones included); with `ids`, those
        blocks, in that order (BadRequest naming any this ledger does not have)."""
        if ids is not None:
            return [self._to_state(a) for a in self._records.block_artifacts(ids)] if ids else []
        return [self._to_state(a) for a in self._records.all_blocks()]

    def live_blocks(self, page: int = 256) -> list[BlockState]:
        """Blocks not yet retired, most recent arrival first (what a window can draw on)."""
        return [self._to_state(a) for a in self._records.live_blocks_newest_first(page)]

    def payable_window(self, epsilon: float, delta: float, pipeline: Optional[str] = None,
                       size: Optional[int] = None, split: Optional[Mapping[str, str]] = None,
                       events: Optional[Mapping[str, object]] = None,
                       blocks: Optional[Sequence[BlockState]] = None,
                       additional_delta: float = 0.0,
                       data_format: Optional[str] = None) -> list[BlockState]:
        """The blocks a RecentWindow(size, data_format) request of (epsilon, delta) with this
        split and these events (see `request`) would take now, most recent first (all that can
        pay, without `size`), among `blocks` (default: the live blocks, read now). Planning
        only: nothing is charged, and a concurrent grant may change the answer before a request
        is made."""
        budget = BudgetRequest(epsilon=epsilon, delta=delta)
        demand = self._demand(budget, check_split(split) if split is not None else {},
                              dict(events or {}), additional_delta)
        payable = [block for block in (self.live_blocks() if blocks is None else blocks)
                   if (data_format is None or holds(block, data_format))
                   and allocation.can_pay(block, demand, pipeline, self.accounting)]
        return payable if size is None else payable[:size]

    def refuse_fixed_seed(self, seeded_by: Sequence[str]) -> None:
        """BadRequest naming `seeded_by` (the components or options that fix a seed for noise
        or sampling) unless this ledger was created for tests: call it before charging or
        consuming anything. A fixed seed makes the noise a function of public text (it is in
        the compiled job and in ML Metadata): two runs with seed 7 draw the same noise, and
        the ledger's (epsilon, delta) would describe noise nobody drew at random."""
        if seeded_by and not self.for_tests:
            raise BadRequest(
                f"refused before the charge (nothing was charged): {', '.join(seeded_by)} "
                f"fix(es) a seed, and ledger {self.context!r} was not created for tests. A "
                "fixed seed makes the noise predictable (it is public), so the grant's "
                "(epsilon, delta) would not hold: remove the seed (the default draws from the "
                "OS CSPRNG), or, in a test, create the ledger with "
                "BlockLedger.create(..., for_tests=True) or `sage-tfx ledger init --for-tests`")

    def remaining(self, block: BlockState, pipeline: Optional[str] = None) -> str:
        """A readable account of what a block has left (for errors and the CLI): its guarantee,
        what `pipeline` may still draw and what is reserved for the other waiting pipelines
        (rdp: as shares of the filter's capacity at the order with the most room for it)."""
        return self.accounting.remaining(block, pipeline)

    # ----------------------------------------------------------------- writing
    def add_block(self, block_id: str, epsilon: float, delta: float,
                  start: Optional[str] = None, end: Optional[str] = None,
                  data_uri: Optional[str] = None,
                  data_format: Optional[str] = None) -> BlockState:
        """Register one new block (add_blocks)."""
        return self.add_blocks([NewBlock(block_id, epsilon, delta, start, end, data_uri,
                                         data_format)])[0]

    def add_blocks(self, blocks: Sequence[NewBlock]) -> list[BlockState]:
        """Register new blocks, all or none, in one ledger change (an ingestion that fails
        leaves nothing half-registered, so it can be run again); arrival order is the order
        given. Each block's budget is split evenly among the pipelines waiting now and reserved
        for them (Sage §3.3), the longest-waiting first when there are too many for every share
        to pay the minimum request (allocation.py). `data_uri` is where a block's data lives
        and `data_format` what it is (one of DATA_FORMATS: BlockExampleGen registers Examples,
        the BlockLedger component reads them; dp_statistics ingest registers tables)."""
        if not blocks:
            raise BadRequest("no blocks to register")
        capacities = []
        for new in blocks:
            check_name(new.block_id, "block id")
            capacities.append(self.accounting.capacity(new.epsilon, new.delta))
            for value, what in ((new.start, "start"), (new.end, "end")):
                if value is not None and not isinstance(value, str):
                    raise BadRequest(f"block {what} must be an ISO string, got {value!r}")
            if new.data_format is not None and (new.data_format not in DATA_FORMATS
                                                or new.data_uri is None):
                raise BadRequest(f"block {new.block_id!r}: data_format must be one of "
                                 f"{DATA_FORMATS} and comes with a data_uri, got "
                                 f"{new.data_format!r}")
        ids = [new.block_id for new in blocks]
        if len(set(ids)) != len(ids):
            raise BadRequest(f"a block id is given twice: {ids}")

        def attempt() -> list[BlockState]:
            state = self._records.read_state()
            waiting = json.loads(get_property(state, "waiting"))
            added, changes = [], []
            for new, capacity in zip(blocks, capacities):
                block = allocation.new_block(new.block_id, float(new.epsilon), float(new.delta),
                                             capacity, self.accounting.zero(), waiting,
                                             self._min_demand, self.accounting, new.start,
                                             new.end, new.data_uri, new.data_format)
                artifact = self._write_state(self._records.new_block(
                    new.block_id, new.epsilon, new.delta, new.start, new.end, new.data_uri,
                    new.data_format), block)
                changes += [(artifact, output_event()),
                            (self._transactions.block_version(new.block_id, 1), output_event())]
                added.append(block)
            try:
                self._transactions.commit(
                    UPDATE_TYPE, {"kind": "add_block", "block_ids": json.dumps(ids)},
                    [*changes, *self._transactions.ledger_version(state, "add_block")])
            except Conflict:
                existing = [block_id for block_id in ids if self._records.block_exists(block_id)]
                if existing:
                    raise BadRequest(f"block {', '.join(existing)} already exists in ledger "
                                     f"{self.context!r}; nothing was registered") from None
                raise
            return added

        def committed() -> Optional[list[BlockState]]:
            # All or none were committed: the last one's presence says which.
            return self.blocks(ids) if self._records.block_exists(ids[-1]) else None

        return self._transactions.retrying(attempt, committed)

    def register_pipeline(self, pipeline: str) -> None:
        """Mark a pipeline as waiting: blocks arriving from now on reserve a share for it."""
        check_name(pipeline, "pipeline")

        def attempt() -> None:
            state = self._records.read_state()
            waiting = json.loads(get_property(state, "waiting"))
            if pipeline in waiting:
                return
            self._transactions.commit(
                UPDATE_TYPE, {"kind": "register_pipeline", "pipeline": pipeline},
                self._transactions.ledger_version(state, "register_pipeline",
                                                  waiting=json.dumps(waiting + [pipeline])))

        self._transactions.retrying(
            attempt, lambda: True if pipeline in self.waiting_pipelines() else None)

    def finish_pipeline(self, pipeline: str) -> None:
        """The pipeline was accepted or abandoned: its unused reservations return and are re-split
        evenly among the pipelines still waiting."""
        check_name(pipeline, "pipeline")

        def attempt() -> None:
            state = self._records.read_state()
            waiting = json.loads(get_property(state, "waiting"))
            if pipeline not in waiting:
                raise BadRequest(f"pipeline {pipeline!r} is not waiting in ledger {self.context!r}")
            still_waiting = [p for p in waiting if p != pipeline]
            changes = self._transactions.ledger_version(state, "finish_pipeline",
                                                        waiting=json.dumps(still_waiting))
            released = []
            for artifact in self._records.live_blocks_newest_first(page=500):
                block = self._to_state(artifact)
                if pipeline not in block.reservations:
                    continue
                released.append(allocation.release(block, pipeline, still_waiting))
                version = get_property(artifact, "version") + 1
                changes.append((self._write_state(artifact, released[-1]), input_event()))
                changes.append((self._transactions.block_version(block.block_id, version),
                                output_event()))
            self._transactions.commit(
                UPDATE_TYPE, {"kind": "finish_pipeline", "pipeline": pipeline,
                              "balances": lineage.recorded_balances(released)}, changes)

        self._transactions.retrying(
            attempt, lambda: None if pipeline in self.waiting_pipelines() else True)

    def request(self, selector: BlockIds | RecentWindow, epsilon: Optional[float] = None,
                delta: Optional[float] = None, rdp_curve: Optional[Sequence[float]] = None,
                pipeline: Optional[str] = None, run_id: Optional[str] = None,
                split: Optional[Mapping[str, str]] = None,
                events: Optional[Mapping[str, object]] = None,
                data_uri: Optional[str] = None, require_data: bool = False,
                additional_delta: float = 0.0, front_door: Optional[str] = None,
                request_text: Optional[str] = None) -> Grant:
        """Grant (epsilon, delta) or an RDP curve on the selected blocks, all or nothing.

        `split` ({step: fraction}, exact, summing to at most 1) divides the grant among the
        iteration's DP steps and `events` ({step: dp-accounting DpEvent}) says what each step
        will run; both are recorded on the grant. On an `rdp` ledger an (epsilon, delta) grant
        needs `events` for every step of the split: it charges the RDP curve of their
        composition, and (epsilon, delta) is the target the steps were calibrated to. A `basic`
        ledger charges (epsilon, delta). `additional_delta` is the part of delta the steps
        spend outside their events (partition selection's): a basic ledger charges it within
        delta, an rdp ledger refuses it (accounting.RenyiFilter.grant_demand). `data_uri` is
        where the granted Examples will be written (recorded as the grant's data; see
        `require_data`). With `require_data`, the
        grant is refused (BadRequest naming the blocks, nothing charged) unless every block it
        takes has Examples registered (`add_block(data_uri=...)`); the check runs on the blocks
        read inside the grant's transaction, so no concurrent grant can change what it checked.

        Raises BadRequest for malformed input (nothing charged) and BudgetExhausted when the
        blocks cannot pay (nothing charged; the error names each block and what it has left).
        `run_id` links the charge to the pipeline run that spends it (TFX's `pipeline_run`
        context of that name when it is in the same store). `front_door` and `request_text` are
        recorded on the grant (who asked, and for what); front doors pass them through the
        release protocol (sage_tfx.release), which also records what became of the grant.
        """
        budget = BudgetRequest(epsilon=epsilon, delta=delta,
                               rdp_curve=tuple(rdp_curve) if rdp_curve is not None else None)
        split = check_split(split) if split is not None else {}
        events = dict(events or {})
        demand = self._demand(budget, split, events, additional_delta)
        recorded_events = {step: event_to_json(event) for step, event in events.items()}
        if pipeline is not None:
            check_name(pipeline, "pipeline")
        _check_selector(selector)
        run_contexts = lineage.run_contexts(self._store, run_id)
        # One id for every attempt: after a lost connection, `committed` finds the grant by it,
        # and two commits of it could never both succeed (the execution's name is unique).
        grant_id = uuid.uuid4().hex

        def attempt() -> Grant:
            with self._transactions.session() as session:
                return charge(session)

        def charge(session) -> Grant:
            chosen = self._choose(selector, demand, pipeline, session)
            lineage.check_balances(self._records, self.accounting, chosen, session)
            if require_data:
                _check_data([block for _, block in chosen])
            grant = Grant(grant_id=grant_id, context=self.context,
                          blocks=tuple(block.block_id for _, block in chosen),
                          epsilon=self.accounting.granted_epsilon(budget, demand),
                          delta=budget.delta, rdp_curve=budget.rdp_curve, pipeline=pipeline,
                          execution_id=-1,  # known once committed, below
                          split=split, events=recorded_events)
            changes, charged = [], []
            for artifact, block in chosen:
                version = get_property(artifact, "version") + 1
                charged.append(allocation.charge(block, demand, pipeline, self.accounting,
                                                 self._min_demand))
                changes.append((self._write_state(artifact, charged[-1]), input_event()))
                changes.append((self._transactions.block_version(block.block_id, version),
                                output_event()))
            if data_uri is not None:
                changes.append((self._records.data_record(grant.grant_id, data_uri,
                                                          "BlockLedger"), output_event()))
            execution_id = self._transactions.commit(
                GRANT_TYPE, dict(self._records.grant_properties(grant, run_id, demand, front_door,
                                                              request_text),
                                 balances=lineage.recorded_balances(charged)), changes,
                run_contexts, name=f"grant-{grant.grant_id}",
                read={artifact.id: artifact for artifact, _ in chosen}, session=session)
            return dataclasses.replace(grant, execution_id=execution_id)

        def committed() -> Optional[Grant]:
            execution = self._records.grant_execution(grant_id)
            return None if execution is None else self._records.grant_of(execution)

        return self._transactions.retrying(attempt, committed)

    def _demand(self, budget: BudgetRequest, split: Mapping[str, str],
                events: Mapping[str, object], additional_delta: float = 0.0) -> np.ndarray:
        """What a grant charges, as the ledger's accounting prices it (accounting.grant_demand)."""
        if set(events) - set(split):
            raise BadRequest(f"events for step(s) {sorted(set(events) - set(split))} that the "
                             f"split {split} does not name")
        return self.accounting.grant_demand(budget, split, events, additional_delta)

    def _choose(self, selector, demand: np.ndarray, pipeline: Optional[str],
                session=None) -> list[tuple[pb.Artifact, BlockState]]:
        """The selected blocks (artifact and decoded state) that can all pay, or an error.
        Named blocks are read in the grant's `session` (Transactions.session: on MySQL they
        stay locked until it commits); a window's are read from the store (MLMD's filter
        query), and the commit then refuses any whose version moved since."""
        if isinstance(selector, BlockIds):
            chosen = [(a, self._to_state(a)) for a in self._records.block_artifacts(
                selector.ids, session, lineage.balance_check_reads(self._records))]
            elsewise = [block.block_id for _, block in chosen if selector.data_format
                        and not holds(block, selector.data_format)]
            if elsewise:
                raise BadRequest(f"block(s) {', '.join(elsewise)} in ledger {self.context!r} "
                                 f"do not hold {selector.data_format} data; nothing was charged")
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
        pages = self._records.live_blocks_newest_first(page=max(2 * selector.size, 64))
        for artifact in pages:
            block = self._to_state(artifact)
            if selector.data_format is not None and not holds(block, selector.data_format):
                continue
            if allocation.can_pay(block, demand, pipeline, self.accounting):
                chosen.append((artifact, block))
                if len(chosen) == selector.size:
                    return chosen
        raise BudgetExhausted(
            f"denied: only {len(chosen)} live block(s)"
            + (f" of {selector.data_format}" if selector.data_format else "")
            + f" in ledger {self.context!r} can pay the request; the window needs "
            f"{selector.size}",
            {block.block_id: "can pay" for _, block in chosen})

    def find_grant(self, grant_id: str) -> Grant:
        """The grant recorded under `grant_id`; BadRequest if this ledger never issued it."""
        execution = self._records.grant_execution(grant_id)
        if execution is None:
            raise BadRequest(f"ledger {self.context!r} has no grant {grant_id!r}")
        return self._records.grant_of(execution)

    def grant_event(self, grant: Grant, step: str):
        """The dp-accounting event recorded for `step` of `grant` (None if none was)."""
        recorded = grant.events.get(step)
        return None if recorded is None else event_from_json(recorded)

    # ------------------------------------------------- what a grant released and who used it
    def record_data(self, grant: Grant, uri: str, producer: str) -> None:
        """Record that `producer` wrote data derived from `grant`'s data at `uri` (e.g. the
        samples ObliviousSampleGen draws from the granted Examples). Append-only."""
        def attempt() -> bool:
            try:
                self._transactions.commit(
                    UPDATE_TYPE, {"kind": "grant_data", "grant_id": grant.grant_id},
                    [(self._records.data_record(grant.grant_id, uri, producer), output_event())])
            except Conflict:
                raise BadRequest(f"grant {grant.grant_id} already has data at {uri}") from None
            return True

        self._transactions.retrying(
            attempt, lambda: True if self._records.has_data(grant.grant_id, uri) else None)

    def require_data(self, grant: Grant, uri: str) -> None:
        """BadRequest unless `grant` released (or a component derived from it) the data at
        `uri`: Examples are a grant's own output, never matched by copied properties."""
        if not self._records.has_data(grant.grant_id, uri):
            raise BadRequest(f"the Examples at {uri} are not the output of grant "
                             f"{grant.grant_id} (nor derived from it) in ledger {self.context!r}")

    def data_producer(self, grant: Grant, uri: str) -> Optional[str]:
        """Who wrote `grant`'s data at `uri`: "BlockLedger" for the granted Examples, else the
        component that derived them (record_data's `producer`); None if none is recorded."""
        return self._records.data_producer(grant.grant_id, uri)

    def use_share(self, grant: Grant, step: str, consumer: str) -> tuple[float, float]:
        """Consume `step`'s share of `grant`, once: the append-only record
        `<context>/grant-<id>/share/<step>` is created in one MLMD call, so of two consumers
        (same DAG, another run, an Importer later) exactly one succeeds and the other gets
        BadRequest naming the first. Returns the share's (epsilon, delta)."""
        share = grant.share(step)
        record = self._records.share_use_record(grant.grant_id, step, consumer)

        def attempt() -> tuple[float, float]:
            try:
                self._transactions.commit(UPDATE_TYPE, {"kind": "use_share",
                                                        "grant_id": grant.grant_id, "step": step},
                                          [(record, output_event())])
            except Conflict:
                first = self._records.share_consumer(grant.grant_id, step)
                raise BadRequest(f"the {step!r} share of grant {grant.grant_id} was already "
                                 f"used (by {first or 'another consumer'}); "
                                 "a share is spent once: request a new grant") from None
            return share

        # A lost commit that landed recorded this consumer (a consumer name is one component of
        # one run: it does not race itself for the same share).
        return self._transactions.retrying(
            attempt, lambda: share if self._records.share_consumer(grant.grant_id, step)
            == consumer else None)

    def pin(self, grant_id: str, name: str, digest: str) -> None:
        """Pin grant `grant_id`'s output `name` (e.g. one trigger of a continual release) to
        `digest`, a value that stands for what the output is computed from, before it is
        written: the append-only record `<context>/grant-<id>/pin/<name>` is created once, in
        one MLMD call, wherever the output is written from (another run, another artifact
        directory). The same value again is a no-op; another is BadRequest and nothing is
        recorded. Any reader of the store sees the value and the record's creation time, so
        neither may depend on the data (continual/release.py pins random tokens)."""
        record = self._records.pin_record(grant_id, name, digest)

        def attempt() -> bool:
            try:
                self._transactions.commit(UPDATE_TYPE, {"kind": "pin", "grant_id": grant_id,
                                                        "name": name},
                                          [(record, output_event())])
            except Conflict:
                if self._records.pinned_digest(grant_id, name) != digest:
                    raise BadRequest(f"{name} of grant {grant_id} is pinned to another value: "
                                     "another copy of its computation took it first") from None
            return True

        # Pinning the same digest again is a no-op, so a lost commit is simply pinned again.
        self._transactions.retrying(attempt, lambda: None)

    def record_outcome(self, grant: Grant, steps: Sequence[str], outcome: str, front_door: str,
                       reason: Optional[str] = None, artifacts: Sequence[str] = (),
                       guarantee: Optional[str] = None) -> None:
        """Record, once and atomically, what became of `steps` of `grant` (release.protocol's
        outcome: released with `artifacts` under `guarantee`'s sentence, failed or interrupted
        with a public `reason`). BadRequest if one of them has an outcome
        already (the first one stands). A grant without a split has one outcome, step `all`."""
        steps = list(steps) if grant.split else [WHOLE_GRANT]
        unknown = sorted(set(steps) - set(grant.split or {WHOLE_GRANT: "1"}))
        if unknown:
            raise BadRequest(f"grant {grant.grant_id} has no step(s) {unknown}")
        records = [(self._records.outcome_record(grant.grant_id, step, outcome, front_door,
                                                 reason, artifacts, guarantee), output_event())
                   for step in steps]

        def attempt() -> bool:
            try:
                self._transactions.commit(UPDATE_TYPE, {"kind": "release_outcome",
                                                        "grant_id": grant.grant_id,
                                                        "outcome": outcome}, records)
            except Conflict:
                raise BadRequest(f"an outcome of grant {grant.grant_id} ({', '.join(steps)}) is "
                                 "recorded already") from None
            return True

        def committed() -> Optional[bool]:  # all of the steps recorded together, or none
            return True if set(steps) <= set(self.grant_outcomes(grant.grant_id)) else None

        self._transactions.retrying(attempt, committed)

    def grant_outcomes(self, grant_id: str) -> dict[str, dict]:
        """{step: its outcome record} of `grant_id` (empty while none is recorded)."""
        return self._records.outcomes({grant_id}).get(grant_id, {})

    def record_denial(self, front_door: str, request_text: Optional[str], pipeline: Optional[str],
                      epsilon: Optional[float], delta: Optional[float],
                      free: Mapping[str, str], reason: str) -> None:
        """Record a request refused for lack of budget: who asked, for what and how much, and
        what the blocks that could not pay had free (budgets are public; no data is read)."""
        # A unique name, so that a commit whose fate a lost connection hid is found, not doubled.
        name = f"denial-{uuid.uuid4().hex}"

        def attempt() -> bool:
            self._transactions.commit(DENIAL_TYPE, {
                "kind": "denial", "front_door": front_door, "request": request_text,
                "pipeline": pipeline, "epsilon": epsilon, "delta": delta,
                "free": json.dumps(dict(free)), "reason": reason}, [], name=name)
            return True

        def committed() -> Optional[bool]:
            found = self._store.get_execution_by_type_and_name(DENIAL_TYPE, name)
            return None if found is None else True

        self._transactions.retrying(attempt, committed)

    # ----------------------------------------------------------------- audit and lineage
    def grant_records(self, after: int = 0) -> list[dict]:
        """Every grant of this ledger (after execution id `after`), oldest first, as recorded
        (lineage.grant_records)."""
        return lineage.grant_records(self._records, after)

    def denial_records(self, after: int = 0) -> list[dict]:
        """Every request this ledger refused for lack of budget (after execution id `after`),
        oldest first (lineage.denial_records)."""
        return lineage.denial_records(self._records, after)

    def release_outcomes(self, grant_ids: Iterable[str]) -> dict[str, dict[str, dict]]:
        """{grant id: {step: what became of it}} for `grant_ids` (the `steps` of
        grant_records): for a reader that re-reads the grants whose outcome was recorded."""
        return self._records.outcomes(set(grant_ids))

    def latest_change(self) -> int:
        """The id of the newest execution of this ledger context (lineage.latest_change)."""
        return lineage.latest_change(self._records)

    def changes(self, after: int = 0) -> list[dict]:
        """What changed after execution id `after`, and which blocks (lineage.changes)."""
        return lineage.changes(self._records, after)

    def grant_run(self, grant_id: str) -> dict:
        """The run that spent `grant_id` and its artifacts (lineage.grant_run)."""
        return lineage.grant_run(self._records, self.find_grant(grant_id))

    def audit(self) -> lineage.Audit:
        """Re-derive every balance from the append-only history: the inconsistencies found
        (`.problems`) and how many blocks and grants were read (lineage.audit). Reads the whole
        history: for tests and operators, never on the grant path."""
        return lineage.audit(self._records, self.accounting, self.blocks())


def _check_selector(selector) -> None:
    if getattr(selector, "data_format", None) not in (None, *DATA_FORMATS):
        raise BadRequest(f"the selector's data_format must be one of {DATA_FORMATS}, got "
                         f"{selector.data_format!r}")
    if isinstance(selector, BlockIds):
        if not selector.ids:
            raise BadRequest("the block selector is empty")
        for block_id in selector.ids:
            check_name(block_id, "block id")
        if len(set(selector.ids)) != len(selector.ids):
            raise BadRequest(f"the block selector names a block twice: {list(selector.ids)}")
    elif isinstance(selector, RecentWindow):
        if not isinstance(selector.size, int) or selector.size < 1:
            raise BadRequest(f"window size must be a positive integer, got {selector.size!r}")
    else:
        raise BadRequest(f"unknown selector {selector!r}")


def _check_data(blocks: Sequence[BlockState]) -> None:
    """BadRequest naming the blocks that have no Examples registered."""
    without_data = [block.block_id for block in blocks if not block.data_uri]
    if without_data:
        raise BadRequest(f"block(s) {', '.join(without_data)} have no Examples registered "
                         "(added without data); nothing was charged")
