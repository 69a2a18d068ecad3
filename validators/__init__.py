"""SLAed validation (Sage §3.3): numpy tests in `slaed`, the SLAedValidator component in
`component`. Derivations and guarantees are in slaed.py's module docstring.

`SLAedValidator` is imported lazily (PEP 562), so the numpy tests load without TFX or TensorFlow.
"""
from sage_tfx.validators.slaed import (ACCEPT, REJECT, RETRY, Metric, Outcome, ValidationResult,
                                       accuracy_validator, loss_validator,
                                       sum_statistic_validator)

__all__ = ["ACCEPT", "REJECT", "RETRY", "Metric", "Outcome", "SLAedValidator", "ValidationResult",
           "accuracy_validator", "loss_validator", "sum_statistic_validator"]


def __getattr__(name: str):
    if name == "SLAedValidator":
        from sage_tfx.validators.component import SLAedValidator
        return SLAedValidator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
