"""Quantile cut points (NTILE) of one column: their RMSE against the exact quantiles, on the data
and query settings of benchmarks/aggregation.py's ``--quantiles`` (values clamped into
[0, 50], C_u = 4, m = 2, its default selection, Laplace noise, (epsilon, delta) = (1, 1e-6)).

    python benchmarks/quantile_cut_points.py [--rows N] [--ntile K] [--epsilon E]
                                             [--repeats R] [--seed S] [--data longtail|taxi]
                                             [--json]

The query is ``ANON_NTILE(value, K, 0, 50)`` per partition: its K - 1 cut points q = k / K.
Printed: ``quantile_trees`` (the plan's steps that noise a tree: one per cut point before
the cut points shared one tree, one after), ``partitions_kept`` and per cut point the RMSE over
the partitions kept (against the exact, unclamped quantile of the partition's values), each
averaged over R runs, and ``rmse_mean`` (the cut points' RMSEs averaged). Run it on two
revisions to compare them at the same epsilon (docs/dp-aggregation.md has the figures).
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aggregation import HIGH, LOW, MAX_PARTITIONS, MAX_ROWS, synthetic, taxi  # noqa: E402

from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregateKind,  # noqa: E402
                                                AggregationQuery, aggregate, plan)


def ntile_query(ntile: int) -> AggregationQuery:
    cuts = tuple(Aggregate(AggregateKind.QUANTILE, "value", LOW, HIGH, q=k / ntile,
                           name=f"q_{k}") for k in range(1, ntile))
    return AggregationQuery(("partition",), "user", cuts, max_partitions_contributed=MAX_PARTITIONS,
                            max_contributions_per_partition=MAX_ROWS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--ntile", type=int, default=4)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", choices=["longtail", "taxi"], default="longtail")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    frame = taxi() if args.data == "taxi" else synthetic(args.rows, args.seed)
    query = ntile_query(args.ntile)
    budget = plan(query, args.epsilon, args.delta)
    names = [a.output_name for a in query.aggregates]
    grouped = frame.groupby("partition")["value"]
    exact = {a.output_name: grouped.quantile(a.q) for a in query.aggregates}
    errors = {name: [] for name in names}
    kept = []
    for _ in range(args.repeats):
        table = aggregate(frame, query, budget).table.set_index("partition")
        kept.append(len(table))
        for name in names:
            difference = table[name] - exact[name].loc[table.index]
            errors[name].append(float(np.sqrt(np.mean(difference ** 2))) if len(table) else 0.0)
    rmse = {name: float(np.mean(errors[name])) for name in names}
    report = {"data": args.data, "rows": len(frame), "ntile": args.ntile,
              "epsilon": args.epsilon, "repeats": args.repeats,
              "quantile_trees": sum(1 for step in budget.steps if step.name in names),
              "partitions_kept": float(np.mean(kept)), "rmse": rmse,
              "rmse_mean": float(np.mean(list(rmse.values())))}
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))


if __name__ == "__main__":
    main()
