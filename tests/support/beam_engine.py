"""The Beam engine's pre-noise sums, for the conformance tests against the local engine, and the
data set they share."""
import json

import apache_beam as beam
import numpy as np
import pandas as pd
from apache_beam.options.pipeline_options import PipelineOptions

from sage_tfx.dp_statistics.aggregation import Aggregate, AggregateKind, AggregationQuery
from sage_tfx.dp_statistics.aggregation.beam import (AccumulateTransform, GatherAccumulated,
                                                     _batches, run_transform)


def conformance_frame() -> pd.DataFrame:
    """40 units, each in at most 3 partitions with at most 4 rows per partition (under C_u = 3
    and m = 4: no sampling changes anything), values up to 40 so SUM's clamp bites."""
    rng = np.random.default_rng(5)
    rows = []
    for unit in range(40):
        for key in rng.choice(12, size=rng.integers(1, 4), replace=False):
            for _ in range(rng.integers(1, 5)):
                rows.append({"area": f"a{key}", "day": int(key % 2), "uid": unit,
                             "fare": float(rng.uniform(0, 40))})
    return pd.DataFrame(rows)


CONFORMANCE_QUERY = AggregationQuery(
    ("area", "day"), "uid",
    (Aggregate.count(), Aggregate.count_distinct(), Aggregate(AggregateKind.SUM, "fare", 0, 50),
     Aggregate(AggregateKind.VAR, "fare", 0, 30), Aggregate.median("fare", 0, 30)),
    max_partitions_contributed=3, max_contributions_per_partition=4)


def heavy_rows() -> list[dict]:
    """30 units, each in 8 partitions with 6 rows per partition: under C_u = 3 and m = 4 both
    sampling steps drop something, so the sums depend on the sampling's randomness."""
    rng = np.random.default_rng(11)
    return [{"area": f"a{key}", "uid": unit, "fare": float(rng.uniform(0, 40))}
            for unit in range(30) for key in rng.choice(12, size=8, replace=False)
            for _ in range(6)]


HEAVY_QUERY = AggregationQuery(("area",), "uid",
                               (Aggregate.count(), Aggregate(AggregateKind.SUM, "fare", 0, 50),
                                Aggregate.median("fare", 0, 40)),
                               max_partitions_contributed=3, max_contributions_per_partition=4)


def sorted_by_keys(accumulated, query=CONFORMANCE_QUERY):
    """(keys, accumulators) in the order of the keys: engines list partitions in any order."""
    order = accumulated.keys.sort_values(list(query.group_by)).index.to_numpy()
    return accumulated.keys.iloc[order].reset_index(drop=True), accumulated.accumulators[order]


def accumulate_with_beam(rows, query, plan, seed=None, options=None):
    """Steps 1-3 as AggregateTransform runs them (its AccumulateTransform and
    GatherAccumulated; only the release is left out), returned as local.accumulate returns
    them, for rows as aggregate_with_beam takes them (a pyarrow.Table, a pandas frame or
    dicts). Draws the DP bounds' noise when the query infers bounds. ``options``: pipeline
    arguments (DirectRunner without)."""
    batches, schema = _batches(rows, query)
    return run_transform(batches, AccumulateTransform(query, plan, seed, batched=True)
                         | GatherAccumulated(query, schema), _options(options))


def accumulate_files_with_beam(paths, query, plan, seed=None, options=None):
    """As accumulate_with_beam, the rows (dicts) read from JSON-lines files (one bundle per
    file) and redistributed by a Reshuffle before the engine sees them."""
    read = (beam.FlatMap(list) | beam.io.ReadAllFromText() | beam.Map(json.loads)
            | beam.Reshuffle())
    return run_transform([list(paths)], read | AccumulateTransform(query, plan, seed)
                         | GatherAccumulated(query), _options(options))


def _options(options):
    return PipelineOptions(options) if isinstance(options, list) else options
