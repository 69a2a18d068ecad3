"""SLAed validation (Sage §3.3): numpy tests in `slaed`, the SLAedValidator component in
`component`. Derivations and guarantees are in slaed.py's module docstring."""
from sage_tfx.validators.slaed import (ACCEPT, REJECT, RETRY, ValidationResult, accuracy_validator,
                                       loss_validator, sum_statistic_validator)

__all__ = ["ACCEPT", "REJECT", "RETRY", "ValidationResult", "accuracy_validator",
           "loss_validator", "sum_statistic_validator"]
