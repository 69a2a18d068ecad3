"""DP statistics released from the same blocks and ledger as models (DESIGN.md, "DP statistics").

Named ``dp_statistics``, not ``statistics``: a top-level ``statistics`` would shadow the standard
library's module whenever Python runs from the repository root.
"""
