"""The PrivacyGrant artifact and the check every DP component runs before touching data.

DESIGN.md, "No data without a grant": a DP component takes the PrivacyGrant and refuses Examples
that do not come with a grant covering them. `require_grant` is that check:

    grant = require_grant(input_dict["grant"], input_dict["examples"])
    epsilon, delta = grant.share("training")

It verifies that (1) every Examples artifact was emitted under this grant and holds only blocks
the grant names, and (2) the ledger that the grant names really issued it with those blocks and
that budget, so a hand-made PrivacyGrant artifact is refused.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from tfx.types import artifact

from sage_tfx.sage_access.errors import BadRequest

# Custom properties that tie granted Examples to their grant.
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


@dataclass(frozen=True)
class GrantInfo:
    grant_id: str
    ledger_store: str
    ledger_context: str
    blocks: tuple[str, ...]
    epsilon: Optional[float]
    delta: Optional[float]
    split: Mapping[str, float]

    def share(self, step: str) -> tuple[float, float]:
        """(epsilon, delta) this grant allots to the DP step `step`."""
        if step not in self.split:
            raise GrantError(f"grant {self.grant_id} has no share for step {step!r}; its split is "
                             f"{dict(self.split)}")
        if self.epsilon is None:
            raise GrantError(f"grant {self.grant_id} is an RDP curve; it has no (epsilon, delta) "
                             "shares")
        fraction = self.split[step]
        return self.epsilon * fraction, (self.delta or 0.0) * fraction


def check_split(split: Mapping[str, float]) -> dict[str, float]:
    """A split of the grant among named DP steps: positive fractions summing to at most 1."""
    if not split:
        raise BadRequest("the budget split is empty")
    clean = {}
    for step, fraction in split.items():
        fraction = float(fraction)
        if not isinstance(step, str) or not step or not math.isfinite(fraction) or fraction <= 0:
            raise BadRequest(f"split step {step!r} needs a positive finite fraction, got {fraction!r}")
        clean[step] = fraction
    if sum(clean.values()) > 1 + 1e-9:
        raise BadRequest(f"the split fractions sum to {sum(clean.values())} > 1: {clean}")
    return clean


def write_grant(target: PrivacyGrant, grant, ledger_store: str, split: Mapping[str, float]) -> None:
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
    target.set_string_custom_property("split", json.dumps(dict(split)))
    if grant.pipeline:
        target.set_string_custom_property("pipeline", grant.pipeline)


def mark_examples(examples: artifact.Artifact, grant, blocks: Sequence[str]) -> None:
    """Tie an Examples artifact to the grant it was released under."""
    examples.set_string_custom_property(EXAMPLES_GRANT_ID, grant.grant_id)
    examples.set_string_custom_property(EXAMPLES_BLOCKS, json.dumps(list(blocks)))
    examples.set_string_custom_property(EXAMPLES_CONTEXT, grant.context)


def carry_grant(source: artifact.Artifact, target: artifact.Artifact) -> None:
    """Mark Examples derived from granted Examples (e.g. samples) with the same grant."""
    for key in (EXAMPLES_GRANT_ID, EXAMPLES_BLOCKS, EXAMPLES_CONTEXT):
        target.set_string_custom_property(key, source.get_string_custom_property(key))


def _single(artifacts, what: str) -> artifact.Artifact:
    if isinstance(artifacts, artifact.Artifact):
        return artifacts
    artifacts = list(artifacts or [])
    if len(artifacts) != 1:
        raise GrantError(f"expected exactly one {what} artifact, got {len(artifacts)}")
    return artifacts[0]


def read_grant(grant_artifacts) -> GrantInfo:
    grant_artifact = _single(grant_artifacts, "PrivacyGrant")
    if grant_artifact.type_name != PrivacyGrant.TYPE_NAME:
        raise GrantError(f"expected a {PrivacyGrant.TYPE_NAME} artifact, got {grant_artifact.type_name}")
    grant_id = grant_artifact.get_string_custom_property("grant_id")
    if not grant_id:
        raise GrantError("the PrivacyGrant artifact carries no grant_id")
    props = grant_artifact.mlmd_artifact.custom_properties
    return GrantInfo(
        grant_id=grant_id,
        ledger_store=grant_artifact.get_string_custom_property("ledger_store"),
        ledger_context=grant_artifact.get_string_custom_property("ledger_context"),
        blocks=tuple(json.loads(grant_artifact.get_string_custom_property("blocks") or "[]")),
        epsilon=float(props["epsilon"].string_value) if "epsilon" in props else None,
        delta=float(props["delta"].string_value) if "delta" in props else None,
        split=json.loads(grant_artifact.get_string_custom_property("split") or "{}"))


def require_grant(grant_artifacts, examples_artifacts: Sequence[artifact.Artifact],
                  verify_with_ledger: bool = True) -> GrantInfo:
    """The grant, after checking that it covers every Examples artifact (see module docstring)."""
    info = read_grant(grant_artifacts)
    examples_artifacts = list(examples_artifacts or [])
    if not examples_artifacts:
        raise GrantError("no Examples were given with the grant")
    for examples in examples_artifacts:
        examples_grant = examples.get_string_custom_property(EXAMPLES_GRANT_ID)
        if not examples_grant:
            raise GrantError(f"Examples at {examples.uri} come without a grant; only Examples "
                             "emitted by the BlockLedger component may be used")
        if examples_grant != info.grant_id:
            raise GrantError(f"Examples at {examples.uri} were granted under {examples_grant}, "
                             f"not under the given grant {info.grant_id}")
        blocks = json.loads(examples.get_string_custom_property(EXAMPLES_BLOCKS) or "[]")
        outside = sorted(set(blocks) - set(info.blocks))
        if outside:
            raise GrantError(f"Examples at {examples.uri} hold block(s) {outside} that grant "
                             f"{info.grant_id} does not cover")
    if verify_with_ledger:
        from sage_tfx.sage_access.ledger import BlockLedger
        from sage_tfx.sage_access.store import parse

        issued = BlockLedger(parse(info.ledger_store), info.ledger_context).find_grant(info.grant_id)
        same_budget = (issued.epsilon == info.epsilon and issued.delta == info.delta)
        if tuple(issued.blocks) != tuple(info.blocks) or not same_budget:
            raise GrantError(f"PrivacyGrant {info.grant_id} does not match the ledger's record "
                             f"(ledger: blocks {list(issued.blocks)}, epsilon {issued.epsilon}, "
                             f"delta {issued.delta})")
    return info
