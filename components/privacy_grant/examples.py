"""Naming a grant on the Examples it covers, and recording Examples derived from granted ones."""
from __future__ import annotations

import json
from typing import Sequence

from tfx.types import artifact

# Custom properties that name the grant on Examples (for people and UIs; never trusted:
# `require_grant` asks the ledger).
EXAMPLES_GRANT_ID = "sage_grant_id"
EXAMPLES_BLOCKS = "sage_blocks"
EXAMPLES_CONTEXT = "sage_ledger_context"


def _name_grant(examples: artifact.Artifact, grant_id: str, blocks: Sequence[str],
                context: str) -> None:
    examples.set_string_custom_property(EXAMPLES_GRANT_ID, grant_id)
    examples.set_string_custom_property(EXAMPLES_BLOCKS, json.dumps(list(blocks)))
    examples.set_string_custom_property(EXAMPLES_CONTEXT, context)


def mark_examples(examples: artifact.Artifact, grant, blocks: Sequence[str]) -> None:
    """Name the ledger `grant` on the Examples it released."""
    _name_grant(examples, grant.grant_id, blocks, grant.context)


def carry_grant(grant, target: artifact.Artifact, producer: str) -> None:
    """Examples derived from granted Examples (samples, transformed records): record their
    location in the ledger as the data of `grant` (a checked GrantInfo), and name it on them."""
    grant.record_data(target.uri, producer)
    _name_grant(target, grant.grant_id, grant.blocks, grant.ledger_context)
