"""What ``aggregate`` returns: the released table and its guarantee."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import pandas as pd
from dp_accounting import dp_event


@dataclasses.dataclass(frozen=True)
class Release:
    """``table``: one row per released partition, the group-by columns then one column per
    aggregate (``Aggregate.output_name``), sorted by the group-by keys. The guarantee:
    (``epsilon``, ``delta``)-DP for adding or removing all rows of one privacy unit, ``unit``
    says which unit and within what. ``events``: the dp-accounting event of each plan step as it
    ran (noise read back from OpenDP's maps); ``additional_delta``: delta spent outside them by
    partition selection. ``bounds``: the [L, U] each bounded aggregate used, by output column
    (given, or inferred with DP: a release of its ``bounds:`` step). ``intervals``: each
    aggregate's noise standard deviation and 95% interval (``<name>_stddev``, ``<name>_ci_low``,
    ``<name>_ci_high``; accuracy.py says how), row by row as ``table``: post-processing,
    computed only when the engine is asked for it (None otherwise)."""
    table: pd.DataFrame
    epsilon: float
    delta: float
    unit: str
    events: Mapping[str, dp_event.DpEvent]
    additional_delta: float
    bounds: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    intervals: Optional[pd.DataFrame] = None

    @property
    def event(self) -> dp_event.DpEvent:
        return dp_event.ComposedDpEvent(list(self.events.values()))
