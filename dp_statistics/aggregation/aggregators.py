"""The operator's math, shared by both engines (numpy only; no noise is drawn here except through
sage_tfx.mechanisms).

Two-stage aggregation (DP SQL §4.2.3), as both engines run it
------------------------------------------------------------
1. Rows are grouped by (partition, unit): a *pair*. Each pair's rows are put in a uniformly random
   order (``rank_in_pair``): the first m = ``max_contributions_per_partition`` are its *sampled*
   rows (the seed's per-partition reservoir sample).
2. Each unit keeps a uniformly random set of at most C_u = ``max_partitions_contributed`` of its
   pairs (stability bounding: a unit then touches at most C_u partitions).
3. Each kept pair becomes one fixed-width vector, its *contribution* (:func:`pair_contributions`,
   :class:`Layout`), whatever the unit's data; the partition's accumulator is the sum of its
   pairs' vectors (the cross-unit aggregation).
4. :func:`release` draws the noise (through sage_tfx.mechanisms), selects partitions and
   post-processes the noisy sums into the released aggregates.

Per-partition sensitivities Delta (one unit added or removed changes one partition's vector by at
most Delta in each block; derivations beside the layout entries):

=====================  ==============================================  ======================
block                  a kept pair's contribution                      Delta (L1 = L2 here)
=====================  ==============================================  ======================
units                  1                                               1
rows                   sampled rows, <= m                              m
COUNT(col)             sampled rows whose col is not NULL, <= m        m
SUM [L, U], unit       clamp(sum of the unit's non-NULL values, L, U)  max(|L|, |U|)
                       (0 when it has none)
SUM [L, U], row        sum over sampled non-NULL rows of clamp(x)      m max(|L|, |U|)
count (AVG...)         sampled rows whose value is not NULL, <= m      m
centred sum (AVG...)   sum over sampled non-NULL rows of clamp(x)-mid  m (U - L) / 2
centred squares        sum over sampled non-NULL rows of               m h^2 / 2, h = (U-L)/2
                       (clamp(x) - mid)^2 - h^2 / 2 (in [-h^2/2, h^2/2])
tree (QUANTILE)        counts of sampled non-NULL rows per bucket of   H m in L1, sqrt(H) m
                       each of the tree's H levels over [L, U]         in L2
=====================  ==============================================  ======================

NULL semantics (BigQuery's): a NULL or NaN value (and, from SQL, text that does not parse as a
number) is skipped by the aggregate that reads it: it adds no term to that aggregate's blocks,
while the row still counts for COUNT(*) and for the other aggregates. Why the bounds hold: the
m sampled rows of a pair are chosen before any value is looked at, and skipping is a function
of one row's value alone, so each block above is a sum of at most m terms each within the
stated range (a skipped row's term is 0, inside every range): a unit's change is bounded by
the same Delta, whatever its values. AVG, VAR and STDDEV divide by their own noisy count of
non-NULL rows (not the rows block), so a NULL never pulls a mean toward the midpoint or 0.

Over the C_eff partitions a unit touches (different coordinates), the block's vector changes by
at most C_eff * Delta in L1 and sqrt(C_eff) * Delta in L2: the Laplace / Gaussian sensitivities
(budget.py says how the steps compose). C_eff = C_u, or min(C_u, G) over G public partitions
(AggregationQuery.partitions_per_unit derives it). The tree block of one partition has one
bucket per level per row: a unit's <= m rows change each level by <= m in L1 and in L2 (all in
one bucket is the worst case for L2: |v|_2 <= |v|_1), so the whole matrix moves by C_eff H m in
L1 and sqrt(C_eff H) m in L2 (QUANTILE_LEVELS's comment).

Midpoint centring (LLSY16 Alg. 2.4, as the seed's ANON_AVG): centring on mid = (L + U) / 2 halves
the sum's sensitivity from m max(|L|, |U|) to m (U - L) / 2, and the count's noise then moves the
mean only by (mean - mid) * noise / count.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping, Optional

import numpy as np
import pandas as pd
from dp_accounting import dp_event

from sage_tfx import mechanisms
from sage_tfx.dp_statistics.aggregation import accuracy
from sage_tfx.dp_statistics.aggregation.budget import (BOUNDS_STEP_PREFIX, SELECTION_STEP,
                                                       BudgetPlan, component_budgets,
                                                       derived_from,
                                                       run_selection)
from sage_tfx.dp_statistics.aggregation.spec import (MAX_MAGNITUDE, QUANTILE_BRANCHING,
                                                     QUANTILE_LEVELS, Aggregate, AggregateKind,
                                                     AggregationQuery, NoiseKind, SelectionRule)
from sage_tfx.mechanisms.portable import floor_log2

# Quantiles read a tree of counts over [L, U] (a hierarchical histogram, as PipelineDP's and
# Google's quantile tree): level j = 1..H splits [L, U] into b^j equal buckets, so the leaves
# resolve (U - L) / b^H. A row adds 1 to one bucket per level: a unit's <= m rows change each
# level's counts by <= m in L1 and in L2 (all in one bucket is L2's worst case), the levels are
# different coordinates: the block's per-partition sensitivity is H m in L1 and sqrt(H) m in L2.
# The descent (quantile_from_tree) reads at most b - 1 counts per level where a flat histogram
# of b^H buckets sums up to b^H / 2 of them to reach a median: at H = 3 the noise per count is 3
# times a flat histogram's, its cumulative error sqrt(3) * 3 / sqrt(32) ~ 0.9 times at the top
# and confined to ever narrower ranges below.
QUANTILE_TREE_NODES = sum(QUANTILE_BRANCHING ** j for j in range(1, QUANTILE_LEVELS + 1))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which columns of a contribution vector hold what: ``units`` (col 0), ``rows`` (col 1),
    the unit's selection ``weight`` (col 2, mechanisms.unit_weight: 1 / sqrt(k) for a unit
    with k kept pairs), then one block per aggregate, in query order (``blocks[output_name]``;
    empty for an aggregate post-processed from another's step, budget.derived_from: nothing
    reads it). ``signed``: the columns a contribution may hold negative in (sums and centred
    moments); every other column counts, >= 0."""
    width: int
    blocks: Mapping[str, slice]
    signed: tuple[int, ...] = ()

    UNITS = 0
    ROWS = 1
    WEIGHT = 2


def counts_column(aggregate: Aggregate) -> bool:
    """COUNT(col): the rows where col is not null."""
    return aggregate.kind is AggregateKind.COUNT and aggregate.column is not None


def layout(query: AggregationQuery) -> Layout:
    # AVG / VAR / STDDEV: their non-NULL row count, centred sum[, centred squares].
    widths = {AggregateKind.SUM: 1, AggregateKind.AVG: 2, AggregateKind.VAR: 3,
              AggregateKind.STDDEV: 3, AggregateKind.QUANTILE: QUANTILE_TREE_NODES}
    derived = derived_from(query)
    blocks, start, signed = {}, 3, []
    for aggregate in query.aggregates:
        # COUNT(*) and COUNT_DISTINCT read rows / units; COUNT(col) its own column of rows.
        width = 0 if aggregate.output_name in derived else (
            1 if counts_column(aggregate) else widths.get(aggregate.kind, 0))
        blocks[aggregate.output_name] = slice(start, start + width)
        if width and aggregate.kind is AggregateKind.SUM:
            signed.append(start)
        elif width and aggregate.kind in (AggregateKind.AVG, AggregateKind.VAR,
                                          AggregateKind.STDDEV):
            signed.extend(range(start + 1, start + width))  # after the count: the moments
        start += width
    return Layout(start, blocks, tuple(signed))


# --- 1 and 2: contribution bounding ----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BoundedPairs:
    """Rows ordered by pair (``row_order``: input row index of each position), a uniformly random
    order within each pair; ``pair_of_row``: the pair index of each position; ``rank_in_pair``;
    and per pair its unit and partition codes and whether the unit kept it."""
    row_order: np.ndarray
    pair_of_row: np.ndarray
    rank_in_pair: np.ndarray
    pair_unit: np.ndarray
    pair_partition: np.ndarray
    pair_kept: np.ndarray


def _group_ranks(sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For keys sorted ascending: the group index of each position and its rank in the group."""
    if sorted_keys.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = np.empty(sorted_keys.size, dtype=bool)
    first[0] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=first[1:])
    group = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    return group, np.arange(sorted_keys.size) - starts[group]


def stable_argsort(values: np.ndarray) -> np.ndarray:
    """np.argsort(values, kind="stable") for integers, the same permutation (stable_sort)."""
    return stable_sort(values)[0]


def stable_sort(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(np.argsort(values, kind="stable"), the values in that order) for integers, faster: the
    sort of the distinct packed values (value - min) * 2^b + position, whose low b bits are
    then the permutation and whose high bits the sorted values (no gather of the values by the
    permutation). numpy sorts integers several times faster than it argsorts them stably (10
    against 140 ms at 10^6, 27 against 65 us at 2,000). The stable argsort itself where a
    packed value would not fit in 64 bits."""
    count = len(values)
    if count == 0:
        return np.argsort(values, kind="stable"), values
    low = int(values.min())
    position_bits = max((count - 1).bit_length(), 1)
    if (int(values.max()) - low).bit_length() + position_bits > 64:
        order = np.argsort(values, kind="stable")
        return order, values[order]
    # (value - min) >= 0 fits in 64 - b bits: its int64 bits read as uint64 are its value
    packed = np.subtract(values, low, dtype=np.int64).view(np.uint64)
    packed <<= np.uint64(position_bits)
    packed |= np.arange(count, dtype=np.uint64)
    packed.sort()
    ordered = (packed >> np.uint64(position_bits)).view(np.int64)
    ordered += low
    packed &= np.uint64((1 << position_bits) - 1)
    return packed.view(np.int64), ordered.astype(values.dtype, copy=False)


def _random_grouping(keys: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A permutation that sorts integer ``keys`` and orders equal keys uniformly at random (a
    stable sort of a uniformly shuffled array, so equal keys keep their shuffled order: no ties
    to break, the order depends on nothing but the shuffle), and the keys in that order."""
    shuffled = rng.permutation(keys.size)
    order, ordered = stable_sort(keys[shuffled])
    return shuffled[order], ordered


def bound_contributions(unit_codes: np.ndarray, partition_codes: np.ndarray, n_partitions: int,
                        max_partitions_contributed: int,
                        rng: np.random.Generator) -> BoundedPairs:
    """Steps 1 and 2 of the module docstring, vectorised over all rows."""
    pair_key = np.multiply(unit_codes, n_partitions, dtype=np.int64)
    pair_key += partition_codes
    row_order, sorted_key = _random_grouping(pair_key, rng)
    pair_of_row, rank_in_pair = _group_ranks(sorted_key)
    pair_key = sorted_key[rank_in_pair == 0]
    pair_unit, pair_partition = np.divmod(pair_key, n_partitions)
    if pair_unit.size == 0 or np.bincount(pair_unit).max() <= max_partitions_contributed:
        # No unit has more pairs than it keeps: all are kept whatever their order, so the
        # order is not drawn (the law is the same; a seeded run's bits too, since the caller
        # draws nothing from ``rng`` after this call: local.accumulate).
        pair_kept = np.ones(pair_key.size, dtype=bool)
    else:
        by_unit, units_in_order = _random_grouping(pair_unit, rng)
        _, rank_in_unit = _group_ranks(units_in_order)
        pair_kept = np.empty(pair_key.size, dtype=bool)
        pair_kept[by_unit] = rank_in_unit < max_partitions_contributed
    return BoundedPairs(row_order, pair_of_row, rank_in_pair, pair_unit, pair_partition,
                        pair_kept)


def rows_per_unit(unit_codes: np.ndarray, max_rows: int, rng: np.random.Generator) -> np.ndarray:
    """The input indices (ascending) of at most `max_rows` rows of each unit, chosen uniformly
    among that unit's rows (the bound the matrix mechanism's data vector needs, max_rows 1)."""
    order, units_in_order = _random_grouping(unit_codes.astype(np.int64), rng)
    _, rank_in_unit = _group_ranks(units_in_order)
    return np.sort(order[rank_in_unit < max_rows])


# --- 3: contributions --------------------------------------------------------------------------

def midpoint_and_half_width(low: float, high: float) -> tuple[float, float]:
    return (low + high) / 2.0, (high - low) / 2.0


def present_values(values: np.ndarray, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """Which of ``values`` are set (not NULL/NaN: SQL's NULL, skipped by every aggregate as in
    BigQuery) and the values clamped into [low, high], 0 where not set (an infinity is a value:
    it clamps to the nearer bound)."""
    present = ~np.isnan(values)
    # finite and within [low, high]: NaN was replaced, infinities clamp (mechanisms.bounded's
    # contract, without its second pass)
    clamped = np.clip(np.where(present, values, low), low, high)
    return present, np.where(present, clamped, 0.0)


def pair_contributions(query: AggregationQuery, bounds: Mapping[str, tuple[float, float]],
                       pair_of_row: np.ndarray, rank_in_pair: np.ndarray, n_pairs: int,
                       columns: Mapping[str, np.ndarray],
                       partitions_of_unit: np.ndarray) -> np.ndarray:
    """The (n_pairs, width) contribution vectors of pairs whose rows are given in pair order
    (``pair_of_row`` ascending, ``rank_in_pair`` a uniformly random order within each pair),
    ``columns[c]`` the values of column c in that order (NaN: NULL). ``bounds[name]``: the
    aggregate's [L, U]; ``partitions_of_unit``: per pair, how many pairs its unit kept
    (<= C_u). The Beam engine calls it with a batch of pairs, the local one with all kept
    pairs.

    NULL skipping (module docstring): a sampled row whose value is NULL adds nothing to that
    aggregate's block. Whether a row is skipped is a function of that row alone, applied after
    the sampling (which never looks at values), so each block of a unit's contribution keeps
    the range of the Delta table: skipping only removes terms from a sum of at most m bounded
    terms."""
    spec = layout(query)
    sampled = rank_in_pair < query.max_contributions_per_partition
    sampled_pairs = pair_of_row[sampled]
    out = np.zeros((n_pairs, spec.width))
    out[:, Layout.UNITS] = 1.0
    out[:, Layout.ROWS] = np.bincount(sampled_pairs, minlength=n_pairs)
    out[:, Layout.WEIGHT] = mechanisms.unit_weight(partitions_of_unit)
    for aggregate in query.aggregates:
        block = spec.blocks[aggregate.output_name]
        if block.start == block.stop:  # derived from another aggregate's noisy sums
            continue
        if counts_column(aggregate):  # each sampled row adds 0 or 1: at most m per pair
            present = ~np.isnan(columns[aggregate.column][sampled])
            out[:, block.start] = np.bincount(sampled_pairs, weights=present, minlength=n_pairs)
        elif aggregate.kind is AggregateKind.SUM and not aggregate.bounds_rows:
            # The unit's total over its non-NULL values, clamped; a pair with no value adds 0.
            column = columns[aggregate.column]
            present = ~np.isnan(column)
            totals = saturating_sums(pair_of_row, np.where(present, column, 0.0), n_pairs)
            has_value = np.bincount(pair_of_row, weights=present, minlength=n_pairs) > 0
            out[:, block.start] = np.where(
                has_value, mechanisms.bounded(totals, *bounds[aggregate.output_name]), 0.0)
        elif aggregate.bounds_rows:
            low, high = bounds[aggregate.output_name]
            present, values = present_values(columns[aggregate.column][sampled], low, high)
            if aggregate.kind is AggregateKind.SUM:  # the clamped values, not centred
                out[:, block.start] = np.bincount(sampled_pairs, weights=values,
                                                  minlength=n_pairs)
                continue
            if aggregate.kind is AggregateKind.QUANTILE:
                nodes = tree_nodes(values[present], low, high)
                out[:, block] = np.bincount(
                    (sampled_pairs[present][:, None] * QUANTILE_TREE_NODES + nodes).ravel(),
                    minlength=n_pairs * QUANTILE_TREE_NODES).reshape(n_pairs,
                                                                     QUANTILE_TREE_NODES)
                continue
            # AVG / VAR / STDDEV: their own count of non-NULL rows, then the centred moments.
            mid, half = midpoint_and_half_width(low, high)
            centred = np.where(present, values - mid, 0.0)
            out[:, block.start] = np.bincount(sampled_pairs, weights=present, minlength=n_pairs)
            out[:, block.start + 1] = np.bincount(sampled_pairs, weights=centred,
                                                  minlength=n_pairs)
            if aggregate.kind in (AggregateKind.VAR, AggregateKind.STDDEV):
                out[:, block.start + 2] = np.bincount(
                    sampled_pairs, weights=np.where(present, centred ** 2 - half ** 2 / 2.0, 0.0),
                    minlength=n_pairs)
    return out


def saturated(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """min(P, T) - min(N, T) with T = spec.MAX_MAGNITUDE: a sum of contributions c_i given as
    P = sum of max(c_i, 0) and N = sum of max(-c_i, 0) (either may be inf in floating point),
    saturated instead of overflowing (issue 29: an infinite sum made the charged run fail,
    or not, depending on the data).

    Why the sensitivity is kept: adding one unit adds p = max(c, 0) to P and n = max(-c, 0)
    to N (one of them 0), and t -> min(t, T) is non-decreasing and 1-Lipschitz, so the result
    moves by at most max(p, n) = |c|, per coordinate: the Delta of the table above, in L1 and
    in L2. Summing the signs apart matters: a running sum that overflowed and then met a
    negative term would not move by |c| only. The result lies in [-T, T], finite."""
    return np.minimum(positive, MAX_MAGNITUDE) - np.minimum(negative, MAX_MAGNITUDE)


def saturating_sums(groups: np.ndarray, weights: np.ndarray, n_groups: int) -> np.ndarray:
    """The saturated sum of ``weights`` per group (np.bincount's, through :func:`saturated`)."""
    return saturated(np.bincount(groups, weights=np.maximum(weights, 0.0), minlength=n_groups),
                     np.bincount(groups, weights=np.maximum(-weights, 0.0), minlength=n_groups))


def _level_offsets() -> np.ndarray:
    """The column of each level's first bucket in the tree block (level 1 first)."""
    return np.cumsum([0] + [QUANTILE_BRANCHING ** j for j in range(1, QUANTILE_LEVELS)])


def tree_nodes(values: np.ndarray, low: float, high: float) -> np.ndarray:
    """(len(values), H): each value's bucket column at every level of the tree block."""
    leaves = QUANTILE_BRANCHING ** QUANTILE_LEVELS
    leaf = np.clip(np.floor((values - low) / ((high - low) / leaves)), 0,
                   leaves - 1).astype(np.int64)
    depth = np.arange(1, QUANTILE_LEVELS + 1)
    return _level_offsets() + leaf[:, None] // QUANTILE_BRANCHING ** (QUANTILE_LEVELS - depth)


def sum_by_partition(partitions: np.ndarray, contributions: np.ndarray, n_partitions: int,
                     signed: tuple[int, ...]) -> np.ndarray:
    """The (n_partitions, width) accumulators: the saturated sum of each partition's pair
    vectors (:func:`saturated`). A column outside ``signed`` (Layout) has no negative part:
    one sum, saturated alike (min(P, T) - min(0, T))."""
    def column_sum(j: int) -> np.ndarray:
        if j in signed:
            return saturating_sums(partitions, contributions[:, j], n_partitions)
        return np.minimum(np.bincount(partitions, weights=contributions[:, j],
                                      minlength=n_partitions), MAX_MAGNITUDE)
    return np.stack([column_sum(j) for j in range(contributions.shape[1])], axis=1).reshape(
        n_partitions, contributions.shape[1])


# --- DP bounds (§4.2.5) ----------------------------------------------------------------------

# Log-scale buckets ±[2^j, 2^(j+1)) for j in [-10, 50), and |x| < 2^-10 as zero: a bucket
# index is a public function of one value, so a unit with k values changes k counts by 1.
_LOG_LOW, _LOG_HIGH = -10, 50
_LOG_BUCKETS = _LOG_HIGH - _LOG_LOW
LOG_HISTOGRAM_SIZE = 2 * _LOG_BUCKETS + 1
# An empty bucket's noisy count passes the threshold with probability <= this, over all buckets.
_EMPTY_BUCKET_PASS = 1e-4


def log_histogram(values: np.ndarray) -> np.ndarray:
    """Counts of the finite ``values`` in the log-scale buckets: index 0..59 negative (most
    negative first), 60 the zero bucket, 61..120 positive (smallest first)."""
    values = values[np.isfinite(values)]
    magnitude = np.clip(floor_log2(np.maximum(np.abs(values), 2.0 ** _LOG_LOW)),
                        _LOG_LOW, _LOG_HIGH - 1) - _LOG_LOW
    zero = np.abs(values) < 2.0 ** _LOG_LOW
    index = np.where(zero, _LOG_BUCKETS,
                     np.where(values > 0, _LOG_BUCKETS + 1 + magnitude,
                              _LOG_BUCKETS - 1 - magnitude))
    return np.bincount(index, minlength=LOG_HISTOGRAM_SIZE).astype(np.float64)


def bounds_values_per_unit(query: AggregationQuery, aggregate: Aggregate) -> int:
    """How many values one unit adds to the bounds histogram: a total per kept pair (unit-scoped
    SUM), or each sampled row of its kept pairs."""
    per_pair = query.max_contributions_per_partition if aggregate.bounds_rows else 1
    return query.partitions_per_unit * per_pair


def bounds_from_histogram(counts: np.ndarray, values_per_unit: int,
                          epsilon: float) -> tuple[tuple[float, float], mechanisms.Release]:
    """DP [L, U] from the log histogram (DP SQL §4.2.5, as Google's ApproxBounds): Laplace noise
    on every bucket (one unit changes the counts by at most ``values_per_unit`` in L1, so this is
    epsilon-DP), then post-processing: keep the buckets whose noisy count passes
    t = b ln(B / (2 beta)) (b the noise scale: an empty bucket passes with probability
    e^(-t/b) / 2 = beta / B), and return [min(0, lowest kept bucket's lower edge),
    max(0, highest kept bucket's upper edge)]; if none passes, the zero bucket's [-2^-10, 2^-10]
    (every value then counts as about 0, and ``Release.bounds`` shows it)."""
    noisy = mechanisms.laplace(counts, l1_sensitivity=float(values_per_unit), epsilon=epsilon)
    scale = values_per_unit / epsilon
    passing = np.flatnonzero(noisy.value > scale * math.log(LOG_HISTOGRAM_SIZE
                                                             / (2 * _EMPTY_BUCKET_PASS)))
    if passing.size == 0:  # too few values to tell: the zero bucket, a data-independent default
        passing = np.array([_LOG_BUCKETS])
    edges = [_bucket_edges(i) for i in (passing.min(), passing.max())]
    return (min(0.0, edges[0][0]), max(0.0, edges[1][1])), noisy


def _bucket_edges(index: int) -> tuple[float, float]:
    if index == _LOG_BUCKETS:
        return -(2.0 ** _LOG_LOW), 2.0 ** _LOG_LOW
    if index > _LOG_BUCKETS:
        j = index - _LOG_BUCKETS - 1 + _LOG_LOW
        return 2.0 ** j, 2.0 ** (j + 1)
    j = _LOG_BUCKETS - 1 - index + _LOG_LOW
    return -(2.0 ** (j + 1)), -(2.0 ** j)


def infer_bounds(query: AggregationQuery, aggregate: Aggregate, plan: BudgetPlan,
                 histogram: np.ndarray) -> tuple[tuple[float, float], dp_event.DpEvent]:
    """The aggregate's DP bounds from its log histogram, at its ``bounds:`` step's epsilon."""
    bounds, noisy = bounds_from_histogram(histogram, bounds_values_per_unit(query, aggregate),
                                          plan.step(BOUNDS_STEP_PREFIX
                                                    + aggregate.output_name).noise_epsilon)
    return bounds, noisy.event


def bounds_input(aggregate: Aggregate, pair_of_row: np.ndarray, rank_in_pair: np.ndarray,
                 n_pairs: int, column: np.ndarray, max_rows: int) -> np.ndarray:
    """The values one aggregate's bounds are inferred from: each kept pair's total (unit-scoped
    SUM) or its sampled rows' values, for pairs given in pair order."""
    if not aggregate.bounds_rows:  # pairs without a non-NULL value add nothing
        present = ~np.isnan(column)
        totals = np.bincount(pair_of_row, weights=np.where(present, column, 0.0),
                             minlength=n_pairs)
        return totals[np.bincount(pair_of_row, weights=present, minlength=n_pairs) > 0]
    return column[rank_in_pair < max_rows]  # log_histogram skips the NULLs (NaN)


# --- 4: noise, selection, post-processing ----------------------------------------------------

def _noisy(query: AggregationQuery, values: np.ndarray, sensitivity: float, epsilon: float,
           delta: float, l2_sensitivity: Optional[float] = None) -> mechanisms.Release:
    """One block's noisy sums at (epsilon, delta), sensitivity Delta per partition (module
    docstring: C_eff Delta in L1, sqrt(C_eff) Delta in L2, C_eff the query's
    partitions_per_unit), or ``l2_sensitivity`` per partition in L2 where it is below Delta
    (the quantile tree's)."""
    partitions = query.partitions_per_unit
    if NoiseKind(query.noise) is NoiseKind.LAPLACE:
        return mechanisms.laplace(values, l1_sensitivity=partitions * sensitivity,
                                  epsilon=epsilon)
    per_partition = sensitivity if l2_sensitivity is None else l2_sensitivity
    return mechanisms.gaussian(values, l2_sensitivity=math.sqrt(partitions) * per_partition,
                               epsilon=epsilon, delta=delta)


def _law(query: AggregationQuery, noisy: mechanisms.Release, sensitivity: float,
         l2_sensitivity: Optional[float] = None) -> accuracy.NoiseLaw:
    """The noise law `_noisy` ran with the same per-partition sensitivities (for stated
    accuracy)."""
    partitions = query.partitions_per_unit
    if NoiseKind(query.noise) is NoiseKind.LAPLACE:
        return accuracy.NoiseLaw.of(noisy.event, partitions * sensitivity)
    per_partition = sensitivity if l2_sensitivity is None else l2_sensitivity
    return accuracy.NoiseLaw.of(noisy.event, math.sqrt(partitions) * per_partition)


@dataclasses.dataclass(frozen=True)
class _NoisyMoments:
    """An AVG/VAR/STDDEV's noisy row count N and centred sum S, their noise laws, and its
    midpoint (the derived COUNT is N, the derived row-scoped SUM mid * N + S)."""
    rows: np.ndarray
    centred_sum: np.ndarray
    mid: float
    rows_law: accuracy.NoiseLaw
    sum_law: accuracy.NoiseLaw


def _mean_and_square(query, accumulators, block, plan, aggregate, low, high):
    """AVG / VAR from noisy (rows, centred sum[, centred squares]) (LLSY16, module docstring):
    AVG = mid + its centred estimate (mean_estimate: pooled over the released groups, or
    shrunk towards the midpoint), clamped to [L, U]; with
    mean = mid + S / max(N, 1), clamped, var = (Q / N + h^2 / 2) - (S / N)^2,
    clamped to [0, h^2]; STDDEV its square root. Returns (values, events of the noisy sums,
    the noisy moments, the stated accuracy as a call not yet made: `release` makes it only
    when asked)."""
    step = plan.step(aggregate.output_name)
    budgets = component_budgets(aggregate.kind, step.noise_epsilon, step.delta)
    m = query.max_contributions_per_partition
    mid, half = midpoint_and_half_width(low, high)
    rows = _noisy(query, accumulators[:, block.start], m, *budgets[0])
    centred = _noisy(query, accumulators[:, block.start + 1], m * half, *budgets[1])
    moments = _NoisyMoments(rows.value, centred.value, mid, _law(query, rows, m),
                            _law(query, centred, m * half))
    count = np.maximum(rows.value, 1.0)
    if aggregate.kind is AggregateKind.AVG:
        centred_mean, error = mean_estimate(rows.value, centred.value, half, moments.rows_law,
                                            moments.sum_law)
        mean = np.clip(mid + centred_mean, low, high)
        return mean, [rows.event, centred.event], moments, functools.partial(
            accuracy.mean, mean, error, rows.value, centred.value, mid, low, high,
            moments.rows_law, moments.sum_law)
    mean = np.clip(mid + centred.value / count, low, high)
    squares = _noisy(query, accumulators[:, block.start + 2], m * half ** 2 / 2.0, *budgets[2])
    centred_mean = mean - mid
    variance = np.clip(squares.value / count + half ** 2 / 2.0 - centred_mean ** 2,
                       0.0, half ** 2)
    value = variance if aggregate.kind is AggregateKind.VAR else np.sqrt(variance)
    laws = (moments.rows_law, moments.sum_law, _law(query, squares, m * half ** 2 / 2.0))
    return value, [rows.event, centred.event, squares.event], moments, functools.partial(
        accuracy.variance, rows.value, centred.value, squares.value, half, laws,
        root=aggregate.kind is AggregateKind.STDDEV)


def mean_shrinkage(rows: np.ndarray, half: float, rows_law: accuracy.NoiseLaw,
                   sum_law: accuracy.NoiseLaw) -> np.ndarray:
    """The factor t in [0, 1] by which AVG shrinks its noisy centred mean towards the midpoint:
    AVG = mid + t S / max(N, 1), clamped into [L, U], from its noisy count N = n + e_N and
    centred sum S = n mu + e_S (mu = mean - mid, |mu| <= h = (U - L) / 2: every value is
    clamped into [L, U]), with t = h^2 / (h^2 + v / N^2), v = sd_S^2 + h^2 sd_N^2.
    Post-processing of the two noisy sums: no budget, no change to the guarantee.

    Why t. To first order S / N = mu + (e_S - mu e_N) / n, whose noise has variance
    (sd_S^2 + mu^2 sd_N^2) / n^2 <= v / n^2. The estimator mid + t S / N has mean squared
    error (1 - t)^2 mu^2 + t^2 v / n^2, at most (1 - t)^2 h^2 + t^2 v / n^2 for every mu in
    [-h, h]; that worst case is least at t = h^2 / (h^2 + v / n^2), where it equals
    t v / n^2 <= v / n^2, the error of the plain ratio (t = 1). So the shrunk mean is no worse
    than mid + S / N whatever the true mean in [L, U] (the minimax linear estimator of a
    bounded mean, to first order), and much better where the noise is large against the
    count: the plain ratio of a partition of few rows is mostly noise (then clamped to a
    bound); the shrunk one stays near the midpoint. Where v / n^2 << h^2 (large partitions) t
    is 1 to within v / (n h)^2. N stands for n (post-processing: only noisy values and public
    parameters are read); accuracy.mean states sqrt(t v) / N as the error."""
    count = np.maximum(rows, 1.0)
    spread = (sum_law.stddev ** 2 + half ** 2 * rows_law.stddev ** 2) / count ** 2
    with np.errstate(over="ignore", invalid="ignore"):
        return half ** 2 / (half ** 2 + spread)


# Fewer released groups than this: too few to estimate how their means spread (the moment
# equation below has k - 1 degrees of freedom), so each mean is shrunk towards the midpoint alone.
POOLING_MIN_GROUPS = 10
# The least spread tau^2 the pooling assumes, as a fraction of h^2: (h / 100)^2, so that no group
# is replaced by the pooled mean outright (t_i > 0) when the moment equation finds no spread.
_POOLING_MIN_SPREAD = 1e-4
_BISECTIONS = 60


def mean_estimate(rows: np.ndarray, centred: np.ndarray, half: float,
                  rows_law: accuracy.NoiseLaw, sum_law: accuracy.NoiseLaw
                  ) -> tuple[np.ndarray, np.ndarray]:
    """AVG's centred estimate (the mean minus the midpoint, before clamping) of each released
    group from its noisy count N_i = n_i + e_N and centred sum S_i = n_i mu_i + e_S, and the
    estimate's stated root mean squared error (accuracy.mean). Post-processing: it reads the
    released groups' noisy sums and public parameters only (h, the noise laws), so it costs
    no budget and leaves the guarantee as it is.

    Pooled over the groups (Fay and Herriot 1979, the empirical Bayes estimator of small-area
    statistics), with k >= POOLING_MIN_GROUPS released groups. Each group's ratio
    r_i = S_i / max(N_i, 1) is, to first order (mean_shrinkage), mu_i + (e_S - mu_i e_N) / n_i:
    its noise variance is v_i = (sd_S^2 + T^2 sd_N^2) / N_i^2 with the groups' pooled mean T
    standing for mu_i. Say the groups' means spread around T with variance tau^2. The linear
    predictor of mu_i from r_i with least mean squared error (over that spread and the noise)
    is T + t_i (r_i - T), t_i = tau^2 / (tau^2 + v_i), of error t_i v_i: a group whose noise is
    small against the spread (a large group) keeps its own ratio (t_i ~ 1), a group whose
    ratio is mostly noise reads mostly the pooled mean. T and tau^2 are estimated from the
    noisy sums: T = sum S_i / sum N_i (clamped into [-h, h]), the mean of all the groups'
    rows, whose noise has variance V_T = k (sd_S^2 + T^2 sd_N^2) / (sum N_i)^2 (not Fay and
    Herriot's mean of the r_i weighted by 1 / (tau^2 + v_i): v_i reads the noisy count, so a
    group whose count noise is high gets a high weight and a ratio pulled towards 0, which
    biases such a mean towards the midpoint when the counts are mostly noise); tau^2 the root
    of Paule and Mandel's moment equation sum (r_i - T)^2 / (tau^2 + v_i) = k - 1 (the left
    side decreases in tau^2; bisection), held within [_POOLING_MIN_SPREAD h^2, h^2]: means
    within [-h, h] spread by at most h^2. Stated error: sqrt(t_i v_i + (1 - t_i)^2 V_T), the
    error of the predictor under that model, capped at h (accuracy.mean).

    What it changes against a per-group estimator: a group's released mean depends on the
    other groups' noisy sums (post-processing of one release, as any function of it may), and
    a small group is pulled towards the others' mean: one whose mean lies far from the rest
    gets an error near (1 - t_i) |mu_i - T|. When the groups' means differ, the moment
    equation finds a large tau^2 and every t_i is near 1. With fewer groups (or a ratio that is
    not finite: sums saturated at spec.MAX_MAGNITUDE), the minimax shrinkage towards the
    midpoint (mean_shrinkage: T = 0 and tau^2 = h^2 with v's worst case) of each group alone."""
    count = np.maximum(rows, 1.0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        ratio = centred / count
        if rows.size < POOLING_MIN_GROUPS or not np.all(np.isfinite(ratio)):
            shrinkage = mean_shrinkage(rows, half, rows_law, sum_law)
            spread = (sum_law.stddev ** 2 + half ** 2 * rows_law.stddev ** 2) / count ** 2
            return shrinkage * ratio, np.sqrt(shrinkage * spread)
        total = max(float(rows.sum()), 1.0)
        centre = float(np.clip(centred.sum() / total, -half, half))
        noise = (sum_law.stddev ** 2 + centre ** 2 * rows_law.stddev ** 2) / count ** 2

        def moment(tau2: float) -> float:
            return float(np.sum((ratio - centre) ** 2 / (tau2 + noise)))

        low, high = _POOLING_MIN_SPREAD * half ** 2, half ** 2
        if moment(low) <= rows.size - 1:
            tau2 = low
        elif moment(high) >= rows.size - 1:
            tau2 = high
        else:
            for _ in range(_BISECTIONS):
                middle = (low + high) / 2.0
                low, high = (middle, high) if moment(middle) > rows.size - 1 else (low, middle)
            tau2 = low
        shrinkage = tau2 / (tau2 + noise)
        centre_variance = rows.size * (sum_law.stddev ** 2
                                       + centre ** 2 * rows_law.stddev ** 2) / total ** 2
        error = np.sqrt(shrinkage * noise + (1.0 - shrinkage) ** 2 * centre_variance)
        return centre + shrinkage * (ratio - centre), error


def tree_total(noisy_nodes: np.ndarray) -> np.ndarray:
    """Per partition, the noisy total the descent starts from: the sum of the level-1 counts
    (negative counts read as 0, as the descent reads them)."""
    return np.maximum(noisy_nodes[:, :QUANTILE_BRANCHING], 0.0).sum(axis=1)


# The noisy rank at a leaf edge x, C(x) - q T, is a signed sum of at most this many node counts
# with coefficients in [-1, 1]: the b level-1 counts (those left of x weigh 1 - q, the others
# -q) and at most b - 1 left siblings per lower level (weight 1) -- 10 for b = 4, H = 3,
# against the 64 of a flat 64-bucket histogram (accuracy.quantile).
QUANTILE_RANK_TERMS = QUANTILE_BRANCHING + (QUANTILE_LEVELS - 1) * (QUANTILE_BRANCHING - 1)


def quantile_from_tree(noisy_nodes: np.ndarray, q, low: float, high: float) -> np.ndarray:
    """Post-processing of (partitions, QUANTILE_TREE_NODES) noisy tree counts: a descent from
    the root. At each level, among the current bucket's b children (negative counts read as
    0), take the child where their cumulative count reaches the fraction ``target`` of their
    total (q at the root) and carry on with the fraction of that child still to cover; at the
    leaves, interpolate linearly. A level whose children have no positive count says nothing:
    the child and fraction then follow ``target`` as if the mass were uniform. q = 0 stops in
    the first child with a positive count, at its lower edge; q = 1 in the last, at its upper
    edge. With no positive count anywhere the descent is uniform: L + q (U - L). ``q``: one
    fraction, or one per partition."""
    b = QUANTILE_BRANCHING
    rows = np.arange(noisy_nodes.shape[0])
    node = np.zeros(rows.size, dtype=np.int64)
    q = np.broadcast_to(np.asarray(q, dtype=np.float64), rows.shape)
    target = q.copy()
    for offset in _level_offsets():
        children = np.maximum(noisy_nodes[rows[:, None], offset + node[:, None] * b
                                          + np.arange(b)], 0.0)
        cumulative = np.cumsum(children, axis=1)
        total = cumulative[:, -1]
        wanted = target * total
        index = np.where(q < 1.0, (cumulative <= wanted[:, None]).sum(axis=1),
                         (cumulative < wanted[:, None]).sum(axis=1))
        index = np.minimum(index, b - 1)
        before = np.where(index > 0, cumulative[rows, np.maximum(index - 1, 0)], 0.0)
        inside = children[rows, index]
        informed = np.where(inside > 0, (wanted - before) / np.where(inside > 0, inside, 1.0),
                            0.0)
        uniform_index = np.minimum(np.floor(target * b), b - 1).astype(np.int64)
        empty = total <= 0
        index = np.where(empty, uniform_index, index)
        target = np.clip(np.where(empty, target * b - uniform_index, informed), 0.0, 1.0)
        node = node * b + index
    width = (high - low) / b ** QUANTILE_LEVELS
    return low + (node + target) * width


def shared_bounds(query: AggregationQuery,
                  bounds: Mapping[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """``bounds`` (an engine's: literal, or inferred by a step) with each quantile that reads
    another one's tree (budget.derived_from) given that one's bounds: equal when literal, and
    when inferred the source's bounds step is the only one that ran."""
    shared = dict(bounds)
    for name, source in derived_from(query).items():
        if source in bounds and name not in shared:
            shared[name] = bounds[source]
    return shared


def _quantile_of(tree: np.ndarray, law: accuracy.NoiseLaw, q: float, low: float,
                 high: float) -> tuple[np.ndarray, Callable[[], tuple]]:
    """The quantile q read from a partition-by-node matrix of noisy tree counts, and its
    stated accuracy (accuracy.quantile) as a call not yet made (two more descents: `release`
    makes it only when asked): post-processing, so any number of quantiles read one noisy
    tree for the price of one."""
    return quantile_from_tree(tree, q, low, high), functools.partial(
        accuracy.quantile, tree_total(tree), QUANTILE_RANK_TERMS, q, law,
        lambda fractions: quantile_from_tree(tree, fractions, low, high), low, high)


def release(query: AggregationQuery, plan: BudgetPlan, keys: pd.DataFrame,
            accumulators: np.ndarray, bounds: Mapping[str, tuple[float, float]],
            bounds_events: Mapping[str, object], intervals: bool = False
            ) -> tuple[pd.DataFrame, dict, Optional[pd.DataFrame]]:
    """Step 4: select partitions (unless public), add each aggregate's noise on the kept ones
    and post-process. ``keys``: one row per accumulator row (the group-by values). Returns the
    released table (sorted by the keys), the events by step name, in plan order, and with
    ``intervals`` each aggregate's stated accuracy (accuracy.py: ``<name>_stddev``,
    ``_ci_low``, ``_ci_high``, row by row as the table; None without: not computed).
    Quantiles of one column with the same bounds read one noisy tree and are released in the
    order of q (sorted per partition: post-processing)."""
    events = dict(bounds_events)
    selected_counts: Optional[np.ndarray] = None
    if SelectionRule(query.selection) is not SelectionRule.PUBLIC:
        # The candidates are the partitions some unit's kept pair is in. A key whose pairs
        # step 2 all dropped is not one: kept as a candidate with count 0, it would be released
        # with the threshold's tail probability, so a unit in k > C partitions would make k of
        # them candidates where the selection's delta is calibrated for C (each engine built
        # its keys from every row; Beam has no accumulator for such a key anyway).
        contributed = accumulators[:, Layout.UNITS] > 0
        keys, accumulators = keys[contributed], accumulators[contributed]
        weighted = SelectionRule(query.selection) is SelectionRule.WEIGHTED_GAUSSIAN
        selection = run_selection(query, plan.step(SELECTION_STEP),
                                  accumulators[:, Layout.WEIGHT] if weighted
                                  else accumulators[:, Layout.UNITS].astype(np.int64))
        events[SELECTION_STEP] = selection.event
        keep = selection.value.keep
        selected_counts = selection.value.noisy_unit_counts
        keys, accumulators = keys[keep], accumulators[keep]
    table = keys.reset_index(drop=True)
    spec = layout(query)
    derived = derived_from(query)
    moments: dict[str, _NoisyMoments] = {}
    trees: dict[str, tuple[np.ndarray, accuracy.NoiseLaw]] = {}  # a quantile's noisy tree
    stated: Optional[dict[str, tuple]] = {} if intervals else None

    def state(name: str, accuracy_of: Callable, *arguments) -> None:
        """The aggregate's stated accuracy, accuracy_of(*arguments), computed only if asked."""
        if stated is not None:
            stated[name] = accuracy_of(*arguments)

    # Aggregates with a step first (in query order); the derived ones read their sources after.
    for aggregate in sorted(query.aggregates, key=lambda a: a.output_name in derived):
        name = aggregate.output_name
        if name in derived:
            source = derived[name]
            if source == SELECTION_STEP:
                table[name] = np.asarray(selected_counts, dtype=np.float64)
                law = accuracy.NoiseLaw.of(events[SELECTION_STEP],
                                           math.sqrt(query.max_partitions_contributed))
                state(name, accuracy.additive, table[name].to_numpy(), [(1.0, law)])
            elif aggregate.kind is AggregateKind.QUANTILE:  # the source quantile's tree
                table[name], accuracy_of = _quantile_of(*trees[source], aggregate.q,
                                                        *bounds[name])
                state(name, accuracy_of)
            elif aggregate.kind is AggregateKind.COUNT:
                table[name] = moments[source].rows
                state(name, accuracy.additive, moments[source].rows,
                      [(1.0, moments[source].rows_law)])
            else:  # saturated as the sums are (post-processing of the noisy moments)
                with np.errstate(over="ignore"):
                    total = moments[source].mid * moments[source].rows \
                        + moments[source].centred_sum
                table[name] = np.clip(total, -MAX_MAGNITUDE, MAX_MAGNITUDE)
                state(name, accuracy.additive, table[name].to_numpy(), [
                    (moments[source].mid, moments[source].rows_law),
                    (1.0, moments[source].sum_law)])
            continue
        step = plan.step(name)
        block = spec.blocks[name]
        if aggregate.kind in (AggregateKind.COUNT, AggregateKind.COUNT_DISTINCT):
            column = (block.start if counts_column(aggregate) else Layout.ROWS
                      if aggregate.kind is AggregateKind.COUNT else Layout.UNITS)
            sensitivity = (query.max_contributions_per_partition
                           if aggregate.kind is AggregateKind.COUNT else 1)
            noisy = _noisy(query, accumulators[:, column], sensitivity, step.noise_epsilon,
                           step.delta)
            table[name], events[name] = noisy.value, noisy.event
            state(name, accuracy.additive, noisy.value,
                  [(1.0, _law(query, noisy, sensitivity))])
            continue
        low, high = bounds[name]
        if aggregate.kind is AggregateKind.SUM:
            rows = query.max_contributions_per_partition if aggregate.bounds_rows else 1
            sensitivity = rows * max(abs(low), abs(high))
            noisy = _noisy(query, accumulators[:, block.start], sensitivity,
                           step.noise_epsilon, step.delta)
            table[name], events[name] = noisy.value, noisy.event
            state(name, accuracy.additive, noisy.value,
                  [(1.0, _law(query, noisy, sensitivity))])
        elif aggregate.kind is AggregateKind.QUANTILE:
            m = query.max_contributions_per_partition
            sensitivities = dict(sensitivity=QUANTILE_LEVELS * m,
                                 l2_sensitivity=math.sqrt(QUANTILE_LEVELS) * m)
            noisy = _noisy(query, accumulators[:, block], epsilon=step.noise_epsilon,
                           delta=step.delta, **sensitivities)
            trees[name] = (noisy.value.reshape(len(table), QUANTILE_TREE_NODES),
                           _law(query, noisy, **sensitivities))
            table[name], accuracy_of = _quantile_of(*trees[name], aggregate.q, low, high)
            state(name, accuracy_of)
            events[name] = noisy.event
        else:
            value, parts, moments[name], accuracy_of = _mean_and_square(
                query, accumulators, block, plan, aggregate, low, high)
            table[name], events[name] = value, dp_event.ComposedDpEvent(parts)
            state(name, accuracy_of)
    _quantiles_in_order(query, bounds, table, stated)
    names = [a.output_name for a in query.aggregates]
    table = table[list(query.group_by) + names]
    order = np.asarray(table.sort_values(list(query.group_by)).index)
    ordered = {s.name: events[s.name] for s in plan.steps}
    if stated is None:
        return table.iloc[order].reset_index(drop=True), ordered, None
    stated_table = pd.DataFrame({column: values for name in names for column, values in
                                 zip(accuracy.interval_columns(name), stated[name])})
    return (table.iloc[order].reset_index(drop=True), ordered,
            stated_table.iloc[order].reset_index(drop=True))


def _quantiles_in_order(query: AggregationQuery, bounds, table: pd.DataFrame,
                        stated: Optional[dict]) -> None:
    """Sort, per partition, the quantiles that read one column with the same bounds by q
    (an NTILE's cut points, a MEDIAN beside a MIN): post-processing, so the released
    quantiles are monotone in q (accuracy.monotone says why the intervals stay valid; None:
    no stated accuracy was asked for)."""
    groups: dict[tuple, list] = {}
    for aggregate in query.aggregates:
        if aggregate.kind is AggregateKind.QUANTILE:
            groups.setdefault((aggregate.column, bounds[aggregate.output_name]), []).append(
                aggregate)
    for members in groups.values():
        if len(members) < 2 or len(table) == 0:
            continue
        names = [a.output_name for a in sorted(members, key=lambda a: a.q)]
        table[names] = accuracy.monotone(table[names].to_numpy())
        if stated is None:
            continue
        # The interval ends are sorted alike (accuracy.monotone); each quantile keeps its own
        # noise stddev, which is a scale, not a value ordered by q.
        for part in (1, 2):
            sorted_part = accuracy.monotone(np.stack([stated[n][part] for n in names], axis=1))
            for index, name in enumerate(names):
                stated[name] = tuple(sorted_part[:, index] if p == part else stated[name][p]
                                     for p in range(3))
