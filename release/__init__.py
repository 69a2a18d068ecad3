"""The release protocol (protocol.py), the plan a front door makes (plan.py) and the one
Guarantee every release states (guarantee.py). docs/architecture.md shows it as the spine of
the data flow."""
from sage_tfx.release.files import write_csv, write_json, write_parquet
from sage_tfx.release.guarantee import Guarantee, GuaranteeUnit, weakest_unit
from sage_tfx.release.plan import ReleasePlan
from sage_tfx.release.protocol import (Charged, Outcome, ReleaseFailed, ReleaseInterrupted,
                                       charge, consume, public_reason, record_denial)

__all__ = ["Charged", "Guarantee", "GuaranteeUnit", "Outcome", "ReleaseFailed",
           "ReleaseInterrupted", "ReleasePlan", "charge", "consume", "public_reason",
           "record_denial", "weakest_unit", "write_csv", "write_json", "write_parquet"]
