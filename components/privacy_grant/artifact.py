"""The PrivacyGrant artifact type and how a ledger grant is written to and read from it."""
from __future__ import annotations

import json

from tfx.types import artifact

from sage_tfx.sage_access.exact import exact_property, set_exact_property


class PrivacyGrant(artifact.Artifact):
    """A ledger grant: blocks, total (epsilon, delta) and its split among the iteration's DP steps.

    Custom properties only (Kubeflow V2 compiles custom artifact types with no typed PROPERTIES):
    grant_id, ledger_store, ledger_context, blocks (JSON), epsilon, delta, rdp_curve (JSON, when
    the grant was an RDP curve), split (JSON {step: fraction}), pipeline.
    """

    TYPE_NAME = "sage_tfx.PrivacyGrant"


def write_grant(target: PrivacyGrant, grant, ledger_store: str) -> None:
    """Fill a PrivacyGrant artifact from a ledger `Grant`."""
    target.set_string_custom_property("grant_id", grant.grant_id)
    target.set_string_custom_property("ledger_store", ledger_store)
    target.set_string_custom_property("ledger_context", grant.context)
    target.set_string_custom_property("blocks", json.dumps(list(grant.blocks)))
    if grant.epsilon is not None:
        set_exact_property(target, "epsilon", grant.epsilon)
    if grant.delta is not None:
        set_exact_property(target, "delta", grant.delta)
    if grant.rdp_curve is not None:
        target.set_string_custom_property("rdp_curve", json.dumps(list(grant.rdp_curve)))
    target.set_string_custom_property("split", json.dumps(dict(grant.split)))
    if grant.pipeline:
        target.set_string_custom_property("pipeline", grant.pipeline)


def grant_address(grant_artifact: PrivacyGrant) -> tuple[str, str, str]:
    """(grant_id, ledger_store, ledger_context) the artifact names ("" where it names none)."""
    return tuple(grant_artifact.get_string_custom_property(name)
                 for name in ("grant_id", "ledger_store", "ledger_context"))


def claimed_grant(grant_artifact: PrivacyGrant) -> dict:
    """What the artifact says the grant is: blocks, epsilon, delta and split (to be checked
    against the ledger's record; never trusted on its own)."""
    return {"blocks": json.loads(grant_artifact.get_string_custom_property("blocks") or "[]"),
            "epsilon": exact_property(grant_artifact, "epsilon"),
            "delta": exact_property(grant_artifact, "delta"),
            "split": json.loads(grant_artifact.get_string_custom_property("split") or "{}")}
