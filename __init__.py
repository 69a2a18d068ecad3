"""sage-tfx: differentially private ML pipelines as TFX components, with Sage block accounting.

Everything is imported from this namespace: `sage_tfx.sage_access` (the BlockLedger),
`sage_tfx.components` (TFX components), `sage_tfx.validators`, `sage_tfx.pipelines`.
This module stays import-light: the ledger CLI must start without TensorFlow.
"""

__version__ = "0.1.0"
