"""TFX components of sage-tfx, one package each (component.py: spec and class; executor.py: work).

    from sage_tfx.components import (BlockExampleGen, BlockLedger, DPTransform,
                                     ObliviousSampleGen, DPTrainer, SLAedValidator, PrivacyGrant)

| name | lives in |
| --- | --- |
| BlockExampleGen | sage_tfx.components.block_example_gen |
| BlockLedger (the grant component) | sage_tfx.components.block_ledger |
| DPTransform | sage_tfx.components.dp_transform |
| ObliviousSampleGen | sage_tfx.components.oblivious_sample_gen |
| DPTrainer | sage_tfx.components.dp_trainer |
| SLAedValidator | sage_tfx.validators |
| MatrixMechanism (workload of counting queries) | sage_tfx.components.matrix_mechanism |
| DPAggregate, DPStatistics (artifact type) | sage_tfx.components.dp_aggregate |
| ContinualRelease, ContinualReleaseState (artifact type) | sage_tfx.components.continual_release |
| DPStatisticsGen, DPSchemaGen (TFX's ExampleStatistics and Schema) | sage_tfx.components.dp_statistics_gen |
| PrivacyGrant (artifact type) | sage_tfx.components.privacy_grant |

Imported lazily (PEP 562): `import sage_tfx.components` does not import TFX or TensorFlow; the
first use of a name imports its module. The ledger itself is sage_tfx.sage_access.BlockLedger.
"""
import importlib

from sage_tfx import console

# Pipelines built from these components show their outcome lines and not TFX's repeated noise.
console.install()

_HOMES = {
    "BlockExampleGen": "sage_tfx.components.block_example_gen",
    "BlockLedger": "sage_tfx.components.block_ledger",
    "DPTransform": "sage_tfx.components.dp_transform",
    "ObliviousSampleGen": "sage_tfx.components.oblivious_sample_gen",
    "DPTrainer": "sage_tfx.components.dp_trainer",
    "SLAedValidator": "sage_tfx.validators.component",
    "MatrixMechanism": "sage_tfx.components.matrix_mechanism",
    "PrivacyGrant": "sage_tfx.components.privacy_grant",
    "DPAggregate": "sage_tfx.components.dp_aggregate",
    "DPStatistics": "sage_tfx.components.dp_aggregate",
    "ContinualRelease": "sage_tfx.components.continual_release",
    "ContinualReleaseState": "sage_tfx.components.continual_release",
    "DPStatisticsGen": "sage_tfx.components.dp_statistics_gen",
    "DPSchemaGen": "sage_tfx.components.dp_statistics_gen",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
