"""The Beam engine's pre-noise sums, for the conformance test against the local engine."""
from sage_tfx.dp_statistics.aggregation.beam import (AccumulateTransform, GatherAccumulated,
                                                     _records, run_transform)


def accumulate_with_beam(rows, query, plan, seed=None):
    """Steps 1-3 as AggregateTransform runs them (its AccumulateTransform and
    GatherAccumulated; only the release is left out), returned as local.accumulate returns
    them, for rows as aggregate_with_beam takes them (a pyarrow.Table, a pandas frame or
    dicts). Draws the DP bounds' noise when the query infers bounds."""
    records, schema = _records(rows, query)
    return run_transform(records, AccumulateTransform(query, plan, seed)
                         | GatherAccumulated(query, schema))
