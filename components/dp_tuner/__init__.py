"""DPTuner: TFX's Tuner under a grant: private selection over DP-SGD trials."""
from sage_tfx.components.dp_tuner.component import DPTuner

__all__ = ["DPTuner"]
