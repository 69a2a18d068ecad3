"""The Beam engine's pre-noise sums, for the conformance test against the local engine."""
import pandas as pd

from sage_tfx.dp_statistics.aggregation.beam import (AccumulateTransform, GatherAccumulated,
                                                     run_transform)


def accumulate_with_beam(rows, query, plan, seed=None):
    """Steps 1-3 as AggregateTransform runs them (its AccumulateTransform and
    GatherAccumulated; only the release is left out), returned as local.accumulate returns
    them. Draws the DP bounds' noise when the query infers bounds."""
    records = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else rows
    return run_transform(records, AccumulateTransform(query, plan, seed)
                         | GatherAccumulated(query))
