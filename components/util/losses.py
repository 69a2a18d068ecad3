"""Keras loss helpers shared by DPTrainer (DP-SGD) and SLAedValidator (per-example losses)."""
from __future__ import annotations

from typing import Callable

import tensorflow as tf


def labels_shaped_as(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    """Labels [B] beside one output per example [B, 1] become [B, 1]. TFX modules give either
    (a FixedLenFeature of shape [] or [1]); Keras would broadcast [B] against [B, 1] into a
    [B, B] loss and reduce it to one number, which is no per-example loss. Labels of a
    multi-output model ([B] class ids beside [B, K] scores) are left as they are."""
    if (labels.shape.rank is not None and predictions.shape.rank is not None
            and labels.shape.rank == predictions.shape.rank - 1 and predictions.shape[-1] == 1):
        return tf.expand_dims(labels, -1)
    return labels


def with_reduction(loss: tf.keras.losses.Loss,
                   reduction: str) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """The same loss with another reduction (SUM gives sum_i w_i * loss_i, the clipped-gradient
    objective; NONE the per-example losses), called as loss(labels, predictions) with the
    labels shaped as the predictions (`labels_shaped_as`)."""
    reduced = type(loss).from_config(dict(loss.get_config(), reduction=reduction))

    def call(labels, predictions):
        return reduced(labels_shaped_as(tf.convert_to_tensor(labels), predictions), predictions)
    return call
