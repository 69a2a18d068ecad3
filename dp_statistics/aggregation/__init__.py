"""The DP SQL aggregation operator with bounded user contribution (issue 18; DP SQL §4.2.3).

Public API (what the SQL front-end, the CLI and the DPAggregate component call)::

    query = AggregationQuery(
        group_by=("area",), unit_column="taxi_id",
        aggregates=(Aggregate.count(), Aggregate(AggregateKind.AVG, "fare", 0, 50),
                    Aggregate.median("seconds", 0, 7200)))
    budget = plan(query, epsilon=1.0, delta=1e-6)    # raises QueryError before anything runs
    release = aggregate(table, query, budget)        # pyarrow.Table or pandas.DataFrame
    release.table, release.epsilon, release.delta, release.unit, release.events

``plan`` splits the grant (budget.py); ``aggregate`` runs the in-process vectorised engine
(local.py); ``beam.AggregateTransform`` / ``beam.aggregate_with_beam`` run the same math on
Beam. The derivations are in aggregators.py (sensitivities, AVG/VAR, DP bounds), budget.py
(composition) and sage_tfx.mechanisms.selection (partition selection).
"""
from sage_tfx.dp_statistics.aggregation.spec import (Aggregate, AggregateKind, AggregationQuery,
                                                     BoundsScope, GuaranteeUnit, NoiseKind,
                                                     QueryError, SelectionRule)
from sage_tfx.dp_statistics.aggregation.budget import BudgetPlan, Composition, PlanStep, plan
from sage_tfx.dp_statistics.aggregation.release import Release
from sage_tfx.dp_statistics.aggregation.local import aggregate

__all__ = ["Aggregate", "AggregateKind", "AggregationQuery", "BoundsScope", "GuaranteeUnit",
           "NoiseKind", "QueryError", "SelectionRule", "BudgetPlan", "Composition", "PlanStep", "plan",
           "Release", "aggregate"]
