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

# The custom artifact types, by their TYPE_NAME: TFX's Kubeflow V2 entrypoint (each task of a
# compiled job) imports an artifact's class from the title of its type, e.g. `sage_tfx.PrivacyGrant`
# (Kubeflow requires TYPE_NAME to be `namespace.Name`, so the class must be reachable there).
# Imported on first use (PEP 562): `import sage_tfx` stays light.
_ARTIFACT_TYPES = {
    "PrivacyGrant": "sage_tfx.components.privacy_grant.artifact",
    "DPStatistics": "sage_tfx.components.dp_aggregate.component",
    "ContinualReleaseState": "sage_tfx.components.continual_release.component",
    "WorkloadAnswers": "sage_tfx.components.matrix_mechanism.component",
    "PrivateExamples": "sage_tfx.components.dag_guard.artifacts",
}


def __getattr__(name: str):
    if name not in _ARTIFACT_TYPES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_ARTIFACT_TYPES[name]), name)
