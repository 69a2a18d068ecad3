"""The DP aggregation operator against PipelineDP on the same query, data and budget (issue 18 §3).

    python benchmarks/aggregation.py [--rows N] [--epsilon E] [--delta D] [--seed S]
                                     [--repeats R] [--json]

Query: per partition COUNT(*), SUM(value) and MEAN(value), each row clamped into [0, 50], at most
C_u = 4 partitions per user and m = 2 rows per user and partition, truncated-geometric partition
selection, Laplace noise, (epsilon, delta) = (1, 1e-6) by default. PipelineDP 0.3.1 (LocalBackend,
NaiveBudgetAccountant) splits the budget into selection, MEAN's count and MEAN's sum, and derives
COUNT and SUM from MEAN's; sage-tfx's plan does the same by default (selection weight 1, AVG 2,
COUNT and the row-scoped SUM post-processed from AVG), so both spend epsilon / 3 per noisy sum.

Data (seeded): users = rows / 10, partitions = rows / 50 (10^5 and 2x10^4 at 10^6 rows);
user activity is log-normal (sigma 1.2: the heaviest users have ~100x the median's rows),
partition popularity Zipf(1), each user spreads its rows over 3 favourite partitions, values are
log-normal (median ~12, a tail past 50).

Printed per system: ``rows_per_second`` (wall clock of the aggregation alone, the median of R
runs, input already in memory in each library's own form: a pandas frame, a list of tuples),
``rmse`` per metric over the partitions it kept (against the exact, unbounded statistic; the
contribution bounds' bias is most of it), ``rmse_common`` over the partitions both kept,
``partitions_kept``, each averaged over the R runs; and ``throughput_ratio`` (ours /
PipelineDP's).
PipelineDP is a benchmark-only dependency (requirements/benchmark.txt).
"""
import argparse
import json
import time

import numpy as np
import pandas as pd

from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregateKind, AggregationQuery,
                                                BoundsScope, SelectionRule, aggregate, plan)

LOW, HIGH, MAX_PARTITIONS, MAX_ROWS = 0.0, 50.0, 4, 2
METRICS = ("count", "sum", "mean")


def synthetic(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    users, partitions = max(rows // 10, 1), max(rows // 50, 1)
    activity = rng.lognormal(mean=0.0, sigma=1.2, size=users)  # heavy users: 100x the median
    user = rng.choice(users, size=rows, p=activity / activity.sum())
    popularity = 1.0 / np.arange(1, partitions + 1)  # Zipf(1) partition popularity
    # each user has 3 favourite partitions (popularity-weighted) and spreads its rows over them
    favourites = rng.choice(partitions, size=(users, 3), p=popularity / popularity.sum())
    partition = favourites[user, rng.integers(0, 3, rows)]
    value = rng.lognormal(mean=2.5, sigma=0.8, size=rows)
    return pd.DataFrame({"user": user, "partition": partition, "value": value})


def truth(frame: pd.DataFrame) -> pd.DataFrame:
    grouped = frame.groupby("partition")["value"]
    return pd.DataFrame({"count": grouped.size(), "sum": grouped.sum(), "mean": grouped.mean()})


def run_sage(frame: pd.DataFrame, epsilon: float, delta: float) -> tuple[pd.DataFrame, float]:
    query = AggregationQuery(
        ("partition",), "user",
        (Aggregate.count(),
         Aggregate(AggregateKind.SUM, "value", LOW, HIGH, scope=BoundsScope.ROW, name="sum"),
         Aggregate(AggregateKind.AVG, "value", LOW, HIGH, name="mean")),
        max_partitions_contributed=MAX_PARTITIONS, max_contributions_per_partition=MAX_ROWS,
        selection=SelectionRule.WEIGHTED_GAUSSIAN)
    budget = plan(query, epsilon, delta)
    start = time.perf_counter()
    table = aggregate(frame, query, budget).table
    elapsed = time.perf_counter() - start
    return table.set_index("partition")[list(METRICS)], elapsed


def run_pipeline_dp(frame: pd.DataFrame, epsilon: float,
                    delta: float) -> tuple[pd.DataFrame, float]:
    import pipeline_dp

    rows = list(frame[["user", "partition", "value"]].itertuples(index=False, name=None))
    start = time.perf_counter()
    accountant = pipeline_dp.NaiveBudgetAccountant(total_epsilon=epsilon, total_delta=delta)
    engine = pipeline_dp.DPEngine(accountant, pipeline_dp.LocalBackend())
    params = pipeline_dp.AggregateParams(
        noise_kind=pipeline_dp.NoiseKind.LAPLACE,
        metrics=[pipeline_dp.Metrics.COUNT, pipeline_dp.Metrics.SUM, pipeline_dp.Metrics.MEAN],
        max_partitions_contributed=MAX_PARTITIONS, max_contributions_per_partition=MAX_ROWS,
        min_value=LOW, max_value=HIGH)
    extractors = pipeline_dp.DataExtractors(privacy_id_extractor=lambda row: row[0],
                                            partition_extractor=lambda row: row[1],
                                            value_extractor=lambda row: row[2])
    result = engine.aggregate(rows, params, extractors)
    accountant.compute_budgets()
    released = list(result)
    elapsed = time.perf_counter() - start
    table = pd.DataFrame([(key, m.count, m.sum, m.mean) for key, m in released],
                         columns=["partition", *METRICS]).set_index("partition")
    return table, elapsed


def rmse(released: pd.DataFrame, exact: pd.DataFrame, partitions) -> dict:
    if len(partitions) == 0:
        return {metric: None for metric in METRICS}
    errors = released.loc[partitions, list(METRICS)] - exact.loc[partitions, list(METRICS)]
    return {metric: float(np.sqrt(np.mean(errors[metric] ** 2))) for metric in METRICS}


def measure(run, frame, exact, epsilon, delta, repeats) -> tuple[dict, pd.Index]:
    """``repeats`` runs of one system: the median throughput, and RMSE and partitions kept
    averaged over the runs (one run's errors are dominated by its own sampling and noise)."""
    runs = [run(frame, epsilon, delta) for _ in range(repeats)]
    seconds = float(np.median([elapsed for _, elapsed in runs]))
    return {"rows_per_second": len(frame) / seconds, "seconds": seconds,
            "partitions_kept": float(np.mean([len(table) for table, _ in runs])),
            "rmse": {metric: float(np.mean([rmse(table, exact, table.index)[metric]
                                            for table, _ in runs])) for metric in METRICS},
            }, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10 ** 6)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    frame = synthetic(args.rows, args.seed)
    exact = truth(frame)
    report = {"rows": args.rows, "users": int(frame["user"].nunique()),
              "partitions": int(frame["partition"].nunique()), "epsilon": args.epsilon,
              "delta": args.delta, "repeats": args.repeats}
    runs = {}
    for name, run in (("sage_tfx", run_sage), ("pipeline_dp", run_pipeline_dp)):
        report[name], runs[name] = measure(run, frame, exact, args.epsilon, args.delta,
                                           args.repeats)
    # the partitions both kept, run by run
    for name in runs:
        report[name]["rmse_common"] = {metric: float(np.mean([
            rmse(ours if name == "sage_tfx" else theirs, exact,
                 ours.index.intersection(theirs.index))[metric]
            for (ours, _), (theirs, _) in zip(runs["sage_tfx"], runs["pipeline_dp"])]))
            for metric in METRICS}
    report["throughput_ratio"] = (report["sage_tfx"]["rows_per_second"]
                                  / report["pipeline_dp"]["rows_per_second"])
    if args.json:
        print(json.dumps(report))
        return
    for name in runs:
        entry = report[name]
        print(f"{name:12s} {entry['rows_per_second']:12,.0f} rows/s  kept "
              f"{entry['partitions_kept']:8.1f}  rmse " + "  ".join(
                  f"{m}={entry['rmse'][m]:.4g}" for m in METRICS)
              + "  (common: " + "  ".join(f"{m}={entry['rmse_common'][m]:.4g}"
                                          for m in METRICS) + ")")
    print(f"throughput_ratio {report['throughput_ratio']:.1f}")


if __name__ == "__main__":
    main()
