"""DP statistics released from the same blocks and ledger as models (docs/architecture.md,
"Statistics: DP releases from the same blocks").

Named ``dp_statistics``, not ``statistics``: a top-level ``statistics`` would shadow the standard
library's module whenever Python runs from the repository root.
"""
