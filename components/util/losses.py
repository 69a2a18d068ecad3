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


def _loss_classes() -> dict:
    """Keras' loss functions -> their Loss classes (BinaryCrossentropy wraps
    binary_crossentropy, the function `compile(loss="binary_crossentropy")` resolves to)."""
    classes = {}
    for name in dir(tf.keras.losses):
        cls = getattr(tf.keras.losses, name)
        if (isinstance(cls, type) and issubclass(cls, tf.keras.losses.Loss)
                and hasattr(cls, "call") and cls.__name__ == name):
            try:
                function = getattr(cls(), "fn", None)
            except TypeError:  # a wrapper that needs arguments (LossFunctionWrapper itself)
                continue
            if function is not None:
                classes.setdefault(function, cls)
    return classes


class LossNotPerExample(ValueError):
    """The model's compiled loss cannot be made per-example (compiled_loss says why)."""


def compiled_loss(model: tf.keras.Model) -> tf.keras.losses.Loss:
    """The loss `model` was compiled with, as a Loss whose reduction `with_reduction` can
    change (so that DP-SGD takes it per example): a Loss instance as it is, a Keras loss given
    by name or function (`loss="binary_crossentropy"`) as its Loss class with default
    arguments, as Keras' compile applies it. LossNotPerExample naming why for anything else:
    no compiled loss, one per output (a dict or list), or a function of the user's own (its
    reduction over the batch is unknown: define loss() in the module, returning a
    tf.keras.losses.Loss)."""
    given = getattr(model, "loss", None)
    instead = "define loss() in the module, returning a tf.keras.losses.Loss"
    if given is None:
        raise LossNotPerExample(f"the model is not compiled with a loss: {instead}")
    if isinstance(given, (dict, list, tuple)):
        raise LossNotPerExample(f"the model is compiled with one loss per output ({given!r}); "
                                f"DP-SGD takes one per-example loss: {instead}")
    if isinstance(given, tf.keras.losses.Loss):
        loss = given
    else:
        function = tf.keras.losses.get(given) if isinstance(given, str) else given
        cls = _loss_classes().get(function)
        if cls is None:
            raise LossNotPerExample(f"the model's compiled loss {given!r} is not a Keras loss "
                                    "DP-SGD can take per example (a function of its own: its "
                                    f"reduction over the batch is unknown): {instead}")
        loss = cls()
    try:
        type(loss).from_config(loss.get_config())
    except Exception as error:
        raise LossNotPerExample(f"the model's compiled loss {type(loss).__name__} cannot be "
                                "rebuilt with another reduction (get_config, from_config: "
                                f"{type(error).__name__}: {error}), so DP-SGD cannot take it "
                                f"per example: {instead}") from error
    return loss
