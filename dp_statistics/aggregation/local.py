"""The in-process engine (the default): vectorised numpy/pandas over aggregators.py's math."""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import pandas as pd
import pyarrow as pa

from sage_tfx.dp_statistics import cells
from sage_tfx.dp_statistics.aggregation import aggregators
from sage_tfx.dp_statistics.aggregation.budget import (BOUNDS_STEP_PREFIX, BudgetPlan,
                                                       bounds_inferred_by_step)
from sage_tfx.dp_statistics.aggregation.release import Release
from sage_tfx.dp_statistics.aggregation.spec import (AggregateKind, AggregationQuery,
                                                     GuaranteeUnit, QueryError, SelectionRule)
from sage_tfx.dp_statistics.identifiers import representable_ids
from sage_tfx.randomness import secret_rng


def check_plan(query: AggregationQuery, plan: BudgetPlan) -> None:
    if not isinstance(plan, BudgetPlan) or plan.query != query:
        raise QueryError("the plan was made for another query; call plan(query, epsilon, delta) "
                         "with this query")


def value_columns(query: AggregationQuery) -> list[str]:
    return list(dict.fromkeys(a.column for a in query.aggregates if a.column is not None))


def presence_columns(query: AggregationQuery) -> set[str]:
    """The columns only COUNT(col) reads: of any type, read as 1.0 where set and NaN where
    null (the others are read as numbers, NaN where null or not a number)."""
    numeric = {a.column for a in query.aggregates
               if a.column is not None and a.kind is not AggregateKind.COUNT}
    return set(value_columns(query)) - numeric


def identity_columns(query: AggregationQuery) -> list[str]:
    """The group-by columns and the unit column: what rows are grouped by."""
    return list(dict.fromkeys([*query.group_by, query.unit_column]))


def _frame(data, query: AggregationQuery) -> pd.DataFrame:
    if hasattr(data, "to_pandas") and hasattr(data, "schema"):  # pyarrow.Table
        query.check(data.column_names)
        for column in set(value_columns(query)) - presence_columns(query):
            kind = data.schema.field(column).type
            if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)
                    or pa.types.is_boolean(kind) or pa.types.is_decimal(kind)
                    or pa.types.is_null(kind)):
                raise _not_numeric(column, kind)
        # Keys and units keep their declared Arrow type (pandas' own conversion makes an
        # integer column holding a null float, which prints 1 as 1.0 and merges integers
        # above 2^53), and pandas groups them with Arrow's hashing, which reads whole strings.
        identity = identity_columns(query)
        frame = data.select(identity).to_pandas(types_mapper=pd.ArrowDtype)
        for column in value_columns(query):
            if column not in identity:
                frame[column] = data[column].to_pandas()
        return frame
    if not isinstance(data, pd.DataFrame):
        raise QueryError(f"data must be a pyarrow.Table or a pandas.DataFrame, got "
                         f"{type(data).__name__}")
    query.check(data.columns)
    return data


def representable_rows(frame: pd.DataFrame, query: AggregationQuery) -> np.ndarray:
    """Rows whose text keys and unit are representable (identifiers.py: no NUL, at most
    MAX_ID_BYTES): the others are dropped, each by its own content, before any grouping."""
    keep = np.ones(len(frame), dtype=bool)
    for column in identity_columns(query):
        series = frame[column]
        if isinstance(series.dtype, pd.ArrowDtype):
            kind = series.dtype.pyarrow_dtype
            if pa.types.is_string(kind) or pa.types.is_large_string(kind):
                keep &= representable_ids(pa.array(series))
        elif pd.api.types.is_object_dtype(series.dtype) or pd.api.types.is_string_dtype(
                series.dtype):
            keep &= representable_ids([v if isinstance(v, str) else None for v in series])
    return keep


def _not_numeric(column: str, kind) -> QueryError:
    return QueryError(f"column {column!r} is not numeric (type {kind}); SUM, AVG, VAR, STDDEV "
                      "and quantiles need numbers")


def numeric_column(frame: pd.DataFrame, column: str) -> np.ndarray:
    """The column as doubles. The refusal depends on the column's type only (the schema, the
    same on neighbouring tables): in an untyped (object) column a value that is not a number
    is NULL (NaN, skipped by the aggregates), since refusing the query because of one row
    would reveal that the row is there. Such a column is read cell by cell (cells.numbers:
    pandas' to_numeric reads a large integer differently once another cell is a fraction)."""
    series = frame[column]
    if pd.api.types.is_object_dtype(series.dtype):
        return cells.numbers(series)
    if not (pd.api.types.is_numeric_dtype(series.dtype)
            or pd.api.types.is_bool_dtype(series.dtype)):
        raise _not_numeric(column, series.dtype)
    return series.to_numpy(dtype=np.float64, na_value=np.nan)


def factorize(values) -> tuple[np.ndarray, int]:
    """Codes 0..k-1 of the k distinct values of a column (a Series or an array) and k. Numpy
    integers spanning at most 4 times as many values as there are rows: a dense remap (a
    presence table over the span, its running count the code: one pass, several times faster
    than pandas' hashing; codes in ascending order of value); otherwise pandas' factorize
    (codes in order of first appearance; NaN, None and NA are one value). Which label a value
    gets does not matter: the groupings draw a uniformly random order whatever the labels,
    and released tables are sorted by their keys."""
    array = values.to_numpy() if isinstance(values, pd.Series) else values
    if isinstance(array, np.ndarray) and array.dtype.kind in "iu" and array.size:
        low, high = int(array.min()), int(array.max())
        if high - low <= 4 * array.size:
            offsets = (array - low).astype(np.int64)
            present = np.zeros(high - low + 1, dtype=bool)
            present[offsets] = True
            remap = np.cumsum(present) - 1
            return remap[offsets], int(remap[-1]) + 1
    codes, uniques = pd.factorize(values, use_na_sentinel=False)
    return np.asarray(codes, dtype=np.int64), len(uniques)


def combined_codes(columns: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """The codes 0..k-1 of the distinct tuples of several columns, given each column's
    ``factorize`` (codes, distinct count)."""
    codes = None
    for column_codes, distinct in columns:
        # Re-factorizing the combined code keeps it below the row count (no overflow).
        codes = column_codes if codes is None else factorize(
            codes * max(distinct, 1) + column_codes)[0]
    return np.asarray(codes, dtype=np.int64)


def first_occurrences(codes: np.ndarray) -> np.ndarray:
    """For codes 0..k-1: the position of each code's first occurrence."""
    first = np.empty(int(codes.max()) + 1 if codes.size else 0, dtype=np.int64)
    first[codes[::-1]] = np.arange(codes.size)[::-1]  # the last write, the first occurrence, wins
    return first


def partition_codes(frame: pd.DataFrame,
                    query: AggregationQuery) -> tuple[np.ndarray, pd.DataFrame]:
    """Each row's partition index (-1: not a public partition) and the partitions' keys, in
    their columns' types. `frame` holds representable keys only (`representable_rows`), so
    grouping is by the whole value (pandas' Arrow-backed and numeric factorize are exact)."""
    keys_frame = frame[list(query.group_by)]
    codes = combined_codes([factorize(keys_frame[column]) for column in query.group_by])
    keys = keys_frame.iloc[first_occurrences(codes)].reset_index(drop=True)
    if SelectionRule(query.selection) is not SelectionRule.PUBLIC:
        for column in query.group_by:
            if pd.api.types.is_float_dtype(keys[column].dtype):
                # -0.0 + 0.0 = 0.0: a released key does not show which zero its first row held
                keys[column] = keys[column] + 0.0
        return codes, keys
    public = {key: i for i, key in enumerate(query.public_partitions)}
    as_python = keys.astype(object).where(keys.notna(), None)  # a null key matches NULL
    data_to_public = np.array([public.get(key, -1) for key in as_python.itertuples(
        index=False, name=None)], dtype=np.int64)
    public_keys = pd.DataFrame(list(query.public_partitions), columns=list(query.group_by))
    for column in query.group_by:  # the columns' types (the schema's) where the values fit
        try:
            public_keys[column] = public_keys[column].astype(keys[column].dtype)
        except (TypeError, ValueError):
            pass
    return data_to_public[codes] if codes.size else codes, public_keys


@dataclasses.dataclass(frozen=True)
class Accumulated:
    """What an engine hands to ``aggregators.release``: the partitions' keys, their pre-noise
    accumulators (one row each, ``aggregators.Layout``), the bounds of each bounded aggregate
    and the events of the DP bounds steps that ran."""
    keys: pd.DataFrame
    accumulators: np.ndarray
    bounds: dict
    bounds_events: dict


@dataclasses.dataclass(frozen=True)
class KeptPairs:
    """Steps 1-2's outcome (aggregators.bound_contributions) as steps 3 and the DP bounds read
    it: the kept pairs' rows in pair order (``order``: the input index of each), each row's
    pair and rank in it, and per kept pair its partition code and how many pairs its unit kept.
    Both engines make it (the Beam engine once per bucket of units)."""
    order: np.ndarray
    pair_of_row: np.ndarray
    rank_in_pair: np.ndarray
    pair_partition: np.ndarray
    partitions_of_unit: np.ndarray

    @property
    def n_pairs(self) -> int:
        return len(self.pair_partition)


def keep_pairs(query: AggregationQuery, unit_codes: np.ndarray, partition_codes: np.ndarray,
               n_partitions: int, rng: np.random.Generator) -> KeptPairs:
    """Steps 1 and 2 over rows given by their unit and partition codes: the kept pairs, and of
    their rows those step 3 and the DP bounds read (read_rows)."""
    pairs = aggregators.bound_contributions(unit_codes, partition_codes, n_partitions,
                                            query.max_partitions_contributed, rng)
    pair_of_row, rank_in_pair, order = read_rows(query, pairs)
    kept_unit = pairs.pair_unit[pairs.pair_kept]
    return KeptPairs(order, pair_of_row, rank_in_pair, pairs.pair_partition[pairs.pair_kept],
                     np.bincount(kept_unit)[kept_unit])


def bounds_histogram(query: AggregationQuery, aggregate_spec, kept: KeptPairs,
                     ordered: dict) -> np.ndarray:
    """The log histogram the aggregate's DP bounds are inferred from, over ``kept``'s pairs
    (``ordered``: the value columns in ``kept.order``); histograms of disjoint pairs add."""
    return aggregators.log_histogram(aggregators.bounds_input(
        aggregate_spec, kept.pair_of_row, kept.rank_in_pair, kept.n_pairs,
        ordered[aggregate_spec.column], query.max_contributions_per_partition))


def contributions(query: AggregationQuery, bounds: dict, kept: KeptPairs,
                  ordered: dict) -> np.ndarray:
    """Step 3: the kept pairs' (n_pairs, width) contribution vectors."""
    return aggregators.pair_contributions(query, bounds, kept.pair_of_row, kept.rank_in_pair,
                                          kept.n_pairs, ordered, kept.partitions_of_unit)


def accumulate(frame: pd.DataFrame, query: AggregationQuery, plan: BudgetPlan,
               rng: np.random.Generator) -> Accumulated:
    """Steps 1-3 of aggregators.py (and the DP bounds) on a checked frame."""
    representable = representable_rows(frame, query)
    # a copy whose index can be reset in place (shallow when every row stays: no column copied)
    frame = frame.copy(deep=False) if representable.all() else frame[representable]
    frame.index = pd.RangeIndex(len(frame))  # (reset_index would copy every column again)
    presence = presence_columns(query)
    columns = {c: np.where(frame[c].notna().to_numpy(), 1.0, np.nan) if c in presence
               else numeric_column(frame, c) for c in value_columns(query)}
    owned = frame[query.unit_column].notna().to_numpy()
    codes, keys = partition_codes(frame, query)
    rows = owned & (codes >= 0)
    unit_codes, _ = factorize(frame[query.unit_column].to_numpy()[rows])
    kept = keep_pairs(query, unit_codes, codes[rows], len(keys), rng)
    order = kept.order if rows.all() else np.flatnonzero(rows)[kept.order]
    ordered = {c: values[order] for c, values in columns.items()}

    bounds = {a.output_name: (a.low, a.high) for a in query.aggregates
              if a.bounded and not a.bounds_inferred}
    bounds_events = {}
    for aggregate_spec in bounds_inferred_by_step(query):
        name = aggregate_spec.output_name
        bounds[name], bounds_events[BOUNDS_STEP_PREFIX + name] = aggregators.infer_bounds(
            query, aggregate_spec, plan, bounds_histogram(query, aggregate_spec, kept, ordered))

    accumulators = aggregators.sum_by_partition(kept.pair_partition,
                                                contributions(query, bounds, kept, ordered),
                                                len(keys), aggregators.layout(query).signed)
    return Accumulated(keys, accumulators, bounds, bounds_events)


def read_rows(query: AggregationQuery, pairs: aggregators.BoundedPairs
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows step 3 reads, in pair order: each row's index among the kept pairs, its rank in
    its pair and its position in the bounded input (an index into ``pairs.row_order``'s rows). Rows of pairs the unit dropped are left out; so are the rows
    beyond a pair's first m (rank >= m) unless an aggregate reads every row of a pair (a
    unit-scoped SUM: the unit's total, and its bounds' input). Leaving out rows that
    pair_contributions and bounds_input skip (they read ranks < m only) changes no value: the
    rows kept are in the same order, so every sum adds the same terms in the same order."""
    every_pair = bool(pairs.pair_kept.all())
    wanted = (np.ones(pairs.pair_of_row.size, dtype=bool) if every_pair
              else pairs.pair_kept[pairs.pair_of_row])
    if not any(a.kind is AggregateKind.SUM and not a.bounds_rows for a in query.aggregates):
        wanted &= pairs.rank_in_pair < query.max_contributions_per_partition
    pair_of_row = pairs.pair_of_row
    if not every_pair:
        pair_of_row = (np.cumsum(pairs.pair_kept) - 1)[pair_of_row]
    if wanted.all():
        return pair_of_row, pairs.rank_in_pair, pairs.row_order
    return pair_of_row[wanted], pairs.rank_in_pair[wanted], pairs.row_order[wanted]


def release_accumulated(query: AggregationQuery, plan: BudgetPlan, accumulated: Accumulated,
                        unit: GuaranteeUnit, intervals: bool = False) -> Release:
    """Step 4 (noise, selection, post-processing) and the guarantee, for either engine; with
    ``intervals``, each aggregate's stated accuracy (Release.intervals)."""
    bounds = aggregators.shared_bounds(query, accumulated.bounds)
    table, events, stated = aggregators.release(
        query, plan, accumulated.keys, accumulated.accumulators, bounds,
        accumulated.bounds_events, intervals)
    return Release(table, plan.epsilon, plan.delta,
                   GuaranteeUnit(unit).describe(query.unit_column), events, plan.additional_delta,
                   {name: (float(low), float(high))
                    for name, (low, high) in bounds.items()}, stated)


def aggregate(data, query: AggregationQuery, plan: BudgetPlan,
              unit: GuaranteeUnit = GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ, *,
              seed: Optional[int] = None, intervals: bool = False) -> Release:
    """Run ``query`` on ``data`` (pyarrow.Table or pandas.DataFrame) at ``plan``'s budget:
    contribution bounding, DP bounds where asked, DP aggregates, partition selection
    (aggregators.py). ``unit``: what the grant's blocks make the neighbouring relation.
    ``intervals``: also state each aggregate's accuracy (Release.intervals; post-processing,
    computed only when asked).
    Rows whose unit is null belong to nobody and are dropped. ``seed`` fixes the contribution
    sampling, for tests only (noise is never seeded). Raises QueryError (unknown or non-numeric
    columns, a plan made for another query) before drawing any noise."""
    frame = _frame(data, query)
    check_plan(query, plan)
    return release_accumulated(query, plan, accumulate(frame, query, plan, secret_rng(seed)),
                               unit, intervals)
