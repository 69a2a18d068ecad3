"""DPTrainer: DP-SGD on oblivious samples, calibrated to the budget the ledger granted."""
from sage_tfx.components.dp_trainer.component import DPTrainer
from sage_tfx.components.dp_trainer.parameters import TrainerMode, preflight

__all__ = ["DPTrainer", "TrainerMode", "preflight"]
