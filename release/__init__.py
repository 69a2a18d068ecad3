"""The release protocol (protocol.py), the plan a front door makes (plan.py) and the one
Guarantee every release states (guarantee.py). docs/architecture.md shows it as the spine of
the data flow."""
from sage_tfx.release.guarantee import Guarantee, GuaranteeUnit, weakest_unit
from sage_tfx.release.plan import ReleasePlan
from sage_tfx.release.protocol import (Charged, Outcome, ReleaseFailed, ReleaseInterrupted,
                                       charge, consume, public_reason)

__all__ = ["Charged", "Guarantee", "GuaranteeUnit", "Outcome", "ReleaseFailed", "ReleaseInterrupted",
           "ReleasePlan",
           "charge", "consume", "public_reason", "weakest_unit"]
