"""Keras 2 for tensorflow-privacy 0.9 (DPTrainer's DP-SGD), which works with `tf_keras` only.

TensorFlow picks the Keras behind `tf.keras` once per process, on the first use of `tf.keras`,
from TF_USE_LEGACY_KERAS. Importing sage_tfx sets the variable (sage_tfx/__init__.py), which is
in time even when TensorFlow was imported before, as long as nothing has used `tf.keras` yet.
A pipeline file that imports TFX's Pusher (or uses Keras) before sage_tfx gets Keras 3 for good:
`require_legacy_keras` says so, and the BlockLedger runs it before it charges (block_ledger/
preflight.py), so that process never pays for a training it cannot run.
"""
from __future__ import annotations

import os
import sys

VARIABLE = "TF_USE_LEGACY_KERAS"
_TRUE = ("true", "True", "1")  # what TensorFlow's KerasLazyLoader accepts


def legacy_keras_in_effect() -> bool:
    """Whether `tf.keras` is (or, TensorFlow not yet imported, will be) Keras 2 here."""
    tensorflow = sys.modules.get("tensorflow")
    if tensorflow is None:
        return os.environ.get(VARIABLE) in _TRUE
    # The first use of tf.keras decides from the variable; a later use reads the decision.
    return tensorflow.keras.layers.Dense.__module__.startswith("tf_keras")


def require_legacy_keras() -> None:
    """RuntimeError naming the fix unless Keras 2 is in effect in this process."""
    if not legacy_keras_in_effect():
        raise RuntimeError(
            "DP-SGD needs Keras 2 (for tensorflow-privacy), but this process uses Keras 3: "
            f"TensorFlow chose it before {VARIABLE}=1 was set. Import sage_tfx before tfx and "
            f"tensorflow in the pipeline file, or set {VARIABLE}=1 in the environment (in a "
            "container, in the image)")
