"""sage-tfx: differentially private ML pipelines as TFX components, with Sage block accounting.

Everything is imported from this namespace: `sage_tfx.sage_access` (the BlockLedger),
`sage_tfx.components` (TFX components), `sage_tfx.validators`, `sage_tfx.pipelines`.
This module stays import-light: the ledger CLI must start without TensorFlow.
"""
import os

# tensorflow-privacy 0.9 (DPTrainer) works with Keras 2 only (`tf_keras`). TensorFlow picks the
# Keras behind `tf.keras` once, when it is first imported, from this variable. Setting it here
# covers every process that imports sage_tfx before TensorFlow; other entry points (a TFX
# container) set it in their environment. dp_trainer checks it and names the fix if not.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# TensorFlow's C++ INFO and WARNING lines (CPU features, CUDA init) say nothing to a user of this
# project; errors still show. Set it to 0 to see them. (TF 2.21 prints three lines while loading,
# before absl's C++ logging starts; no setting reaches those.)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"
