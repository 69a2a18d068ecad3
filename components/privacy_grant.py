"""The PrivacyGrant artifact and the check every DP component runs before touching data.

docs/architecture.md, "No data without a grant": a DP component takes the PrivacyGrant and refuses
Examples that do not come with a grant covering them. `require_grant` is that check:

    grant = require_grant(input_dict["grant"], input_dict["examples"])
    epsilon, delta = grant.share("training")   # consumes the share, once, in the ledger

The ledger is the source of truth, never what an artifact says about itself:
1. the grant named by the artifact must be recorded in the ledger the artifact names, with the
   same blocks, budget and split (a hand-made or edited PrivacyGrant is refused);
2. every Examples artifact must sit at a location the ledger recorded as this grant's data: the
   BlockLedger component's output, or what a component derived from it and recorded
   (`carry_grant`). Copied custom properties prove nothing;
3. `share(step)` records the consumption of the step's share in the ledger with one atomic,
   uniquely named MLMD record, so a second trainer or validator on the same share (same DAG,
   a later run, an Importer) is refused.
Trust boundary: the ledger store itself. Whoever can write it can issue grants.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from tfx.types import artifact

from sage_tfx.sage_access.accounting import pure_dp_event, split_share
from sage_tfx.sage_access.errors import BadRequest

# Custom properties that name the grant on Examples (for people and UIs; never trusted).
EXAMPLES_GRANT_ID = "sage_grant_id"
EXAMPLES_BLOCKS = "sage_blocks"
EXAMPLES_CONTEXT = "sage_ledger_context"


class PrivacyGrant(artifact.Artifact):
    """A ledger grant: blocks, total (epsilon, delta) and its split among the iteration's DP steps.

    Custom properties only (Kubeflow V2 compiles custom artifact types with no typed PROPERTIES):
    grant_id, ledger_store, ledger_context, blocks (JSON), epsilon, delta, rdp_curve (JSON, when
    the grant was an RDP curve), split (JSON {step: fraction}), pipeline.
    """

    TYPE_NAME = "sage_tfx.PrivacyGrant"


class GrantError(BadRequest):
    """Examples without a grant that covers them, or a grant the ledger did not issue."""


@dataclass
class GrantInfo:
    """A grant as the ledger recorded it, checked against the PrivacyGrant artifact."""
    grant_id: str
    ledger_store: str
    ledger_context: str
    blocks: tuple[str, ...]
    epsilon: Optional[float]
    delta: Optional[float]
    split: dict[str, str]
    consumer: str
    _ledger: Any = field(repr=False)
    _record: Any = field(repr=False)
    _used: dict = field(default_factory=dict, repr=False)

    def share(self, step: str) -> tuple[float, float]:
        """(epsilon, delta) this grant allots to the DP step `step`, consumed in the ledger: the
        first call records the use atomically; any other consumer of this share is refused."""
        if step not in self._used:
            try:
                self._used[step] = self._ledger.use_share(self._record, step, self.consumer)
            except BadRequest as error:
                raise GrantError(str(error)) from None
        return self._used[step]

    def event(self, step: str):
        """The dp-accounting event the ledger recorded for `step` (None if it recorded none)."""
        return self._ledger.grant_event(self._record, step)

    def check_event(self, step: str, ran) -> None:
        """Refuse to release unless what ran (`ran`, a DpEvent) is what the grant recorded for
        `step`: the ledger charged the recorded event, so anything else is unaccounted."""
        recorded = self.event(step)
        if recorded is not None and recorded != ran:
            raise GrantError(f"step {step!r} of grant {self.grant_id} ran {ran}, but the ledger "
                             f"recorded and charged {recorded}; nothing was released")

    def record_data(self, uri: str, producer: str) -> None:
        """Record data derived from this grant's Examples at `uri` (see carry_grant)."""
        self._ledger.record_data(self._record, uri, producer)


# What each DP step runs, as a function of its share and public parameters (issue 17 §1): the
# BlockLedger component records these events in the grant, and each component checks that what
# it ran is what was recorded (GrantInfo.check_event).
MECHANISMS = ("adassp", "laplace", "dp_sgd")


def planned_event(mechanism: Mapping[str, Any], epsilon: float, delta: float):
    """The dp-accounting event a step of this mechanism runs on an (epsilon, delta) share, or
    None when it cannot be known before the step runs.

    * adassp: three self-composed Gaussians at the calibrated noise multiplier (adassp.py);
    * laplace: any epsilon-DP step made of Laplace releases whose epsilons sum to its share
      (SLAedValidator, DPTransform's analyzers), recorded as its zCDP bound;
    * dp_sgd: None. Its steps depend on the sampling: SWO and shuffling on the data's size,
      Poisson on a truncation probability that adds a delta an RDP curve cannot carry, so an
      rdp ledger refuses it (a basic ledger charges its (epsilon, delta) share).
    """
    name = mechanism.get("mechanism")
    if name == "adassp":
        from sage_tfx.components.dp_trainer import adassp
        return adassp.planned_event(epsilon, delta)
    if name == "laplace":
        return pure_dp_event(epsilon)
    if name == "dp_sgd":
        return None
    raise BadRequest(f"unknown DP mechanism {name!r}; use one of {MECHANISMS}")


def step_events(mechanisms: dict, split: dict[str, str], epsilon: float, delta: float,
                 accounting: str) -> dict:
    """{step: the DpEvent it will run on its share of (epsilon, delta)}, for the steps whose
    mechanism is named; an rdp ledger (accounting "rdp") refuses a step without an event."""
    unknown = sorted(set(mechanisms) - set(split))
    if unknown:
        raise BadRequest(f"step_mechanisms names step(s) {unknown} that the split {split} lacks")
    events = {}
    for step, mechanism in mechanisms.items():
        event = planned_event(mechanism, *split_share(epsilon, delta, split, step))
        if event is None and accounting == "rdp":
            raise BadRequest(f"step {step!r} ({mechanism['mechanism']}) has no DP event before "
                             "it runs, so an rdp ledger cannot charge it (see "
                             "privacy_grant.planned_event); use a basic ledger")
        if event is not None:
            events[step] = event
    return events


def write_grant(target: PrivacyGrant, grant, ledger_store: str) -> None:
    """Fill a PrivacyGrant artifact from a ledger `Grant`."""
    target.set_string_custom_property("grant_id", grant.grant_id)
    target.set_string_custom_property("ledger_store", ledger_store)
    target.set_string_custom_property("ledger_context", grant.context)
    target.set_string_custom_property("blocks", json.dumps(list(grant.blocks)))
    # Exact decimal strings: ML Metadata 1.17's SQLite backend rounds doubles to 6 decimal places.
    if grant.epsilon is not None:
        target.set_string_custom_property("epsilon", repr(grant.epsilon))
    if grant.delta is not None:
        target.set_string_custom_property("delta", repr(grant.delta))
    if grant.rdp_curve is not None:
        target.set_string_custom_property("rdp_curve", json.dumps(list(grant.rdp_curve)))
    target.set_string_custom_property("split", json.dumps(dict(grant.split)))
    if grant.pipeline:
        target.set_string_custom_property("pipeline", grant.pipeline)


def mark_examples(examples: artifact.Artifact, grant, blocks: Sequence[str]) -> None:
    """Name the grant on Examples it released (informative: `require_grant` asks the ledger)."""
    examples.set_string_custom_property(EXAMPLES_GRANT_ID, grant.grant_id)
    examples.set_string_custom_property(EXAMPLES_BLOCKS, json.dumps(list(blocks)))
    examples.set_string_custom_property(EXAMPLES_CONTEXT, grant.context)


def carry_grant(grant: GrantInfo, target: artifact.Artifact, producer: str) -> None:
    """Examples derived from granted Examples (samples, transformed records): record their
    location in the ledger as the grant's data, and name the grant on them."""
    grant.record_data(target.uri, producer)
    target.set_string_custom_property(EXAMPLES_GRANT_ID, grant.grant_id)
    target.set_string_custom_property(EXAMPLES_BLOCKS, json.dumps(list(grant.blocks)))
    target.set_string_custom_property(EXAMPLES_CONTEXT, grant.ledger_context)


def _single(artifacts, what: str) -> artifact.Artifact:
    if isinstance(artifacts, artifact.Artifact):
        return artifacts
    artifacts = list(artifacts or [])
    if len(artifacts) != 1:
        raise GrantError(f"expected exactly one {what} artifact, got {len(artifacts)}")
    return artifacts[0]


def require_grant(grant_artifacts, examples_artifacts: Sequence[artifact.Artifact],
                  consumer: Optional[str] = None) -> GrantInfo:
    """The grant as the ledger recorded it, after checking the artifact against it and every
    Examples artifact against the grant's recorded data (see the module docstring)."""
    from sage_tfx.sage_access.ledger import BlockLedger
    from sage_tfx.sage_access.store import parse

    grant_artifact = _single(grant_artifacts, "PrivacyGrant")
    if grant_artifact.type_name != PrivacyGrant.TYPE_NAME:
        raise GrantError(f"expected a {PrivacyGrant.TYPE_NAME} artifact, got "
                         f"{grant_artifact.type_name}")
    grant_id = grant_artifact.get_string_custom_property("grant_id")
    store = grant_artifact.get_string_custom_property("ledger_store")
    context = grant_artifact.get_string_custom_property("ledger_context")
    if not (grant_id and store and context):
        raise GrantError("the PrivacyGrant artifact does not name its grant_id, ledger_store and "
                         "ledger_context")
    examples_artifacts = list(examples_artifacts or [])
    if not examples_artifacts:
        raise GrantError("no Examples were given with the grant")
    try:
        ledger = BlockLedger(parse(store), context)
        issued = ledger.find_grant(grant_id)
    except BadRequest as error:
        raise GrantError(f"PrivacyGrant {grant_id} was not issued by ledger {context!r} at "
                         f"{store}: {error}") from None
    props = grant_artifact.mlmd_artifact.custom_properties
    claimed = {
        "blocks": json.loads(grant_artifact.get_string_custom_property("blocks") or "[]"),
        "epsilon": float(props["epsilon"].string_value) if "epsilon" in props else None,
        "delta": float(props["delta"].string_value) if "delta" in props else None,
        "split": json.loads(grant_artifact.get_string_custom_property("split") or "{}")}
    recorded = {"blocks": list(issued.blocks), "epsilon": issued.epsilon, "delta": issued.delta,
                "split": dict(issued.split)}
    differ = sorted(key for key in recorded if claimed[key] != recorded[key])
    if differ:
        raise GrantError(f"PrivacyGrant {grant_id} does not match the ledger's record ("
                         + "; ".join(f"{key}: artifact {claimed[key]}, ledger {recorded[key]}"
                                     for key in differ) + ")")
    for examples in examples_artifacts:
        try:
            ledger.require_data(issued, examples.uri)
        except BadRequest as error:
            raise GrantError(f"Examples at {examples.uri} come without a grant that covers them: "
                             f"{error}; only Examples emitted by the BlockLedger component under "
                             "this grant, or derived from them, may be used") from None
    return GrantInfo(grant_id=grant_id, ledger_store=store, ledger_context=context,
                     blocks=tuple(issued.blocks), epsilon=issued.epsilon, delta=issued.delta,
                     split=dict(issued.split),
                     consumer=consumer or f"the component reading {examples_artifacts[0].uri}",
                     _ledger=ledger, _record=issued)
