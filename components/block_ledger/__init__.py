"""BlockLedger component: obtain a Sage grant and emit a PrivacyGrant with the granted Examples."""
from sage_tfx.components.block_ledger.component import BlockLedger

__all__ = ["BlockLedger"]
