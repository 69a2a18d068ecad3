"""`require_grant`: the check every DP component runs before touching data.

The ledger is the source of truth, never what an artifact says about itself:
1. the grant named by the artifact must be recorded in the ledger the artifact names, with the
   same blocks, budget and split (a hand-made or edited PrivacyGrant is refused);
2. every Examples artifact must sit at a location the ledger recorded as this grant's data: the
   BlockLedger component's output, or what a component derived from it and recorded
   (`carry_grant`). Copied custom properties prove nothing;
3. the returned GrantInfo consumes each step's share once, in the ledger (shares.py).
Trust boundary: the ledger store itself. Whoever can write it can issue grants.
"""
from __future__ import annotations

from typing import Optional, Sequence

from tfx.types import artifact

from sage_tfx.components.privacy_grant.artifact import PrivacyGrant, claimed_grant, grant_address
from sage_tfx.components.privacy_grant.shares import GrantError, GrantInfo
from sage_tfx.sage_access.errors import BadRequest


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
    grant_id, store, context = grant_address(grant_artifact)
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
    claimed = claimed_grant(grant_artifact)
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
