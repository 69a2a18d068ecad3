"""DPTransform: tensorflow_transform preprocessing with DP analyzers only (see README.md)."""
from sage_tfx.components.dp_transform.component import DPTransform

__all__ = ["DPTransform"]
