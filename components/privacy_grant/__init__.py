"""The PrivacyGrant artifact and the check every DP component runs before touching data.

docs/architecture.md, "No data without a grant": a DP component takes the PrivacyGrant and refuses
Examples that do not come with a grant covering them. `require_grant` is that check:

    grant = require_grant(input_dict["grant"], input_dict["examples"])
    epsilon, delta = grant.share("training")   # consumes the share, once, in the ledger

Modules: artifact.py (the artifact type and its property codec), steps.py (what each DP step
of a grant runs: the events its split records), examples.py (naming the grant on Examples and
recording derived data), shares.py (a checked grant and the consumption of its shares), check.py
(`require_grant`: the ledger check).
"""
from sage_tfx.components.privacy_grant.artifact import PrivacyGrant, write_grant
from sage_tfx.components.privacy_grant.check import require_grant
from sage_tfx.components.privacy_grant.examples import (EXAMPLES_BLOCKS, EXAMPLES_CONTEXT,
                                                        EXAMPLES_GRANT_ID, carry_grant,
                                                        mark_examples)
from sage_tfx.components.privacy_grant.shares import GrantError, GrantInfo
from sage_tfx.components.privacy_grant.steps import (MECHANISMS, Mechanism,
                                                     planned_additional_delta, planned_event,
                                                     step_events)

__all__ = [
    "EXAMPLES_BLOCKS", "EXAMPLES_CONTEXT", "EXAMPLES_GRANT_ID", "GrantError", "GrantInfo",
    "MECHANISMS", "Mechanism", "PrivacyGrant", "carry_grant", "mark_examples",
    "planned_additional_delta", "planned_event",
    "require_grant", "step_events", "write_grant",
]
