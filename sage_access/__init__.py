"""Sage Access Control: per-block privacy budgets in ML Metadata (Sage §3.2-§3.3, §4).

    from sage_tfx.sage_access import BlockLedger, BlockIds, RecentWindow
    ledger = BlockLedger.create("ledger.sqlite", accounting="basic", min_request_epsilon=0.05)
    ledger.add_block("2024-01", epsilon=1.0, delta=1e-6)
    grant = ledger.request(RecentWindow(1), epsilon=0.5, delta=1e-7, pipeline="taxi")

This package never imports TensorFlow (the ledger CLI must start fast).
"""
from sage_tfx.sage_access.accounting import (DEFAULT_RDP_ORDERS, BasicComposition, BudgetRequest,
                                             RenyiFilter, pure_dp_rdp_curve)
from sage_tfx.sage_access.allocation import BlockState
from sage_tfx.sage_access.errors import (BadRequest, BalanceTampered, BudgetExhausted,
                                         LedgerBusy, LedgerError)
from sage_tfx.sage_access.ledger import BlockIds, BlockLedger, RecentWindow
from sage_tfx.sage_access.records import Grant
from sage_tfx.sage_access.store import (StoreRefused, connect,
                                        connect_read_only, kubeflow_grpc_config, sqlite_config)

__all__ = [
    "BadRequest", "BalanceTampered", "BasicComposition", "BlockIds", "BlockLedger", "BlockState", "BudgetExhausted",
    "BudgetRequest", "DEFAULT_RDP_ORDERS", "Grant", "LedgerBusy", "LedgerError", "RecentWindow",
    "RenyiFilter", "StoreRefused", "connect", "connect_read_only",
    "kubeflow_grpc_config", "pure_dp_rdp_curve", "sqlite_config",
]
