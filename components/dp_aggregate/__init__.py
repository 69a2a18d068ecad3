"""DPAggregate component: DP SQL over granted Examples -> a DP statistics artifact."""
from sage_tfx.components.dp_aggregate.component import DPAggregate, DPStatistics

__all__ = ["DPAggregate", "DPStatistics"]
