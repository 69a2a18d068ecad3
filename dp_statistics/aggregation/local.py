"""The in-process vectorised engine (numpy/pandas), the default."""
from __future__ import annotations

from sage_tfx.dp_statistics.aggregation.budget import BudgetPlan
from sage_tfx.dp_statistics.aggregation.release import Release
from sage_tfx.dp_statistics.aggregation.spec import AggregationQuery, GuaranteeUnit


def aggregate(data, query: AggregationQuery, plan: BudgetPlan,
              unit: GuaranteeUnit = GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ) -> Release:
    """Run ``query`` on ``data`` (pyarrow.Table or pandas.DataFrame) at ``plan``'s budget:
    contribution bounding, DP aggregates, partition selection. Raises QueryError (unknown
    columns, a plan made for another query) before drawing any noise."""
    raise NotImplementedError("the engine lands in the next commit")
