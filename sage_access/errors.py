"""Errors of the BlockLedger. Every error leaves the ledger unchanged: nothing is charged."""


class LedgerError(Exception):
    """Base class of ledger errors."""


class BadRequest(LedgerError, ValueError):
    """The request itself is malformed (bad numbers, unknown or retired blocks, bad window)."""


class BudgetExhausted(LedgerError):
    """The request is well formed but the selected blocks cannot pay it.

    `remaining` maps each block id that could not pay to a readable account of what it has left.
    """

    def __init__(self, message: str, remaining: dict[str, str] | None = None):
        super().__init__(message)
        self.remaining = dict(remaining or {})


class LedgerBusy(LedgerError):
    """Too many concurrent writers kept conflicting; nothing was charged. Retry later."""


class BalanceTampered(LedgerError):
    """A block's stored balance disagrees with the grants recorded on it: the store was
    written outside sage-tfx. Nothing was charged; the ledger refuses to grant on that block."""
