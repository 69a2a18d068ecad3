"""The BlockLedger's record codec: how its state is written to and read from ML Metadata.

Record types (custom properties only, so Kubeflow V2 accepts them):

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
  what components derived from them), named `<context>/grant-<id>/data/<digest of the uri>`.
* `sage_tfx.ShareUse` artifact per consumed share, named `<context>/grant-<id>/share/<step>`.
* `sage_tfx.ReleaseOutcome` artifact per step of a grant's split, named
  `<context>/grant-<id>/outcome/<step>`: what became of the step's share (released with its
  artifacts, failed with a public reason, interrupted); create-once, written by the release
  protocol (sage_tfx.release). A step without one is still running, or its process was killed.
* `sage_tfx.Denial` execution per request the ledger refused for lack of budget: who asked
  (front door, pipeline, request text), how much, and what each block had free.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
from ml_metadata import errors as mlmd_errors
from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access.accounting import split_share
from sage_tfx.sage_access.allocation import BlockState
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.exact import exact_decimal, exact_text, exact_vector
from sage_tfx.sage_access.store import STATE_TYPE

LEDGER_CONTEXT_TYPE = "sage_tfx.Ledger"
RUN_CONTEXT_TYPE = "sage_tfx.PipelineRun"
TFX_RUN_CONTEXT_TYPE = "pipeline_run"  # the context TFX's orchestrators create per run
KFP_RUN_CONTEXT_TYPE = "system.PipelineRun"  # Kubeflow Pipelines 2's launcher's, named by run id
LEDGER_VERSION_TYPE = "sage_tfx.LedgerVersion"
BLOCK_TYPE = "sage_tfx.Block"
BLOCK_VERSION_TYPE = "sage_tfx.BlockVersion"
GRANT_TYPE = "sage_tfx.Grant"
GRANT_DATA_TYPE = "sage_tfx.GrantData"
SHARE_USE_TYPE = "sage_tfx.ShareUse"
GRANT_PIN_TYPE = "sage_tfx.GrantPin"
RELEASE_OUTCOME_TYPE = "sage_tfx.ReleaseOutcome"
UPDATE_TYPE = "sage_tfx.LedgerUpdate"
DENIAL_TYPE = "sage_tfx.Denial"

# Up to this many grants, `outcomes` reads their records by a filter query instead of the type.
_OUTCOMES_BY_FILTER = 100
_GRANT_ID = re.compile(r"[0-9a-f]{32}")

# The step name of the outcome of a grant made without a split (e.g. `sage-tfx ledger request`).
WHOLE_GRANT = "all"
# Types a store made before grant binding (or release records) lacks (LedgerRecords.__init__).
_GRANT_BINDING_TYPES = (GRANT_DATA_TYPE, SHARE_USE_TYPE, GRANT_PIN_TYPE, RELEASE_OUTCOME_TYPE)
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}$")


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


def check_name(value: str, what: str) -> str:
    """`value` if it can name a record (ledger context, block, pipeline, run), else BadRequest."""
    if not isinstance(value, str) or not _NAME_PATTERN.match(value):
        raise BadRequest(f"{what} {value!r} must be 1-128 characters of letters, digits and ._:+- "
                         "(starting with a letter or digit)")
    return value


# ML Metadata's MySQL schema keeps int_value in a 32-bit INT column (SQLite stores 64 bits): an
# int outside it (a time in ms, an id) is written as a double instead, the same on both backends,
# and get_property gives it back as an int (the ledger writes its floats as strings, so a
# double_value is always such an int). Exact below 10**15: MLMD's SQLite backend keeps 15
# significant digits of a double (measured: 10**15 + 1 reads back as 10**15).
_INT32 = range(-2**31, 2**31)
_EXACT_IN_DOUBLE = 10**15


def set_properties(node, values: dict) -> None:
    """Write `values` as custom properties of an MLMD node (None: left out; floats: exact;
    ints: exact below 10**15 in magnitude, ValueError beyond)."""
    for key, value in values.items():
        if value is None:
            continue
        target = node.custom_properties[key]
        if isinstance(value, bool):
            target.int_value = int(value)
        elif isinstance(value, int) and value in _INT32:
            target.int_value = value
        elif isinstance(value, int):
            if abs(value) >= _EXACT_IN_DOUBLE:
                raise ValueError(f"property {key!r}: {value} is not below 10**15, which ML "
                                 "Metadata cannot store exactly as a number; write it as a string")
            target.double_value = float(value)
        elif isinstance(value, float):
            target.string_value = exact_decimal(value)
        else:
            target.string_value = str(value)


def get_property(node, key: str, default=None):
    if key not in node.custom_properties:
        return default
    value = node.custom_properties[key]
    kind = value.WhichOneof("value")
    if kind == "double_value":  # an int beyond 32 bits (set_properties)
        return int(value.double_value)
    return getattr(value, kind) if kind else default


def get_float(node, key: str) -> Optional[float]:
    value = get_property(node, key)
    return None if value is None else float(value)


def encode_vector(values: np.ndarray) -> str:
    """A budget vector as JSON: each value's exact text (decode_vector reads it back exactly)."""
    return json.dumps([exact_text(v) for v in values])


def decode_vector(text: str) -> np.ndarray:
    """The exact budget vector of `encode_vector`'s JSON (a ledger written before budgets were
    exact holds doubles: each reads as the decimal it is written as)."""
    return exact_vector(json.loads(text))


def output_event() -> pb.Event:
    return pb.Event(type=pb.Event.OUTPUT)


def input_event() -> pb.Event:
    return pb.Event(type=pb.Event.INPUT)


def register_types(mlmd: metadata_store.MetadataStore) -> None:
    for name in (STATE_TYPE, LEDGER_VERSION_TYPE, BLOCK_TYPE, BLOCK_VERSION_TYPE,
                 *_GRANT_BINDING_TYPES):
        mlmd.put_artifact_type(pb.ArtifactType(name=name))
    for name in (GRANT_TYPE, UPDATE_TYPE, DENIAL_TYPE):
        mlmd.put_execution_type(pb.ExecutionType(name=name))
    for name in (LEDGER_CONTEXT_TYPE, RUN_CONTEXT_TYPE):
        mlmd.put_context_type(pb.ContextType(name=name))


def new_ledger_state(mlmd: metadata_store.MetadataStore, context: str, accounting,
                     min_request_epsilon: float, for_tests: bool = False) -> pb.Artifact:
    """The first LedgerState of ledger `context` (no pipeline waiting, version 1); `for_tests`
    (BlockLedger.create) is recorded once and never changes."""
    state = pb.Artifact(type_id=mlmd.get_artifact_type(STATE_TYPE).id,
                        name=f"{context}/state", external_id=f"state:{context}")
    set_properties(state, {"ledger": context, "accounting": accounting.name,
                           "orders": json.dumps(list(accounting.orders)),
                           "min_request_epsilon": float(min_request_epsilon),
                           "for_tests": bool(for_tests), "waiting": "[]", "version": 1})
    return state


def ledger_filter(type_name: str, context: str) -> str:
    """An MLMD filter query for the records of `type_name` attributed to ledger `context`."""
    return (f"type = '{type_name}' AND "
            f"custom_properties.ledger.string_value = '{context}'")


class LedgerRecords:
    """The records of one ledger context in one store: finding, decoding and encoding them."""

    def __init__(self, store: metadata_store.MetadataStore, context: str,
                 lookup_only: bool = False):
        """`lookup_only`: read the type ids without registering any type (read-only stores)."""
        self.store = store
        self.context = check_name(context, "ledger context")
        if not lookup_only:
            register_types(store)
        self.types = {name: store.get_artifact_type(name).id
                      for name in (STATE_TYPE, LEDGER_VERSION_TYPE, BLOCK_TYPE, BLOCK_VERSION_TYPE)}
        # A store made before grant binding lacks these types: a reader needs no id for them (it
        # finds none of their records), and a writer registered them above.
        for name in _GRANT_BINDING_TYPES:
            try:
                self.types[name] = store.get_artifact_type(name).id
            except mlmd_errors.NotFoundError:
                if not lookup_only:
                    raise
        for name in (GRANT_TYPE, UPDATE_TYPE):
            self.types[name] = store.get_execution_type(name).id
        try:  # a writer registered it above; a reader of an older store finds no denials
            self.types[DENIAL_TYPE] = store.get_execution_type(DENIAL_TYPE).id
        except mlmd_errors.NotFoundError:
            pass
        self.context_node = store.get_context_by_type_and_name(LEDGER_CONTEXT_TYPE, context)
        if self.context_node is None:
            raise BadRequest(f"no ledger context {context!r} in this store; run `init` first")

    # ----------------------------------------------------------------- ledger state
    def by_external_ids(self, external_ids: list[str], reader=None,
                        lock: bool = False, versions=None) -> list[pb.Artifact]:
        """The artifacts with these external ids, read from `reader` (default: the store; or a
        MySQL transaction of Transactions.session, which with `lock` keeps them locked until
        it commits, and reads `versions`, mysql_commit.VersionRecords, in the same round
        trip)."""
        try:
            if lock and reader is not None:
                return reader.get_artifacts_by_external_ids(external_ids, lock=True,
                                                            versions=versions)
            return (reader or self.store).get_artifacts_by_external_ids(external_ids)
        except mlmd_errors.NotFoundError:  # MLMD raises instead of returning nothing
            return []

    def read_state(self) -> pb.Artifact:
        found = self.by_external_ids([f"state:{self.context}"])
        if not found:
            raise BadRequest(f"ledger context {self.context!r} has no state record")
        return found[0]

    # ----------------------------------------------------------------- blocks
    def block_artifacts(self, block_ids: Sequence[str], reader=None,
                        versions=None) -> list[pb.Artifact]:
        """The blocks' artifacts, in the order of `block_ids` (locked in a MySQL transaction
        `reader`, with their `versions`: by_external_ids); BadRequest naming those this ledger
        does not have."""
        external = [f"block:{self.context}/{b}" for b in block_ids]
        found = {get_property(a, "block_id"): a
                 for a in self.by_external_ids(external, reader, lock=True, versions=versions)}
        unknown = [b for b in block_ids if b not in found]
        if unknown:
            raise BadRequest(f"unknown block(s) in ledger {self.context!r}: {', '.join(unknown)}")
        return [found[b] for b in block_ids]

    def version_name(self, block_id: str, version: int) -> str:
        """The unique name of a block's BlockVersion record `version` (transaction.py); its
        external id is `version_external_id`'s."""
        return f"{self.context}/{block_id}/v{version}"

    def version_external_id(self, block_id: str, version: int) -> str:
        """The external id of a block's BlockVersion record `version`, which finds it in one
        indexed lookup (lineage.check_balances): "version:" and its name."""
        return f"{self.version_prefix}{block_id}/v{version}"

    @property
    def version_prefix(self) -> str:
        """What the external ids of this ledger's BlockVersion records start with."""
        return f"version:{self.context}/"

    def block_exists(self, block_id: str) -> bool:
        return bool(self.by_external_ids([f"block:{self.context}/{block_id}"]))

    def all_blocks(self) -> list[pb.Artifact]:
        """Every block of this ledger, in arrival order (retired ones included)."""
        return self._of_this_ledger(self.store.get_artifacts_by_type(BLOCK_TYPE))

    def _of_this_ledger(self, nodes: list) -> list:
        """Those of `nodes` (all of one type) recorded for this ledger context, by id. Reading a
        whole type and keeping ours is several times faster in ML Metadata than a filter query
        on a custom property, which it pages 100 rows at a time (3x-4x at 10,000 blocks or
        20,000 grants)."""
        return sorted((node for node in nodes if get_property(node, "ledger") == self.context),
                      key=lambda node: node.id)

    def live_blocks_newest_first(self, page: int) -> Iterable[pb.Artifact]:
        """Non-retired blocks, most recent arrival first, read page by page."""
        last_id = None
        while True:
            query = (ledger_filter(BLOCK_TYPE, self.context)
                     + " AND custom_properties.retired.int_value = 0")
            if last_id is not None:
                query += f" AND id < {last_id}"
            batch = self.store.get_artifacts(list_options=metadata_store.ListOptions(
                limit=page, order_by=metadata_store.OrderByField.ID, is_asc=False,
                filter_query=query))
            yield from batch
            if len(batch) < page:
                return
            last_id = batch[-1].id

    def new_block(self, block_id: str, epsilon: float, delta: float, start: Optional[str],
                  end: Optional[str], data_uri: Optional[str],
                  data_format: Optional[str] = None) -> pb.Artifact:
        """A block's artifact before its first version (write it with `updated_block`)."""
        artifact = pb.Artifact(type_id=self.types[BLOCK_TYPE], name=f"{self.context}/{block_id}",
                               external_id=f"block:{self.context}/{block_id}")
        set_properties(artifact, {"ledger": self.context, "block_id": block_id, "start": start,
                                  "end": end, "data_uri": data_uri,
                                  "data_format": data_format,
                                  "epsilon_ceiling": float(epsilon),
                                  "delta_ceiling": float(delta), "version": 0})
        return artifact

    @staticmethod
    def block_state(artifact: pb.Artifact, accounting) -> BlockState:
        epsilon_g = get_float(artifact, "epsilon_ceiling")
        delta_g = get_float(artifact, "delta_ceiling")
        return BlockState(
            block_id=get_property(artifact, "block_id"), epsilon_ceiling=epsilon_g,
            delta_ceiling=delta_g, capacity=accounting.capacity(epsilon_g, delta_g),
            spent=decode_vector(get_property(artifact, "spent")),
            reservations={k: exact_vector(v) for k, v in
                          json.loads(get_property(artifact, "reservations")).items()},
            retired=bool(get_property(artifact, "retired")),
            charges=get_property(artifact, "charges"), start=get_property(artifact, "start"),
            end=get_property(artifact, "end"), data_uri=get_property(artifact, "data_uri"),
            data_format=get_property(artifact, "data_format"))

    @staticmethod
    def updated_block(artifact: pb.Artifact, block: BlockState, accounting) -> pb.Artifact:
        """A copy of the block's artifact holding `block`'s balance, one version on."""
        updated = pb.Artifact()
        updated.CopyFrom(artifact)
        epsilon_spent, delta_spent = accounting.guarantee(
            block.spent, block.epsilon_ceiling, block.delta_ceiling)
        set_properties(updated, {
            "spent": encode_vector(block.spent),
            "reservations": json.dumps({k: json.loads(encode_vector(v))
                                        for k, v in block.reservations.items()}),
            "retired": block.retired, "charges": block.charges,
            # basic: the sums spent; rdp: the filter's guarantee (never an odometer reading).
            "guarantee_epsilon": epsilon_spent, "guarantee_delta": delta_spent,
            "version": get_property(artifact, "version") + 1})
        return updated

    # ----------------------------------------------------------------- grants
    @staticmethod
    def grant_properties(grant: Grant, run_id: Optional[str], demand: np.ndarray,
                         front_door: Optional[str], request: Optional[str]) -> dict:
        """The Grant execution's properties (the source of truth about the grant), with the front
        door that asked for it and the request's text (SQL, spec, pipeline and component)."""
        return {"grant_id": grant.grant_id, "pipeline": grant.pipeline, "run_id": run_id,
                "front_door": front_door, "request": request,
                "blocks": json.dumps(list(grant.blocks)), "demand": encode_vector(demand),
                "epsilon": grant.epsilon, "delta": grant.delta,
                "rdp_curve": json.dumps(list(grant.rdp_curve)) if grant.rdp_curve else None,
                "split": json.dumps(dict(grant.split)), "events": json.dumps(dict(grant.events))}

    def grant_execution(self, grant_id: str) -> Optional[pb.Execution]:
        execution = self.store.get_execution_by_type_and_name(GRANT_TYPE, f"grant-{grant_id}")
        if execution is None or get_property(execution, "ledger") != self.context:
            return None
        return execution

    def grant_executions(self, after: int = 0) -> list[pb.Execution]:
        """This ledger's Grant executions, oldest first; with `after`, those whose id is larger."""
        if not after:
            return self._of_this_ledger(self.store.get_executions_by_type(GRANT_TYPE))
        return self.store.get_executions(list_options=metadata_store.ListOptions(
            order_by=metadata_store.OrderByField.ID, is_asc=True,
            filter_query=f"{ledger_filter(GRANT_TYPE, self.context)} AND id > {int(after)}"))

    def grant_of(self, execution: pb.Execution) -> Grant:
        """A Grant execution of this ledger, decoded."""
        curve = get_property(execution, "rdp_curve")
        return Grant(grant_id=get_property(execution, "grant_id"), context=self.context,
                     blocks=tuple(json.loads(get_property(execution, "blocks"))),
                     epsilon=get_float(execution, "epsilon"),
                     delta=get_float(execution, "delta"),
                     rdp_curve=tuple(json.loads(curve)) if curve else None,
                     pipeline=get_property(execution, "pipeline"), execution_id=execution.id,
                     split=json.loads(get_property(execution, "split", "{}")),
                     events=json.loads(get_property(execution, "events", "{}")))

    # ------------------------------------------------- what a grant released and who used it
    # Append-only records named `<context>/grant-<id>/<kind>/<key>`: the unique name makes a
    # second record of the same data or share fail as a whole (see transaction.py).
    def _grant_record(self, type_name: str, grant_id: str, kind: str, key: str,
                      **values) -> pb.Artifact:
        record = pb.Artifact(type_id=self.types[type_name],
                             name=f"{self.context}/grant-{grant_id}/{kind}/{key}")
        set_properties(record, dict(values, ledger=self.context, grant_id=grant_id))
        return record

    def _recorded(self, record: pb.Artifact, type_name: str) -> Optional[pb.Artifact]:
        """The stored record of `type_name` with `record`'s name (None if there is none)."""
        return self.store.get_artifact_by_type_and_name(type_name, record.name)

    @staticmethod
    def _data_key(uri: str) -> str:
        return hashlib.sha256(uri.encode()).hexdigest()[:32]

    def data_record(self, grant_id: str, uri: str, producer: str) -> pb.Artifact:
        """The record that `grant_id` released (or `producer` derived from it) data at `uri`."""
        return self._grant_record(GRANT_DATA_TYPE, grant_id, "data", self._data_key(uri),
                                  uri=uri, producer=producer)

    def has_data(self, grant_id: str, uri: str) -> bool:
        return self.data_producer(grant_id, uri) is not None

    def data_producer(self, grant_id: str, uri: str) -> Optional[str]:
        """Who wrote `grant_id`'s data at `uri` (None if no data is recorded there)."""
        record = self._recorded(self.data_record(grant_id, uri, ""), GRANT_DATA_TYPE)
        if record is None or get_property(record, "uri") != uri:
            return None
        return get_property(record, "producer")

    def share_use_record(self, grant_id: str, step: str, consumer: str) -> pb.Artifact:
        """The record that `consumer` used `step`'s share of `grant_id`."""
        return self._grant_record(SHARE_USE_TYPE, grant_id, "share", step, step=step,
                                  consumer=consumer)

    def pin_record(self, grant_id: str, name: str, digest: str) -> pb.Artifact:
        """The record that `grant_id`'s output `name` was computed from data of `digest`."""
        return self._grant_record(GRANT_PIN_TYPE, grant_id, "pin", name, digest=digest)

    def pinned_digest(self, grant_id: str, name: str) -> Optional[str]:
        """The digest `name` of `grant_id` is pinned to (None if it is not pinned)."""
        record = self._recorded(self.pin_record(grant_id, name, ""), GRANT_PIN_TYPE)
        return None if record is None else get_property(record, "digest")

    def share_consumer(self, grant_id: str, step: str) -> Optional[str]:
        """Who consumed `step`'s share of `grant_id` (None if nobody recorded it)."""
        record = self._recorded(self.share_use_record(grant_id, step, ""), SHARE_USE_TYPE)
        return None if record is None else get_property(record, "consumer")

    # ------------------------------------------------- what became of a grant, and denials
    def outcome_record(self, grant_id: str, step: str, outcome: str, front_door: str,
                       reason: Optional[str], artifacts: Sequence[str],
                       guarantee: Optional[str]) -> pb.Artifact:
        """The record of what became of `step`'s share of `grant_id` (create-once)."""
        return self._grant_record(RELEASE_OUTCOME_TYPE, grant_id, "outcome", step, step=step,
                                  outcome=outcome, front_door=front_door, reason=reason,
                                  artifacts=json.dumps(list(artifacts)), guarantee=guarantee)

    def outcomes(self, grant_ids: Optional[set] = None) -> dict[str, dict[str, dict]]:
        """{grant id: {step: {"outcome", "front_door", "reason", "artifacts"}}} of this ledger
        (of `grant_ids` only, when given); a store without the type has none."""
        if RELEASE_OUTCOME_TYPE not in self.types or (grant_ids is not None and not grant_ids):
            return {}
        if grant_ids is not None and len(grant_ids) <= _OUTCOMES_BY_FILTER and all(
                _GRANT_ID.fullmatch(grant_id) for grant_id in grant_ids):
            # A few grants (a reader following new ones): only their records, not every
            # outcome ever recorded (ids checked above, so they can be quoted in the query).
            quoted = ", ".join(f"'{grant_id}'" for grant_id in sorted(grant_ids))
            records = self.store.get_artifacts(list_options=metadata_store.ListOptions(
                order_by=metadata_store.OrderByField.ID, is_asc=True,
                filter_query=f"{ledger_filter(RELEASE_OUTCOME_TYPE, self.context)} AND "
                             f"custom_properties.grant_id.string_value IN ({quoted})"))
        else:
            records = self._of_this_ledger(self.store.get_artifacts_by_type(RELEASE_OUTCOME_TYPE))
        found: dict[str, dict[str, dict]] = {}
        for record in records:
            grant_id = get_property(record, "grant_id")
            if grant_ids is not None and grant_id not in grant_ids:
                continue
            found.setdefault(grant_id, {})[get_property(record, "step")] = {
                "outcome": get_property(record, "outcome"),
                "front_door": get_property(record, "front_door"),
                "reason": get_property(record, "reason"),
                "guarantee": get_property(record, "guarantee"),
                "artifacts": json.loads(get_property(record, "artifacts", "[]"))}
        return found

    def denial_executions(self, after: int = 0) -> list[pb.Execution]:
        """This ledger's Denial executions, oldest first (none in a store without the type);
        with `after`, those whose id is larger."""
        if DENIAL_TYPE not in self.types:
            return []
        if not after:
            return self._of_this_ledger(self.store.get_executions_by_type(DENIAL_TYPE))
        return self.store.get_executions(list_options=metadata_store.ListOptions(
            order_by=metadata_store.OrderByField.ID, is_asc=True,
            filter_query=f"{ledger_filter(DENIAL_TYPE, self.context)} AND id > {int(after)}"))
