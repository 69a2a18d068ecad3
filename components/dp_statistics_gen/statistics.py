"""DPStatisticsGen's statistics: the public feature list, the budget split, the DP queries that
compute them and the TFDV protos they are written as. No TFX, no TFDV, no noise of its own.

Everything DP here is a query of the DP SQL operator (sage_tfx.dp_statistics.aggregation) run by
its in-process engine, whose derivations hold as written there; the privacy unit is the record
(one row per record, `max_partitions_contributed = max_contributions_per_partition = 1`), so
the guarantee is Sage's default, for adding or removing one record of the granted blocks.

The queries (one row per record, split and record id added):
* `main`: grouped by the split over the split names as public groups (a record lies in one
  split, by a keyed hash of the record alone: BlockExampleGen; so the splits compose in
  parallel and every split's statistics cost the budget once). Per split: COUNT(*) (the number
  of examples); per numeric feature STDDEV(x, L, U) on the public clamping bounds, whose noisy
  non-NULL count, centred sum and centred squares also give COUNT(x) and the row-scoped SUM(x)
  for free (budget.derived_from: post-processing of the same noisy sums), and quantiles at
  0, 1/n, ..., 1 from ONE noisy quantile tree on [L, U] (min, max, median and the quantile
  histogram are read from it); per string feature COUNT(s) (its non-missing count).
* `top_values:<s>` per string feature s: grouped by (split, s) over the records where s is
  present, partition selection by Laplace thresholding. Under a thresholding rule
  COUNT(DISTINCT record) is the selection's own noisy count (budget.derived_from), so the
  released values AND their noisy frequencies cost one step; the top k of them by noisy count
  (post-processing) are TFDV's top_values, all of them (up to 1,000) its rank histogram.

The budget (stated, and printed by the executor): the grant step's epsilon is split equally
among the statistics `num_examples`, `moments:<x>` and `quantiles:<x>` per numeric feature,
`present:<s>` and `top_values:<s>` per string feature; its delta equally among the
`top_values` statistics (partition selection's delta; the Laplace noise of the others spends
none). Basic composition: the epsilons and deltas that run sum to at most the step's.

Missing values: a numeric cell that is missing, unreadable or not finite, and a string cell
that is missing, is missing (NULL): skipped by every aggregate but COUNT(*), as TFDV counts a
feature absent from an example as missing. num_missing = num_examples - num_non_missing,
both noisy (post-processing, clamped at 0).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence

import numpy as np
import pandas as pd
from dp_accounting import dp_event
from tensorflow_metadata.proto.v0 import statistics_pb2

from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregateKind, AggregationQuery,
                                                BoundsScope, Composition, NoiseKind,
                                                SelectionRule, aggregate, plan)
from sage_tfx.dp_statistics.aggregation.budget import BudgetPlan
from sage_tfx.release import GuaranteeUnit

# The two columns the executor adds to every row: its split and its record's own id.
SPLIT_COLUMN = "__split__"
RECORD_COLUMN = "__record__"
KINDS = ("int", "float", "string")
DEFAULT_TOP_K = 10  # TFDV's top_values default is 20; the rank histogram holds up to 1,000
RANK_HISTOGRAM_SIZE = 1000
DEFAULT_QUANTILES = 10  # TFDV's num_quantiles_histogram_buckets


class StatisticsError(ValueError):
    """A request DPStatisticsGen refuses before anything is read or charged (public inputs)."""


@dataclasses.dataclass(frozen=True)
class Feature:
    """One public feature: its name, kind ("int", "float", "string") and, for a number, the
    public clamping bounds [low, high] every numeric statistic of it reads."""
    name: str
    kind: str
    low: Optional[float] = None
    high: Optional[float] = None

    @property
    def numeric(self) -> bool:
        return self.kind != "string"


def features_from(columns: Mapping[str, str],
                  bounds: Mapping[str, Sequence[float]]) -> tuple[Feature, ...]:
    """The features of `columns` ({name: kind}) with their `bounds` ({name: (low, high)});
    StatisticsError naming every numeric feature without finite bounds low < high (they are
    refused before the charge: a bound read from the data would not be public)."""
    reserved = sorted({SPLIT_COLUMN, RECORD_COLUMN} & set(columns))
    if reserved:
        raise StatisticsError(f"feature name(s) {reserved} are reserved by DPStatisticsGen")
    unknown = {name: kind for name, kind in columns.items() if kind not in KINDS}
    if unknown:
        raise StatisticsError(f"feature types {unknown}: each must be one of {list(KINDS)}")
    if not columns:
        raise StatisticsError("no features: give a schema file or columns")
    strays = sorted(set(bounds) - {n for n, k in columns.items() if k != "string"})
    if strays:
        raise StatisticsError(f"bounds for {strays}, which are not numeric features")
    features, missing = [], []
    for name, kind in columns.items():
        if kind == "string":
            features.append(Feature(name, kind))
            continue
        low, high = bounds.get(name, (None, None))
        if low is None or high is None or not (
                math.isfinite(float(low)) and math.isfinite(float(high))
                and float(low) < float(high)):
            missing.append(name)
            continue
        features.append(Feature(name, kind, float(low), float(high)))
    if missing:
        raise StatisticsError(
            f"numeric feature(s) {missing} have no public clamping bounds (finite, low < high): "
            "give them in the schema (float_domain / int_domain min and max) or as "
            "bounds={name: (low, high)}; nothing was charged")
    return tuple(features)


@dataclasses.dataclass(frozen=True)
class StatisticsPlan:
    """The statistics' queries and their budgets. `split`: {statistic: epsilon} (the stated
    split); `plans`: {query name: (query, its BudgetPlan)}."""
    features: tuple[Feature, ...]
    splits: tuple[str, ...]
    epsilon: float
    delta: float
    split: dict[str, float]
    plans: dict[str, tuple[AggregationQuery, BudgetPlan]]
    num_quantiles: int
    top_k: int

    @property
    def event(self) -> dp_event.DpEvent:
        """What runs, composed (the selections' additional delta sits outside it)."""
        return dp_event.ComposedDpEvent([budget.event for _, budget in self.plans.values()])

    @property
    def spent_delta(self) -> float:
        return sum(budget.delta for _, budget in self.plans.values())

    @property
    def pure(self) -> bool:
        """True when no statistic spends delta (no string feature): epsilon-DP."""
        return self.spent_delta == 0.0

    def describe(self) -> str:
        """The split in words, for the console and the artifact."""
        return ", ".join(f"{name} {value:.4g}" for name, value in self.split.items())


def _quantile_names(feature: Feature, count: int) -> list[str]:
    # The first quantile names the tree (its budget step); the others read it.
    return [f"quantiles:{feature.name}"] + [f"quantile_{i}:{feature.name}"
                                            for i in range(1, count + 1)]


def _main_query(features: Sequence[Feature], splits: Sequence[str],
                num_quantiles: int) -> AggregationQuery:
    aggregates = [Aggregate.count(name="num_examples")]
    for feature in features:
        if not feature.numeric:
            aggregates.append(Aggregate.count(feature.name, name=f"present:{feature.name}"))
            continue
        bounds = dict(low=feature.low, high=feature.high)
        aggregates += [
            Aggregate(AggregateKind.STDDEV, feature.name, **bounds,
                      name=f"moments:{feature.name}"),
            Aggregate.count(feature.name, name=f"count:{feature.name}"),
            Aggregate(AggregateKind.SUM, feature.name, **bounds, scope=BoundsScope.ROW,
                      name=f"sum:{feature.name}")]
        aggregates += [Aggregate(AggregateKind.QUANTILE, feature.name, **bounds,
                                 q=i / num_quantiles, name=name)
                       for i, name in enumerate(_quantile_names(feature, num_quantiles))]
    return AggregationQuery(
        group_by=(SPLIT_COLUMN,), unit_column=RECORD_COLUMN, aggregates=tuple(aggregates),
        max_partitions_contributed=1, max_contributions_per_partition=1,
        selection=SelectionRule.PUBLIC, public_partitions=tuple((s,) for s in splits),
        noise=NoiseKind.LAPLACE, infer_bounds=False)


def _top_values_query(feature: Feature) -> AggregationQuery:
    return AggregationQuery(
        group_by=(SPLIT_COLUMN, feature.name), unit_column=RECORD_COLUMN,
        aggregates=(Aggregate.count_distinct(name=f"top_values:{feature.name}"),),
        max_partitions_contributed=1, max_contributions_per_partition=1,
        selection=SelectionRule.LAPLACE_THRESHOLD, noise=NoiseKind.LAPLACE, infer_bounds=False)


def plan_statistics(features: Sequence[Feature], splits: Sequence[str], epsilon: float,
                    delta: float, num_quantiles: int = DEFAULT_QUANTILES,
                    top_k: int = DEFAULT_TOP_K) -> StatisticsPlan:
    """The queries and the split of (epsilon, delta) (module docstring); StatisticsError
    before anything runs for a bad request (a string feature needs delta > 0)."""
    if not splits:
        raise StatisticsError("the Examples have no splits")
    if not (isinstance(num_quantiles, int) and 2 <= num_quantiles <= 100):
        raise StatisticsError(f"num_quantiles must be an integer in [2, 100], got "
                              f"{num_quantiles!r}")
    if not (isinstance(top_k, int) and 1 <= top_k <= RANK_HISTOGRAM_SIZE):
        raise StatisticsError(f"top_k must be an integer in [1, {RANK_HISTOGRAM_SIZE}], got "
                              f"{top_k!r}")
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise StatisticsError(f"the statistics step's epsilon must be positive, got {epsilon!r}")
    strings = [f for f in features if not f.numeric]
    if strings and not delta > 0:
        raise StatisticsError(f"string feature(s) {[f.name for f in strings]} need delta > 0 "
                              "for partition selection of their top values; the step has "
                              f"delta {delta!r}")
    main = _main_query(features, splits, num_quantiles)
    statistics = ["num_examples"] + [name for f in features for name in (
        (f"moments:{f.name}", f"quantiles:{f.name}") if f.numeric
        else (f"present:{f.name}", f"top_values:{f.name}"))]
    each = epsilon / len(statistics)
    main_steps = [s for s in statistics if not s.startswith("top_values:")]
    plans = {"main": (main, plan(main, each * len(main_steps), 0.0,
                                 weights={s: 1.0 for s in main_steps},
                                 composition=Composition.BASIC))}
    for feature in strings:
        query = _top_values_query(feature)
        plans[f"top_values:{feature.name}"] = (query, plan(
            query, each, delta / len(strings), composition=Composition.BASIC))
    return StatisticsPlan(tuple(features), tuple(splits), epsilon, delta,
                          {s: each for s in statistics}, plans, num_quantiles, top_k)


def _counts(value) -> int:
    """A noisy count as TFDV's unsigned integer: rounded, at least 0 (post-processing)."""
    return int(max(0.0, round(float(value))))


def compute(rows: pd.DataFrame, planned: StatisticsPlan,
            seed: Optional[int] = None) -> dict[str, statistics_pb2.DatasetFeatureStatisticsList]:
    """{split: its DatasetFeatureStatisticsList}. `rows`: one row per record, the features'
    columns (NaN / None: missing) with SPLIT_COLUMN and RECORD_COLUMN (distinct per row).
    `seed`: the operator's contribution sampling, for tests (a unit has one row here, so it
    changes nothing; noise is never seeded)."""
    main_query, main_budget = planned.plans["main"]
    main = aggregate(rows, main_query, main_budget, GuaranteeUnit.RECORD, seed=seed).table
    main = main.set_index(SPLIT_COLUMN)
    top = {}
    for feature in planned.features:
        if feature.numeric:
            continue
        query, budget = planned.plans[f"top_values:{feature.name}"]
        present = rows[rows[feature.name].notna()]  # per record: missing values have no rank
        top[feature.name] = aggregate(present[[SPLIT_COLUMN, RECORD_COLUMN, feature.name]],
                                      query, budget, GuaranteeUnit.RECORD, seed=seed).table
    return {split: _statistics_list(split, main.loc[split], top, planned)
            for split in planned.splits}


def _statistics_list(split: str, row: pd.Series, top: Mapping[str, pd.DataFrame],
                     planned: StatisticsPlan) -> statistics_pb2.DatasetFeatureStatisticsList:
    result = statistics_pb2.DatasetFeatureStatisticsList()
    dataset = result.datasets.add(name=split)
    examples = _counts(row["num_examples"])
    dataset.num_examples = examples
    for feature in planned.features:
        stats = dataset.features.add()
        stats.path.step.append(feature.name)
        if feature.numeric:
            stats.type = (statistics_pb2.FeatureNameStatistics.INT if feature.kind == "int"
                          else statistics_pb2.FeatureNameStatistics.FLOAT)
            _numeric(stats.num_stats, feature, row, examples, planned.num_quantiles)
        else:
            stats.type = statistics_pb2.FeatureNameStatistics.STRING
            values = top[feature.name]
            _strings(stats.string_stats, _counts(row[f"present:{feature.name}"]), examples,
                     values[values[SPLIT_COLUMN] == split], feature, planned.top_k)
    return result


def _common(common, non_missing: int, examples: int) -> None:
    """Every feature is read as one value per example (the record rule's scalar features), a
    public fact: a present feature has exactly 1 value."""
    common.num_non_missing = non_missing
    common.num_missing = max(0, examples - non_missing)
    common.min_num_values = 1 if non_missing else 0
    common.max_num_values = 1 if non_missing else 0
    common.avg_num_values = 1.0 if non_missing else 0.0
    common.tot_num_values = non_missing


def _numeric(stats, feature: Feature, row: pd.Series, examples: int, buckets: int) -> None:
    name = feature.name
    non_missing = _counts(row[f"count:{name}"])
    _common(stats.common_stats, non_missing, examples)
    # mean = SUM / COUNT from the same noisy sums as AVG's (aggregators._mean_and_square),
    # clamped into the public bounds.
    mean = float(row[f"sum:{name}"]) / max(float(row[f"count:{name}"]), 1.0)
    stats.mean = float(np.clip(mean, feature.low, feature.high))
    stats.std_dev = float(row[f"moments:{name}"])
    quantiles = [float(row[q]) for q in _quantile_names(feature, buckets)]
    stats.min, stats.max = quantiles[0], quantiles[-1]
    stats.median = float(np.interp(0.5, np.linspace(0.0, 1.0, buckets + 1), quantiles))
    histogram = stats.histograms.add(type=statistics_pb2.Histogram.QUANTILES)
    for low, high in zip(quantiles[:-1], quantiles[1:]):
        histogram.buckets.add(low_value=low, high_value=high,
                              sample_count=non_missing / buckets)


def _strings(stats, non_missing: int, examples: int, values: pd.DataFrame, feature: Feature,
             top_k: int) -> None:
    _common(stats.common_stats, non_missing, examples)
    counts = values[f"top_values:{feature.name}"].to_numpy(dtype=np.float64)
    labels = values[feature.name].astype(str).to_numpy()
    order = np.lexsort((labels, -counts))[:RANK_HISTOGRAM_SIZE]  # ties: by value, public
    # `unique`: the number of values partition selection released (a DP count; values held
    # by few records are not among them).
    stats.unique = len(counts)
    for rank, index in enumerate(order):
        frequency = max(0.0, float(counts[index]))
        if rank < top_k:
            stats.top_values.add(value=labels[index], frequency=frequency)
        stats.rank_histogram.buckets.add(low_rank=rank, high_rank=rank, label=labels[index],
                                         sample_count=frequency)
