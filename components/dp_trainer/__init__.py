"""DPTrainer: DP-SGD on oblivious samples, calibrated to the budget the ledger granted.

Imported lazily (PEP 562, as sage_tfx.components): `python -m
sage_tfx.components.dp_trainer.calibrate` loads without TFX or TensorFlow.
"""
import importlib

_HOMES = {
    "DPTrainer": "sage_tfx.components.dp_trainer.component",
    "TrainerMode": "sage_tfx.components.dp_trainer.parameters",
    "preflight": "sage_tfx.components.dp_trainer.parameters",
}

__all__ = ["DPTrainer", "TrainerMode", "preflight"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
