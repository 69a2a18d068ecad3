"""The DP aggregation operator against PipelineDP on the same query, data and budget (issue 18 §3),
or (``--engine beam``) its Beam engine against its local engine (issue 32).

    python benchmarks/aggregation.py [--rows N] [--epsilon E] [--delta D] [--seed S]
                                     [--repeats R] [--json] [--data longtail|taxi]
                                     [--noise laplace|gaussian] [--selection-weight W]
                                     [--quantiles]
    python benchmarks/aggregation.py --engine beam [--runner portable|direct|direct-processes]
                                     [--workers W] [--no-pipeline-dp] ...

Query: per partition COUNT(*), SUM(value) and MEAN(value), each row clamped into [0, 50], at most
C_u = 4 partitions per user and m = 2 rows per user and partition, Laplace noise (``--noise``:
both systems), (epsilon, delta) = (1, 1e-6) by default. PipelineDP 0.3.1 (LocalBackend,
NaiveBudgetAccountant, its default truncated-geometric selection) splits the budget into
selection, MEAN's count and MEAN's sum, and derives COUNT and SUM from MEAN's; sage-tfx's plan
does the same by default (selection weight 1, AVG 2, COUNT and the row-scoped SUM post-processed
from AVG), then composes the steps by PLD (budget.py) and selects partitions with its default
rule, the weighted Gaussian (mechanisms/selection.py). ``--selection-weight W`` gives sage-tfx's
selection step weight W instead of 1 (its other steps keep theirs).

``--quantiles``: a second query, the MEDIAN of the value ([0, 50], same C_u and m) against
PipelineDP's PERCENTILE(50) (Google's quantile tree), RMSE against the exact median.

Data (seeded): users = rows / 10, partitions = rows / 50 (10^5 and 2x10^4 at 10^6 rows);
user activity is log-normal (sigma 1.2: the heaviest users have ~100x the median's rows),
partition popularity Zipf(1), each user spreads its rows over 3 favourite partitions, values are
log-normal (median ~12, a tail past 50). ``--data taxi``: the Chicago taxi sample shipped with
TFX (15,002 real trips; ``--rows`` is ignored), grouped by pickup_community_area x
trip_start_hour, the value its fare; the unit is the trip (Sage's record-level default: no id
column), so every unit is in one partition.

Printed per system: ``rows_per_second`` (wall clock of the aggregation alone, the median of R
runs, input already in memory in each library's own form: a pandas frame, a list of tuples),
``rmse`` per metric over the partitions it kept (against the exact, unbounded statistic; the
contribution bounds' bias is most of it), ``rmse_common`` over the partitions both kept,
``partitions_kept``, each averaged over the R runs, and ``process_seconds`` (this process's
CPU seconds for the same call, median); the two systems run alternately, one run each per
round, so that both see the same load (``load_average``: the machine's as the runs ended);
``throughput_ratio`` (ours / PipelineDP's, wall
clock) and ``cpu_throughput_ratio`` (the same in CPU seconds: on a loaded machine a
sub-second run's wall clock is mostly waiting for a core, which a minute-long run averages
out).
PipelineDP is a benchmark-only dependency (requirements/benchmark.txt).

With ``--engine beam``: the same query and data through ``aggregate_with_beam`` (the frame
handed over in batches of 10^5 rows, as DPAggregate hands over its table), through PipelineDP
0.3.1's BeamBackend on the same runner and budget (its rows handed over the same way, as
tuples; ``--no-pipeline-dp`` leaves it out), and through the local engine, alternated run by
run so that all see the same load. Runners: the portable runner (Beam's job service and a
worker pool started for the run, W workers per job: tests/support/portable_runner.py), the
DirectRunner (``direct``: in this process for 1 worker, else W worker processes;
``direct-processes``: worker processes even for 1, to compare 1 and 2 workers at the same
per-job costs). Printed per system: ``rows_per_second`` and ``seconds`` (medians of the wall
clock of the whole call: for Beam that includes building and submitting the job, starting the
workers and the hand-back of the result), ``cpu_seconds`` (median CPU seconds of every process
of the run) and ``cpu_seconds_by_process``: ``driver`` (this one: pickling the batches; on the
DirectRunner also the runner and its shuffles), ``workers`` (the DoFns: the DirectRunner's
worker processes, or the portable runner's worker pool and its workers) and ``job_service``
(the portable runner's: every shuffle, and every element to and from the workers); Beam's
``fixed_seconds`` (the same call on 1,000 rows); ``beam_over_local`` (throughput ratio); and
with PipelineDP, ``pairs`` (per pair of runs, PipelineDP's wall and CPU seconds over ours) and
their medians ``beam_over_pipeline_dp_wall_ratio`` and ``_cpu_ratio``.
"""
import argparse
import contextlib
import functools
import json
import os
import sys
import time

import numpy as np
import pandas as pd

from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregateKind, AggregationQuery,
                                                BoundsScope, NoiseKind, aggregate, plan)

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


def taxi() -> pd.DataFrame:
    """The TFX taxi sample as (user = trip, partition = area * 100 + hour, value = fare); a trip
    without a pickup area is in area -1 (both systems see the same frame)."""
    import tfx

    trips = pd.read_csv(os.path.join(os.path.dirname(tfx.__file__), "examples",
                                     "chicago_taxi_pipeline", "data", "simple", "data.csv"))
    area = trips["pickup_community_area"].fillna(-1).astype(int)
    return pd.DataFrame({"user": np.arange(len(trips)),
                         "partition": area * 100 + trips["trip_start_hour"].astype(int),
                         "value": trips["fare"].astype(float)})


def truth(frame: pd.DataFrame) -> pd.DataFrame:
    grouped = frame.groupby("partition")["value"]
    return pd.DataFrame({"count": grouped.size(), "sum": grouped.sum(), "mean": grouped.mean(),
                         "median": grouped.median()})


def sage_query(noise: str = "laplace", quantiles: bool = False) -> AggregationQuery:
    aggregates = ((Aggregate.median("value", LOW, HIGH, name="median"),) if quantiles else (
        Aggregate.count("value", name="count"),  # no NULLs here: COUNT(*); MEAN derives it
        Aggregate(AggregateKind.SUM, "value", LOW, HIGH, scope=BoundsScope.ROW, name="sum"),
        Aggregate(AggregateKind.AVG, "value", LOW, HIGH, name="mean")))
    return AggregationQuery(
        ("partition",), "user", aggregates,
        max_partitions_contributed=MAX_PARTITIONS, max_contributions_per_partition=MAX_ROWS,
        noise=NoiseKind(noise))


def run_sage(frame: pd.DataFrame, epsilon: float, delta: float, noise: str = "laplace",
             selection_weight: float = 1.0, quantiles: bool = False
             ) -> tuple[pd.DataFrame, float]:
    query = sage_query(noise, quantiles)
    budget = plan(query, epsilon, delta,
                  weights={"partition_selection": selection_weight})
    clock = Clock()
    table = aggregate(frame, query, budget).table
    return table.set_index("partition")[[a.output_name for a in query.aggregates]], clock.read()


def beam_runner(arguments: list[str]):
    """``run(frame, epsilon, delta)`` of the Beam engine with these pipeline arguments."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from sage_tfx.dp_statistics.aggregation.beam import aggregate_with_beam

    def run(frame: pd.DataFrame, epsilon: float, delta: float) -> tuple[pd.DataFrame, float]:
        query = sage_query()
        budget = plan(query, epsilon, delta)
        clock = Clock()
        table = aggregate_with_beam(frame, query, budget,
                                    options=PipelineOptions(arguments)).table
        return table.set_index("partition")[list(METRICS)], clock.read()
    return run


def pipeline_dp_beam_runner(arguments: list[str]):
    """``run(frame, epsilon, delta)`` of PipelineDP's BeamBackend with these pipeline arguments:
    the query of ``run_pipeline_dp``, its rows (tuples) handed to the workers as the Beam
    engine's are (``run_transform``: pickled chunks of 10^5 rows, read by the workers), its
    result gathered into one list."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from sage_tfx.dp_statistics.aggregation.beam import _CHUNK_ROWS, run_transform

    class PipelineDPAggregate(beam.PTransform):
        def __init__(self, epsilon: float, delta: float):
            super().__init__()
            self._epsilon, self._delta = epsilon, delta

        def expand(self, chunks):
            import pipeline_dp

            accountant = pipeline_dp.NaiveBudgetAccountant(total_epsilon=self._epsilon,
                                                           total_delta=self._delta)
            engine = pipeline_dp.DPEngine(accountant, pipeline_dp.BeamBackend())
            result = engine.aggregate(chunks | "Rows" >> beam.FlatMap(list),
                                      pipeline_dp_params("laplace", False),
                                      pipeline_dp_extractors())
            accountant.compute_budgets()
            return result | "Gather" >> beam.combiners.ToList()

    def run(frame: pd.DataFrame, epsilon: float, delta: float) -> tuple[pd.DataFrame, float]:
        rows = list(frame[["user", "partition", "value"]].itertuples(index=False, name=None))
        clock = Clock()
        released = run_transform([rows[start:start + _CHUNK_ROWS]
                                  for start in range(0, len(rows), _CHUNK_ROWS)],
                                 PipelineDPAggregate(epsilon, delta), PipelineOptions(arguments))
        elapsed = clock.read()
        table = pd.DataFrame([(key, m.count, m.sum, m.mean) for key, m in released],
                             columns=["partition", *METRICS]).set_index("partition")
        return table, elapsed
    return run


@contextlib.contextmanager
def beam_arguments(runner: str, workers: int):
    """The pipeline arguments of ``runner`` with ``workers`` workers, its services running, and
    a function returning the CPU seconds each process has used so far. ``direct``: the
    DirectRunner in this process (1 worker) or with ``workers`` worker processes
    (multi-processing mode); ``direct-processes``: in that mode even for 1 worker (the same
    per-job costs as for 2, to compare the two)."""
    if runner in ("direct", "direct-processes"):
        mode = "in_memory" if runner == "direct" and workers == 1 else "multi_processing"
        yield ([f"--direct_num_workers={workers}", f"--direct_running_mode={mode}"],
               _driver_cpu)
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests"))
    from support.portable_runner import PortableRunner

    with PortableRunner(workers=workers) as services:
        # Beam 2.77's PortableRunner gives its job-state stream this deadline: a longer job
        # fails in the client (DEADLINE_EXCEEDED) at the default 300 s
        yield (services.options("--job_server_timeout=86400"),
               lambda: {**_driver_cpu(), **services.cpu_seconds()})


def _driver_cpu() -> dict:
    """This process's CPU seconds, and its finished children's (the DirectRunner's worker
    processes in multi-processing mode)."""
    times = os.times()
    return {"driver": times.user + times.system,
            "workers": times.children_user + times.children_system}


def pipeline_dp_params(noise: str, quantiles: bool):
    import pipeline_dp

    return pipeline_dp.AggregateParams(
        noise_kind=pipeline_dp.NoiseKind(noise),
        metrics=([pipeline_dp.Metrics.PERCENTILE(50)] if quantiles else
                 [pipeline_dp.Metrics.COUNT, pipeline_dp.Metrics.SUM, pipeline_dp.Metrics.MEAN]),
        max_partitions_contributed=MAX_PARTITIONS, max_contributions_per_partition=MAX_ROWS,
        min_value=LOW, max_value=HIGH)


def pipeline_dp_extractors():
    import pipeline_dp

    return pipeline_dp.DataExtractors(privacy_id_extractor=lambda row: row[0],
                                      partition_extractor=lambda row: row[1],
                                      value_extractor=lambda row: row[2])


def run_pipeline_dp(frame: pd.DataFrame, epsilon: float, delta: float, noise: str = "laplace",
                    quantiles: bool = False) -> tuple[pd.DataFrame, float]:
    import pipeline_dp

    rows = list(frame[["user", "partition", "value"]].itertuples(index=False, name=None))
    clock = Clock()
    accountant = pipeline_dp.NaiveBudgetAccountant(total_epsilon=epsilon, total_delta=delta)
    engine = pipeline_dp.DPEngine(accountant, pipeline_dp.LocalBackend())
    params, extractors = pipeline_dp_params(noise, quantiles), pipeline_dp_extractors()
    result = engine.aggregate(rows, params, extractors)
    accountant.compute_budgets()
    released = list(result)
    elapsed = clock.read()
    if quantiles:
        return pd.DataFrame([(key, m.percentile_50) for key, m in released],
                            columns=["partition", "median"]).set_index("partition"), elapsed
    table = pd.DataFrame([(key, m.count, m.sum, m.mean) for key, m in released],
                         columns=["partition", *METRICS]).set_index("partition")
    return table, elapsed


def rmse(released: pd.DataFrame, exact: pd.DataFrame, partitions) -> dict:
    metrics = list(released.columns)
    if len(partitions) == 0:
        return {metric: None for metric in metrics}
    errors = released.loc[partitions, metrics] - exact.loc[partitions, metrics]
    return {metric: float(np.sqrt(np.mean(errors[metric] ** 2))) for metric in metrics}


class Clock:
    """Wall-clock and this process's CPU seconds since it was made. On a shared machine the
    wall clock of a sub-second run is mostly waiting for a core; the CPU seconds are the work
    (both systems run in this one process, single-threaded)."""

    def __init__(self):
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self._wall, time.process_time() - self._cpu


def measure(run, frame, exact, epsilon, delta, repeats) -> tuple[dict, list]:
    """``repeats`` runs of one system, summarised (`summarise`)."""
    runs = [run(frame, epsilon, delta) for _ in range(repeats)]
    return summarise(runs, frame, exact), runs


def measure_alternating(systems: dict, frame, exact, epsilon, delta, repeats
                        ) -> dict[str, tuple[dict, list]]:
    """``repeats`` rounds, each running every system once in turn (so that all see the same
    load on a shared machine), each system's runs summarised (`summarise`)."""
    runs = {name: [] for name in systems}
    for _ in range(repeats):
        for name, run in systems.items():
            runs[name].append(run(frame, epsilon, delta))
    return {name: (summarise(runs[name], frame, exact), runs[name]) for name in systems}


def summarise(runs: list, frame, exact) -> dict:
    """One system's runs: the median throughput (wall clock and CPU seconds), and RMSE and
    partitions kept averaged over the runs (one run's errors are dominated by its own sampling
    and noise)."""
    seconds = float(np.median([wall for _, (wall, _) in runs]))
    cpu_seconds = float(np.median([cpu for _, (_, cpu) in runs]))
    metrics = list(runs[0][0].columns)
    return {"rows_per_second": len(frame) / seconds, "seconds": seconds,
            "process_seconds": cpu_seconds,
            "partitions_kept": float(np.mean([len(table) for table, _ in runs])),
            "rmse": {metric: float(np.mean([rmse(table, exact, table.index)[metric]
                                            for table, _ in runs])) for metric in metrics},
            }


def _mean_or_none(values: list):
    """The mean of the runs' values that exist (a run that kept no partition has no RMSE)."""
    values = [value for value in values if value is not None]
    return float(np.mean(values)) if values else None


def compare_engines(args, frame: pd.DataFrame, exact: pd.DataFrame, report: dict) -> None:
    """--engine beam: the Beam engine on ``args.runner`` against PipelineDP's BeamBackend on the
    same runner (unless --no-pipeline-dp) and against the local engine, alternated run by run
    (both Beam jobs see the same load); medians, and the ratio of each pair of runs."""
    report.update(runner=args.runner, workers=args.workers)
    systems = {"beam": None, "pipeline_dp_beam": None, "local": run_sage}
    if args.no_pipeline_dp:
        del systems["pipeline_dp_beam"]
    with beam_arguments(args.runner, args.workers) as (arguments, cpu_seconds):
        systems["beam"] = beam_runner(arguments)
        if "pipeline_dp_beam" in systems:
            systems["pipeline_dp_beam"] = pipeline_dp_beam_runner(arguments)
        _, (fixed, _) = systems["beam"](frame.iloc[:1000], args.epsilon, args.delta)  # wall
        runs = {name: [] for name in systems}
        for _ in range(args.repeats):
            for name, run in systems.items():
                before = cpu_seconds()
                table, (wall, _) = run(frame, args.epsilon, args.delta)
                after = cpu_seconds()
                # CPU seconds of every process (this one, the runner's workers and services)
                runs[name].append((table, wall, {process: after[process] - before[process]
                                                 for process in after}))
    for name, entries in runs.items():
        walls = [wall for _, wall, _ in entries]
        cpus = [sum(cpu.values()) for _, _, cpu in entries]
        # os.times() counts in clock ticks (10 ms): a run shorter than a tick can read 0 CPU
        # seconds, and then has no measured rate (None), not a division by zero.
        cpu_median = float(np.median(cpus))
        report[name] = {
            "rows_per_second": len(frame) / float(np.median(walls)),
            "seconds": float(np.median(walls)), "walls": walls,
            "cpu_seconds": cpu_median,
            "rows_per_cpu_second": len(frame) / cpu_median if cpu_median > 0 else None,
            "cpu_seconds_by_process": {process: float(np.median([cpu[process]
                                                                 for _, _, cpu in entries]))
                                       for process in entries[0][2]},
            "partitions_kept": float(np.mean([len(table) for table, _, _ in entries])),
            "rmse": {metric: _mean_or_none([rmse(table, exact, table.index)[metric]
                                            for table, _, _ in entries]) for metric in METRICS}}
    report["beam"]["fixed_seconds"] = fixed
    report["beam_over_local"] = (report["beam"]["rows_per_second"]
                                 / report["local"]["rows_per_second"])
    if "pipeline_dp_beam" in runs:
        pairs = list(zip(runs["beam"], runs["pipeline_dp_beam"]))
        report["pairs"] = [{"wall_ratio": theirs[1] / ours[1],
                            "cpu_ratio": sum(theirs[2].values()) / sum(ours[2].values())}
                           for ours, theirs in pairs]
        for ratio in ("wall_ratio", "cpu_ratio"):
            report[f"beam_over_pipeline_dp_{ratio}"] = float(np.median(
                [pair[ratio] for pair in report["pairs"]]))
    if args.json:
        print(json.dumps(report))
        return
    for name in runs:
        entry = report[name]
        print(f"{name:16s} {entry['rows_per_second']:12,.0f} rows/s  {entry['seconds']:8.1f} s  "
              f"CPU {entry['cpu_seconds']:8.1f} s  kept {entry['partitions_kept']:8.1f}")
    print(f"beam: {args.runner} runner, {args.workers} worker(s), fixed cost "
          f"{fixed:.1f} s per job; beam_over_local {report['beam_over_local']:.3f}")
    if "pairs" in report:
        print(f"beam over PipelineDP's BeamBackend, median of the pairs: wall "
              f"{report['beam_over_pipeline_dp_wall_ratio']:.1f}x, CPU "
              f"{report['beam_over_pipeline_dp_cpu_ratio']:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("compare", "beam"), default="compare",
                        help="compare: the local engine against PipelineDP (the default); "
                             "beam: the Beam engine against the local engine")
    parser.add_argument("--runner", choices=("portable", "direct", "direct-processes"),
                        default="portable",
                        help="with --engine beam: Beam's runner (direct: in this process for "
                             "1 worker, else worker processes; direct-processes: always)")
    parser.add_argument("--no-pipeline-dp", action="store_true",
                        help="with --engine beam: leave PipelineDP's BeamBackend out")
    parser.add_argument("--workers", type=int, default=1,
                        help="with --engine beam: SDK worker processes per job")
    parser.add_argument("--rows", type=int, default=10 ** 6)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--data", choices=("longtail", "taxi"), default="longtail")
    parser.add_argument("--noise", choices=("laplace", "gaussian"), default="laplace")
    parser.add_argument("--selection-weight", type=float, default=1.0)
    parser.add_argument("--quantiles", action="store_true")
    args = parser.parse_args()
    frame = synthetic(args.rows, args.seed) if args.data == "longtail" else taxi()
    exact = truth(frame)
    report = {"rows": len(frame), "users": int(frame["user"].nunique()),
              "partitions": int(frame["partition"].nunique()), "epsilon": args.epsilon,
              "delta": args.delta, "repeats": args.repeats, "data": args.data,
              "noise": args.noise, "selection_weight": args.selection_weight,
              "query": "median" if args.quantiles else "count_sum_mean"}
    if args.engine == "beam":
        compare_engines(args, frame, exact, report)
        return
    ours = functools.partial(run_sage, noise=args.noise, quantiles=args.quantiles,
                             selection_weight=args.selection_weight)
    theirs = functools.partial(run_pipeline_dp, noise=args.noise, quantiles=args.quantiles)
    measured = measure_alternating({"sage_tfx": ours, "pipeline_dp": theirs}, frame, exact,
                                   args.epsilon, args.delta, args.repeats)
    runs = {name: system_runs for name, (_, system_runs) in measured.items()}
    report.update({name: summary for name, (summary, _) in measured.items()})
    report["load_average"] = os.getloadavg()  # the machine's load as the runs ended
    # the partitions both kept, run by run
    for name in runs:
        report[name]["rmse_common"] = {metric: float(np.mean([
            rmse(ours if name == "sage_tfx" else theirs, exact,
                 ours.index.intersection(theirs.index))[metric]
            for (ours, _), (theirs, _) in zip(runs["sage_tfx"], runs["pipeline_dp"])]))
            for metric in report[name]["rmse"]}
    report["partitions_ratio"] = (report["sage_tfx"]["partitions_kept"]
                                  / report["pipeline_dp"]["partitions_kept"])
    report["throughput_ratio"] = (report["sage_tfx"]["rows_per_second"]
                                  / report["pipeline_dp"]["rows_per_second"])
    report["cpu_throughput_ratio"] = (report["pipeline_dp"]["process_seconds"]
                                      / report["sage_tfx"]["process_seconds"])
    if args.json:
        print(json.dumps(report))
        return
    for name in runs:
        entry = report[name]
        print(f"{name:12s} {entry['rows_per_second']:12,.0f} rows/s  kept "
              f"{entry['partitions_kept']:8.1f}  rmse " + "  ".join(
                  f"{m}={entry['rmse'][m]:.4g}" for m in entry["rmse"])
              + "  (common: " + "  ".join(f"{m}={entry['rmse_common'][m]:.4g}"
                                          for m in entry["rmse"]) + ")")
    print(f"throughput_ratio {report['throughput_ratio']:.1f} (CPU seconds: "
          f"{report['cpu_throughput_ratio']:.1f})")


if __name__ == "__main__":
    main()
