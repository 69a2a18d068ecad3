"""Keras loss helpers shared by DPTrainer (DP-SGD) and SLAedValidator (per-example losses)."""
from __future__ import annotations

import tensorflow as tf


def with_reduction(loss: tf.keras.losses.Loss, reduction: str) -> tf.keras.losses.Loss:
    """The same loss with another reduction: SUM gives sum_i w_i * loss_i (the clipped-gradient
    objective), NONE the per-example losses."""
    return type(loss).from_config(dict(loss.get_config(), reduction=reduction))
