"""sage_tfx.audit: an empirical privacy auditor (lower bounds on epsilon from runs of a mechanism).

`bounds` holds the estimator and its derivation, `mechanisms` one adapter per shipped mechanism,
`cli` the `sage-tfx audit` subcommand. Kept import-light: the CLI registers `audit` at start-up.
"""
