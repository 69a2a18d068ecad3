"""DP-SQLP against the paper's two baselines on §5.1's synthetic stream (issue 19 §3; DP-SQLP
§5, Table 1 and Figure 9).

    python benchmarks/streaming.py [--users U] [--keys K] [--mean-records-per-user R]
        [--contribution-limit C] [--micro-batches B] [--epsilon E] [--delta D] [--seed S]
        [--baseline-rows-per-key M] [--baseline-accounting gaussian|paper]
        [--baseline-2-accounting participations|joint] [--baseline-1-final-only]
        [--mechanism tree|factorization|auto] [--noise-seed N] [--no-baseline-2] [--json]
    python benchmarks/streaming.py --latency [--latency-micro-batches 1000,300,100,30,10]
        [--users U ...] [--json]
    python benchmarks/streaming.py --beam [--repeats N] [--shards S] [--bundle-rows R]
        [--users U ...] [--json]

``--beam`` (issue 47): the Beam engine (dp_statistics/continual/beam.py, on the streaming
DirectRunner fed by a TestStream that replays the stream's micro-batches) against the local engine
(local.run_local, as ``sage-tfx stream`` replays a window) on the same stream, query and noise
key, runs alternated ``--repeats`` times so both see the same load; medians of wall and CPU
seconds (this process's, every thread) and records per CPU second. Both get the unit and key
ids as text (what sources.py reads from a file); the local engine's integer-id fast path is
measured beside (``local_integer_ids``). The final releases must be the same bits
(``same_bits``). Run with a checkout of the engine before issue 47 on PYTHONPATH, the Beam
engine is fed one StreamRecord per record (its only input then). The streaming DirectRunner runs
one process: its 1-worker figure is the only one (no multi-worker streaming runner runs here:
tests/conformance/test_continual.py).

The stream (streaming_data.py): Zipf-Mandelbrot records per user and keys, records uniform over
one day, split into B micro-batches of equal event-time width. The query is the paper's
``SELECT key, COUNT(*) GROUP BY key`` (L = 1), the release after the last micro-batch is compared
with the true final histogram (COUNT(*) per key over the whole stream, before any contribution
bound). Every system bounds each user to its first C records in arrival order (the paper's
global contribution bound) and spends (epsilon, delta) on the whole window.

Printed per system: ``keys_kept`` (keys in the final release), ``l_inf``, ``l_1``, ``l_2``
(of released - true over the whole key space; a key not released estimates 0) and
``records_per_s`` (all generated records over the wall clock from the records in memory to the
final histogram: bounding, every query or micro-batch step, the final sum; generation excluded).
In the JSON, ``vs_bounded`` holds the same errors against the contribution-bounded histogram
(each user's first C records: what every system estimates), i.e. the error of the DP mechanism
alone, without the bounding bias every C-bounded system shares.

The baselines (the paper's §5, run on issue 18's operator)
---------------------------------------------------------
Both run ``sage_tfx.dp_statistics.aggregation`` (the in-process engine) with Gaussian noise and
Gaussian-thresholding partition selection, ``max_partitions_contributed`` = C (never binds: a
user has at most C records) and ``max_contributions_per_partition`` = M (default 1: the
operator's COUNT sensitivity is sqrt(C_u) * M in L2, tight only at M = 1; a user's records
rarely repeat a key, so M = 1 drops ~0.1% of the bounded records at the default scale; the
report's ``dropped_by_rows_per_key`` says how many). One query at plan(eps_q, delta_q) runs
two Gaussian steps (selection, COUNT; eps_q / 2 each) whose composed event E_q describes it
except for the thresholding's ``additional_delta`` a_q = delta_q / 4 (the plan gives the
selection delta_q / 2, half of it for tau), which composes by addition (mechanisms.Release).

Baseline 1, repeated one-shot query. At every trigger t = 1..B, one query on all records of
micro-batches 1..t (their bounded prefix: the first C records of a prefix are the prefix of the
first C records, so this is the same global bound); the final histogram is query B's release.
A user's records are read by every query from its first record's micro-batch on, so
neighbouring streams differ in the input of up to k = B queries; the others see the same data.
The whole run is SelfComposed(E_q, k) plus k * a_q of delta.

Baseline 2, incremental one-shot query. One query per micro-batch, on that micro-batch's
bounded records; the final histogram is the sum of the B releases (a key not released by a
micro-batch adds 0; keys_kept counts keys released by any). A user's at most C bounded records
lie in at most k = min(B, C) micro-batches, and the queries on the others see the same data on
neighbouring streams: SelfComposed(E_q, k) plus k * a_q of delta. This is the paper's (and the
issue's) accounting; ``--baseline-2-accounting joint`` instead treats the B queries as one
Gaussian mechanism on the concatenated (micro-batch, key) vectors: a user's bounded records
change at most C unit counts by 1 (L2 sqrt(C), one query's selection sensitivity) and its
row counts by an L2 norm of at most sqrt(C M) <= sqrt(C) M (one query's COUNT sensitivity),
and create at most C new (micro-batch, key) partitions, so k = 1: every micro-batch spends the
whole budget (a stronger baseline than the paper's).

Calibration (both). delta/3 goes to the thresholds (k * a_q = delta / 3, i.e. delta_q =
4 delta / (3 k)), 2 delta / 3 to the Gaussian composition (DP-SQLP's own 2 : 1 split); eps_q is
the largest per-query epsilon whose k-fold composition is epsilon-DP at 2 delta / 3 under
dp-accounting's exact analytic-Gaussian loss (the composition of Gaussian mechanisms is a
Gaussian mechanism, so nothing is lost). ``--baseline-accounting paper`` instead composes each
query as a black-box (eps_q, delta_q)-DP mechanism under the optimal composition theorem, as
the paper's §5 does (calibrate_one_shot): sound, looser, weaker baselines.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pickle
import tempfile
import time
from typing import Optional

import numpy as np
import pandas as pd
from dp_accounting import dp_event
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution
from scipy import optimize

from sage_tfx import mechanisms
from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregationQuery, NoiseKind,
                                                SelectionRule, aggregate, plan)
from sage_tfx.dp_statistics.continual import budget as stream_budget
from sage_tfx.dp_statistics.continual import local, operator, spec

# Run as a script, the benchmarks/ folder is on sys.path (tests load both files by path).
from streaming_data import Stream, generate

SYSTEMS = ("dp_sqlp", "baseline_1", "baseline_2")
METRICS = ("keys_kept", "l_inf", "l_1", "l_2", "records_per_s")
THRESHOLD_SHARE_OF_DELTA = 1.0 / 3.0


def first_records_per_user(stream: Stream, limit: int) -> np.ndarray:
    """The global contribution bound every system applies: each user's first ``limit`` records
    in arrival order (the operator's own bounding, on the whole stream at once)."""
    return operator.kept_mask(stream.user, np.zeros(stream.users, dtype=np.int64), limit)


def utility(estimate: np.ndarray, truth: np.ndarray, released: np.ndarray) -> dict:
    """The paper's metrics of a final histogram: ``estimate`` per key (0 where not released),
    ``released`` the mask of keys in the release."""
    error = np.abs(estimate - truth)
    return {"keys_kept": int(released.sum()), "l_inf": float(error.max(initial=0.0)),
            "l_1": float(error.sum()), "l_2": float(np.sqrt(error @ error))}


# --- the baselines ---------------------------------------------------------------------------

def count_query(contribution_limit: int, rows_per_key: int) -> AggregationQuery:
    return AggregationQuery(("key",), "user", (Aggregate.count(),),
                            max_partitions_contributed=contribution_limit,
                            max_contributions_per_partition=rows_per_key,
                            selection=SelectionRule.GAUSSIAN_THRESHOLD, noise=NoiseKind.GAUSSIAN)


@dataclasses.dataclass(frozen=True)
class OneShotBudget:
    """Each query's plan, and the k-fold composition it was calibrated for (module docstring)."""
    plan: object
    compositions: int
    accounting: str

    def describe(self) -> dict:
        steps = {s.name: s.event.noise_multiplier for s in self.plan.steps}
        return {"accounting": self.accounting, "compositions": self.compositions,
                "query_epsilon": self.plan.epsilon, "query_delta": self.plan.delta,
                "threshold_delta": self.compositions * self.plan.additional_delta,
                "noise_multipliers": steps}


def gaussian_equivalent(event: dp_event.DpEvent, compositions: int) -> float:
    """The noise multiplier of one Gaussian equivalent to the k-fold composition of a plan's
    Gaussian steps: Gaussian mechanisms with multipliers m_i compose exactly to multiplier
    (sum_i m_i^-2)^-1/2 (their privacy losses are Gaussian; means and variances add: Dong,
    Roth & Su's mu-GDP composition). dp-accounting's PLD accountant on the k-fold
    SelfComposedDpEvent agrees up to its discretisation but takes ~20 s at k = 1000."""
    steps = event.events if isinstance(event, dp_event.ComposedDpEvent) else [event]
    if not all(isinstance(step, dp_event.GaussianDpEvent) for step in steps):
        raise ValueError(f"expected Gaussian steps, got {event}")
    return (compositions * sum(step.noise_multiplier ** -2 for step in steps)) ** -0.5


def _largest(feasible_slack, epsilon: float) -> float:
    """The largest per-query epsilon with feasible_slack >= 0 (the slack decreases in it)."""
    query_epsilon = optimize.brentq(feasible_slack, epsilon * 1e-5, 4.0 * epsilon, xtol=1e-10)
    while feasible_slack(query_epsilon) < 0:  # brentq may land a hair on the wrong side
        query_epsilon *= 1 - 1e-9
    return query_epsilon


def calibrate_one_shot(query: AggregationQuery, epsilon: float, delta: float,
                       compositions: int, accounting: str = "gaussian") -> OneShotBudget:
    """The largest per-query epsilon whose k-fold composition meets (epsilon, delta).

    ``gaussian`` (the default, the tightest sound accounting of what runs): the composed
    Gaussian's multiplier is at least dp-accounting's exact analytic-Gaussian one for
    (epsilon, 2 delta / 3), and the thresholds spend delta / 3 (module docstring).
    ``paper`` (DP-SQLP §5's own: "each one-shot execution guarantees (eps, delta)-DP ... the
    optimal composition theorem"): each query is a black-box (eps_q, delta_q)-DP mechanism,
    delta_q = delta / (2k) (thresholds included), and dp-accounting's PLD of the generic
    (eps_q, delta_q) mechanism, self-composed k times, is the optimal composition (Kairouz, Oh &
    Viswanath 2015) at delta. Sound but looser: it forgets that the noise is Gaussian."""
    if accounting == "paper":
        query_delta = delta / (2.0 * compositions)

        def slack(query_epsilon: float) -> float:
            generic = privacy_loss_distribution.from_privacy_parameters(
                pld_common.DifferentialPrivacyParameters(query_epsilon, query_delta))
            return epsilon - generic.self_compose(compositions).get_epsilon_for_delta(delta)

        query_plan = plan(query, _largest(slack, epsilon), query_delta)
        return OneShotBudget(query_plan, compositions, accounting)
    query_delta = 4.0 * delta * THRESHOLD_SHARE_OF_DELTA / compositions
    needed = mechanisms.gaussian_sigma(l2_sensitivity=1.0, epsilon=epsilon,
                                       delta=delta * (1.0 - THRESHOLD_SHARE_OF_DELTA))
    query_epsilon = _largest(lambda query_epsilon: gaussian_equivalent(
        plan(query, query_epsilon, query_delta).event, compositions) - needed, epsilon)
    query_plan = plan(query, query_epsilon, query_delta)
    threshold_delta = compositions * query_plan.additional_delta
    if threshold_delta > delta * THRESHOLD_SHARE_OF_DELTA * (1 + 1e-9):
        raise AssertionError(f"the thresholds spend delta {threshold_delta}, more than planned")
    return OneShotBudget(query_plan, compositions, accounting)


def _released(frame: pd.DataFrame, budget: OneShotBudget, keys: int) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    table = aggregate(frame, budget.plan.query, budget.plan).table
    estimate, released = np.zeros(keys), np.zeros(keys, dtype=bool)
    index = table["key"].to_numpy(dtype=np.int64)
    estimate[index], released[index] = table["count"].to_numpy(), True
    return estimate, released


@dataclasses.dataclass(frozen=True)
class Run:
    estimate: np.ndarray
    released: np.ndarray
    seconds: float
    details: dict
    step_seconds: Optional[np.ndarray] = None  # DP-SQLP: wall clock of each trigger


def _bounded_batches(stream: Stream, micro_batches: int, contribution_limit: int):
    """The bounded records and the end offset of each micro-batch among them (records arrive in
    event-time order, so micro-batches are contiguous)."""
    kept = first_records_per_user(stream, contribution_limit)
    frame = pd.DataFrame({"key": stream.key[kept], "user": stream.user[kept]})
    return frame, np.r_[0, np.cumsum(kept)][micro_batch_ends(stream, micro_batches)]


def run_baseline_1(stream: Stream, budget: OneShotBudget, micro_batches: int,
                   contribution_limit: int, final_only: bool = False) -> Run:
    start = time.perf_counter()
    frame, ends = _bounded_batches(stream, micro_batches, contribution_limit)
    triggers = ends[-1:] if final_only else ends
    for end in triggers:  # every trigger's release; the last one is the final histogram
        estimate, released = _released(frame.iloc[:end], budget, stream.keys)
    seconds = time.perf_counter() - start
    return Run(estimate, released, seconds, {"queries_run": len(triggers)})


def run_baseline_2(stream: Stream, budget: OneShotBudget, micro_batches: int,
                   contribution_limit: int) -> Run:
    start = time.perf_counter()
    frame, ends = _bounded_batches(stream, micro_batches, contribution_limit)
    estimate, released = np.zeros(stream.keys), np.zeros(stream.keys, dtype=bool)
    for begin, end in zip(np.r_[0, ends[:-1]], ends):
        batch_estimate, batch_released = _released(frame.iloc[begin:end], budget, stream.keys)
        estimate += batch_estimate
        released |= batch_released
    return Run(estimate, released, time.perf_counter() - start, {"queries_run": micro_batches})


# --- DP-SQLP ------------------------------------------------------------------------------

def stream_query(epsilon: float, delta: float, micro_batches: int,
                 contribution_limit: int, mechanism: str = "auto") -> spec.StreamQuery:
    return spec.StreamQuery(key_column="key", unit_column="user", time_column="time",
                            contribution_limit=contribution_limit, micro_batches=micro_batches,
                            epsilon=epsilon, delta=delta, mechanism=mechanism)


def noise_key(seed: Optional[int]) -> Optional[bytes]:
    """The operator's noise key: fresh from the CSPRNG (None), or, to compare the tree and the
    factorization on the same noise streams, SHA-256 of the seed (a benchmark, never a
    release: a key anyone can recompute protects nothing)."""
    return None if seed is None else hashlib.sha256(f"noise-seed-{seed}".encode()).digest()


def micro_batch_ends(stream: Stream, micro_batches: int) -> np.ndarray:
    """The end offset of each micro-batch in the stream (records arrive in event-time order,
    so micro-batches are contiguous)."""
    return np.searchsorted(stream.micro_batch(micro_batches), np.arange(1, micro_batches + 1))


def run_dp_sqlp(stream: Stream, query: spec.StreamQuery, budget, state_dir: str,
                key: Optional[bytes] = None, take_ahead: int = local.REPLAY_TAKE_AHEAD) -> Run:
    """The in-process engine (``local.run_local``, durable state in ``state_dir``) over the
    stream's micro-batches; the final histogram is the last trigger's release. A trigger's
    time is the wall clock since the previous release (the first: since the start).
    `take_ahead`: micro-batches taken per sync, as `sage-tfx stream` replays a window by
    default; 1 measures each trigger as a live stream runs it."""
    start = time.perf_counter()
    stamps = [start]
    ends = micro_batch_ends(stream, query.micro_batches)
    batches = ((step, pd.DataFrame({"unit": stream.user[begin:end], "key": stream.key[begin:end]}))
               for step, (begin, end) in enumerate(zip(np.r_[0, ends[:-1]], ends), start=1))
    last = []

    def sink(release: operator.TriggerRelease) -> None:
        last[:] = [release]
        stamps.append(time.perf_counter())

    local.run_local(query, budget, batches, state_dir, sink, noise_key=key,
                    take_ahead=take_ahead)
    release = last[0]
    estimate, released = np.zeros(stream.keys), np.zeros(stream.keys, dtype=bool)
    index = release.keys.astype(np.int64)
    estimate[index], released[index] = release.values, True
    return Run(estimate, released, time.perf_counter() - start,
               {"guarantee": release.guarantee, "mechanism": str(budget.mechanism)},
               np.diff(stamps))


def dropped_by_rows_per_key(stream: Stream, contribution_limit: int, rows_per_key: int) -> int:
    """Bounded records beyond the first M of a (user, key) pair: what the baselines' per-key
    bound drops on top of the global one."""
    kept = first_records_per_user(stream, contribution_limit)
    _, per_pair = np.unique(stream.user[kept] * stream.keys + stream.key[kept],
                            return_counts=True)
    return int(np.maximum(per_pair - rows_per_key, 0).sum())


# --- the Beam engine against the local engine (issue 47) ----------------------------------

def _text_ids(stream: Stream) -> tuple[np.ndarray, np.ndarray]:
    return stream.user.astype(str).astype(object), stream.key.astype(str).astype(object)


def _timed(run) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = run()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def run_local_engine(stream: Stream, units: np.ndarray, keys: np.ndarray,
                     query: spec.StreamQuery, budget, batches, key: bytes):
    """The final release of local.run_local over the stream's micro-batches (a replay)."""
    steps = batches.window.micro_batch_of(stream.time, query.micro_batches)
    ends = np.searchsorted(steps, np.arange(1, query.micro_batches + 1), side="right")
    frames = ((step, pd.DataFrame({"unit": units[begin:end], "key": keys[begin:end]}))
              for step, (begin, end) in enumerate(zip(np.r_[0, ends[:-1]], ends), start=1))
    last = []
    with tempfile.TemporaryDirectory(prefix="dp-sqlp-state-") as state_dir:
        local.run_local(query, budget, frames, state_dir, lambda r: last.__setitem__(
            slice(None), [r]), noise_key=key, take_ahead=local.REPLAY_TAKE_AHEAD)
    return {str(k): np.float64(v).tobytes() for k, v in zip(last[0].keys, last[0].values)}


def run_beam_engine(stream: Stream, units: np.ndarray, keys: np.ndarray,
                    query: spec.StreamQuery, budget, batches, key: bytes, shards: int,
                    bundle_rows: int):
    """The final release of the Beam engine on the streaming DirectRunner: a TestStream
    replaying each micro-batch, the watermark stepping through each trigger's stage instants.
    The batched engine reads blocks: the stream is written as Arrow files of at most
    ``bundle_rows`` records (not timed, as the local engine's input is in memory), the
    TestStream carries their paths and a ``ReadBlock`` step reads each into a RecordBatch (a
    TestStream carrying the records themselves pickles and bz2-compresses all of them into the
    pipeline proto: 23 of 60 s at 10^6 records, a cost of the test source, not of the engine).
    An engine without RecordBatch gets one StreamRecord per record."""
    import apache_beam as beam
    import pyarrow as pa
    from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
    from apache_beam.testing.test_stream import TestStream
    from apache_beam.transforms.window import TimestampedValue

    from sage_tfx.dp_statistics.continual import beam as engine

    batched = hasattr(engine, "RecordBatch")
    steps = batches.window.micro_batch_of(stream.time, query.micro_batches)
    ends = np.searchsorted(steps, np.arange(1, query.micro_batches + 1), side="right")
    replay = TestStream()
    blocks = tempfile.TemporaryDirectory(prefix="dp-sqlp-blocks-")
    for step, (begin, end) in enumerate(zip(np.r_[0, ends[:-1]], ends), start=1):
        if batched:
            elements = []
            for low in range(begin, end, bundle_rows):
                high = min(low + bundle_rows, end)
                path = os.path.join(blocks.name, f"{low}.arrow")
                with pa.OSFile(path, "wb") as sink:
                    table = pa.table({"unit": units[low:high], "key": keys[low:high],
                                      "time": stream.time[low:high],
                                      "order": np.arange(low, high)})
                    with pa.ipc.new_file(sink, table.schema) as writer:
                        writer.write_table(table)
                elements.append(TimestampedValue(path, float(stream.time[low])))
        else:
            elements = [TimestampedValue(engine.StreamRecord(units[i], keys[i], 0.0, i),
                                         float(stream.time[i])) for i in range(begin, end)]
        if elements:
            replay = replay.add_elements(elements)
        for stage in range(engine.STAGES):
            replay = replay.advance_watermark_to(batches.trigger_timestamp(step, stage))
    options = PipelineOptions([])
    options.view_as(StandardOptions).streaming = True
    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/updates.pickle"

        def save(update):  # one append (O_APPEND: whole) per released key and trigger
            descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(descriptor, pickle.dumps(tuple(update)))
            finally:
                os.close(descriptor)

        transform = (engine.ContinualReleaseTransform(query, budget, batches, key,
                                                      shards or engine.DEFAULT_SHARDS)
                     if batched else engine.ContinualReleaseTransform(query, budget, batches, key))
        def read_block(path):
            with pa.memory_map(path) as source:
                table = pa.ipc.open_file(source).read_all()
            return engine.RecordBatch.of(
                table["unit"].to_numpy(), table["key"].to_numpy(), np.zeros(len(table)),
                table["time"].to_numpy(), table["order"].to_numpy())

        with beam.Pipeline(options=options) as pipeline:
            records = pipeline | replay.advance_watermark_to_infinity()
            if batched:
                records = records | "ReadBlock" >> beam.Map(read_block)
            _ = records | transform | beam.Map(save)
        blocks.cleanup()
        updates = []
        if os.path.exists(path):
            with open(path, "rb") as source:
                while source.peek(1):
                    updates.append(engine.ReleaseUpdate(*pickle.load(source)))
    final = engine.histograms(updates, query.micro_batches)[-1]
    return {str(k): np.float64(v).tobytes() for k, v in final.items()}


def beam_vs_local(args: argparse.Namespace) -> dict:
    from sage_tfx.dp_statistics.continual.beam import MicroBatches
    from sage_tfx.dp_statistics.continual.sources import Window
    from streaming_data import WINDOW_SECONDS

    stream = generate(args.users, args.keys, args.mean_records_per_user, args.seed)
    units, keys = _text_ids(stream)
    query = stream_query(args.epsilon, args.delta, args.micro_batches, args.contribution_limit,
                         args.mechanism)
    dp_budget = stream_budget.plan(args.epsilon, args.delta, args.micro_batches,
                                   args.contribution_limit, mechanism=args.mechanism)
    batches = MicroBatches(Window(("day",), ((0.0, WINDOW_SECONDS),)), args.micro_batches)
    key = noise_key(args.noise_seed if args.noise_seed is not None else 0)
    systems = {
        "beam": lambda: run_beam_engine(stream, units, keys, query, dp_budget, batches, key,
                                        args.shards, args.bundle_rows),
        "local": lambda: run_local_engine(stream, units, keys, query, dp_budget, batches, key),
        "local_integer_ids": lambda: run_local_engine(stream, stream.user, stream.key, query,
                                                      dp_budget, batches, key)}
    runs = {name: [] for name in systems}
    releases = {}
    for _ in range(args.repeats):  # alternated: every system sees the same load
        for name, run in systems.items():
            releases[name], wall, cpu = _timed(run)
            runs[name].append((wall, cpu))
    report = {"config": {"users": args.users, "keys": args.keys, "records": len(stream),
                         "micro_batches": args.micro_batches,
                         "contribution_limit": args.contribution_limit,
                         "mechanism": str(dp_budget.mechanism), "shards": args.shards,
                         "bundle_rows": args.bundle_rows, "repeats": args.repeats,
                         "runner": "DirectRunner (streaming, one process)"},
              "same_bits": releases["beam"] == releases["local"] == releases[
                  "local_integer_ids"],
              "keys_released": len(releases["local"])}
    for name, timings in runs.items():
        wall = float(np.median([w for w, _ in timings]))
        cpu = float(np.median([c for _, c in timings]))
        report[name] = {"wall_s": wall, "cpu_s": cpu, "records_per_s": len(stream) / wall,
                        "records_per_cpu_s": len(stream) / cpu,
                        "wall_s_runs": [w for w, _ in timings],
                        "cpu_s_runs": [c for _, c in timings]}
    report["beam_over_local_per_cpu_s"] = (report["beam"]["records_per_cpu_s"]
                                           / report["local"]["records_per_cpu_s"])
    report["beam_over_local_integer_ids_per_cpu_s"] = (
        report["beam"]["records_per_cpu_s"] / report["local_integer_ids"]["records_per_cpu_s"])
    return report


# --- the command -----------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=10 ** 6)
    parser.add_argument("--keys", type=int, default=10 ** 5)
    parser.add_argument("--mean-records-per-user", type=float, default=10.0)
    parser.add_argument("--contribution-limit", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=100)
    parser.add_argument("--epsilon", type=float, default=6.0)
    parser.add_argument("--delta", type=float, default=1e-9)
    parser.add_argument("--seed", type=int, default=0, help="the data generator's seed")
    parser.add_argument("--baseline-rows-per-key", type=int, default=1,
                        help="the baselines' max_contributions_per_partition M")
    parser.add_argument("--baseline-2-accounting", choices=("participations", "joint"),
                        default="participations")
    parser.add_argument("--baseline-accounting", choices=("gaussian", "paper"),
                        default="gaussian", help="how the baselines' queries compose "
                        "(calibrate_one_shot): exactly as Gaussians, or as the paper's "
                        "black-box (eps, delta) mechanisms under the optimal composition")
    parser.add_argument("--baseline-1-final-only", action="store_true",
                        help="run only baseline 1's last query (its utility is the same; its "
                             "records_per_s is then not measured)")
    parser.add_argument("--no-baseline-2", action="store_true",
                        help="skip baseline 2 (B one-shot queries, the slowest system at the "
                             "paper's scale)")
    parser.add_argument("--dp-sqlp-only", action="store_true",
                        help="skip both baselines (baseline 1's aggregation peaks at 14 GB at "
                             "the paper's scale: DP-SQLP alone needs 2.5 GB there)")
    parser.add_argument("--latency", action="store_true",
                        help="instead: DP-SQLP's per-micro-batch latency vs micro-batch size")
    parser.add_argument("--latency-micro-batches", type=lambda text: [
        int(part) for part in text.split(",")], default=[1000, 300, 100, 30, 10],
        help="the micro-batch counts the latency mode cuts the stream into (comma-separated)")
    parser.add_argument("--mechanism", choices=spec.StreamMechanism.values(), default="auto",
                        help="DP-SQLP's running sums: binary trees, the BLT square-root "
                             "factorization, or the one of smaller expected error for B")
    parser.add_argument("--noise-seed", type=int, default=None,
                        help="derive DP-SQLP's noise key from this seed (the same noise streams "
                             "for two runs; default: a fresh key)")
    parser.add_argument("--beam", action="store_true",
                        help="instead: the Beam engine against the local engine (issue 47)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="--beam: alternated runs of each engine (medians reported)")
    parser.add_argument("--shards", type=int, default=None,
                        help="--beam: the Beam engine's unit and key shards (default: its own)")
    parser.add_argument("--bundle-rows", type=int, default=100_000,
                        help="--beam: records per RecordBatch the replay emits")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("users", "keys", "contribution_limit", "micro_batches",
                 "baseline_rows_per_key"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if not all(count >= 1 for count in args.latency_micro_batches):
        parser.error("--latency-micro-batches must be positive integers")
    if not (args.epsilon > 0 and 0 < args.delta < 1):
        parser.error("--epsilon must be positive and --delta in (0, 1)")
    return args


def benchmark(args: argparse.Namespace) -> dict:
    stream = generate(args.users, args.keys, args.mean_records_per_user, args.seed)
    truth = stream.true_histogram()
    query = count_query(args.contribution_limit, args.baseline_rows_per_key)
    b1_budget = calibrate_one_shot(query, args.epsilon, args.delta, args.micro_batches,
                                   args.baseline_accounting)
    b2_budget = calibrate_one_shot(
        query, args.epsilon, args.delta,
        1 if args.baseline_2_accounting == "joint"
        else min(args.micro_batches, args.contribution_limit), args.baseline_accounting)
    law = stream.records_law
    report = {"config": {
        "users": args.users, "keys": args.keys, "records": len(stream),
        "mean_records_per_user_asked": args.mean_records_per_user,
        "records_per_user_law": {"shift": 26.0, "exponent": law.exponent, "mean": law.mean,
                                 "fraction_above_10": law.above_ten,
                                 "percentile_99": law.percentile_99},
        "records_kept_by_contribution_limit": int(first_records_per_user(
            stream, args.contribution_limit).sum()),
        "contribution_limit": args.contribution_limit, "micro_batches": args.micro_batches,
        "epsilon": args.epsilon, "delta": args.delta, "seed": args.seed,
        "baseline_rows_per_key": args.baseline_rows_per_key,
        "dropped_by_rows_per_key": dropped_by_rows_per_key(stream, args.contribution_limit,
                                                           args.baseline_rows_per_key),
        "baseline_accounting": args.baseline_accounting,
        "baseline_2_accounting": args.baseline_2_accounting}}
    query = stream_query(args.epsilon, args.delta, args.micro_batches, args.contribution_limit,
                         args.mechanism)
    dp_budget = stream_budget.plan(args.epsilon, args.delta, args.micro_batches,
                                   args.contribution_limit, mechanism=args.mechanism)
    with tempfile.TemporaryDirectory(prefix="dp-sqlp-state-") as state_dir:
        dp_sqlp = run_dp_sqlp(stream, query, dp_budget, state_dir, noise_key(args.noise_seed))
    runs = {
        "dp_sqlp": (dp_sqlp, {"selection_sigma": dp_budget.selection_sigma,
                              "value_sigma": dp_budget.value_sigma, "beta": dp_budget.beta})}
    if not args.dp_sqlp_only:
        runs["baseline_1"] = (run_baseline_1(stream, b1_budget, args.micro_batches,
                                             args.contribution_limit, args.baseline_1_final_only),
                              b1_budget.describe())
    if not (args.no_baseline_2 or args.dp_sqlp_only):
        runs["baseline_2"] = (run_baseline_2(stream, b2_budget, args.micro_batches,
                                             args.contribution_limit), b2_budget.describe())
    bounded = np.bincount(stream.key[first_records_per_user(stream, args.contribution_limit)],
                          minlength=stream.keys).astype(np.float64)
    for name, (run, budget) in runs.items():
        entry = utility(run.estimate, truth, run.released)
        entry["vs_bounded"] = utility(run.estimate, bounded, run.released)
        measured = name != "baseline_1" or not args.baseline_1_final_only
        entry["records_per_s"] = len(stream) / run.seconds if measured else None
        entry["seconds"] = run.seconds
        entry["budget"] = budget
        entry.update(run.details)
        report[name] = entry
    return report


def latency(args: argparse.Namespace) -> dict:
    """Figure 9's shape: DP-SQLP's per-micro-batch latency as the micro-batch grows, on one
    stream cut into fewer, larger micro-batches. A trigger's latency is the wall clock between
    consecutive releases (building the micro-batch, the pending mark, the step, the commit;
    the first also opens the state)."""
    stream = generate(args.users, args.keys, args.mean_records_per_user, args.seed)
    rows = []
    for micro_batches in args.latency_micro_batches:
        query = stream_query(args.epsilon, args.delta, micro_batches, args.contribution_limit,
                             args.mechanism)
        budget = stream_budget.plan(args.epsilon, args.delta, micro_batches,
                                    args.contribution_limit, mechanism=args.mechanism)
        with tempfile.TemporaryDirectory(prefix="dp-sqlp-state-") as state_dir:
            run = run_dp_sqlp(stream, query, budget, state_dir, noise_key(args.noise_seed),
                              take_ahead=1)  # each trigger's own latency, as a live stream
        seconds = run.step_seconds
        rows.append({"micro_batches": micro_batches,
                     "records_per_micro_batch": len(stream) / micro_batches,
                     "latency_s_median": float(np.median(seconds)),
                     "latency_s_mean": float(seconds.mean()),
                     "latency_s_p90": float(np.percentile(seconds, 90)),
                     "records_per_s": len(stream) / run.seconds})
    return {"config": {"users": args.users, "keys": args.keys, "records": len(stream),
                       "contribution_limit": args.contribution_limit, "epsilon": args.epsilon,
                       "delta": args.delta, "seed": args.seed},
            "latency": rows}


def print_table(report: dict) -> None:
    config = report["config"]
    print(f"{config['records']:,} records, {config['users']:,} users, {config['keys']:,} keys, "
          f"{config['micro_batches']} micro-batches, C = {config['contribution_limit']}, "
          f"(eps, delta) = ({config['epsilon']:g}, {config['delta']:g})")
    print(f"{'':12s}" + "".join(f"{m:>16s}" for m in METRICS))
    for name in SYSTEMS:
        if name not in report:
            continue
        entry = report[name]
        cells = [f"{entry[m]:16,.0f}" if entry[m] is not None else f"{'-':>16s}"
                 for m in METRICS]
        print(f"{name:12s}" + "".join(cells))


def print_latency(report: dict) -> None:
    config = report["config"]
    print(f"DP-SQLP per-micro-batch latency, {config['records']:,} records, "
          f"{config['users']:,} users, {config['keys']:,} keys, C = {config['contribution_limit']}")
    print(f"{'micro-batches':>14s}{'records/batch':>16s}{'median s':>12s}{'mean s':>12s}"
          f"{'p90 s':>12s}{'records/s':>14s}")
    for row in report["latency"]:
        print(f"{row['micro_batches']:14d}{row['records_per_micro_batch']:16,.0f}"
              f"{row['latency_s_median']:12.4f}{row['latency_s_mean']:12.4f}"
              f"{row['latency_s_p90']:12.4f}{row['records_per_s']:14,.0f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.beam:
        print(json.dumps(beam_vs_local(args)))
        return
    report = latency(args) if args.latency else benchmark(args)
    if args.json:
        print(json.dumps(report))
    elif args.latency:
        print_latency(report)
    else:
        print_table(report)


if __name__ == "__main__":
    main()
