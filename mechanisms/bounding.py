"""Clamping a value into the range a mechanism's sensitivity assumes (numpy only)."""
from __future__ import annotations

import numpy as np


def bounded(values, low: float, high: float) -> np.ndarray:
    """`values` in [low, high] for a bounded statistic: a non-finite value (NaN or infinite, from
    a bad record or 0 / 0 in user code) counts as the midpoint, a public constant, and the rest
    are clamped (np.clip keeps NaN, so without the first step one value could make a sum NaN)."""
    values = np.asarray(values, dtype=np.float64)
    return np.clip(np.where(np.isfinite(values), values, (low + high) / 2.0), low, high)
