"""The DP aggregation query, frozen (issue 18; DP SQL, Wilson et al. 2020, §4.2.3).

``SELECT WITH ANONYMIZATION g1, g2, ANON_COUNT(*), ANON_SUM(x, L, U) ... GROUP BY g1, g2`` is an
:class:`AggregationQuery`: the group-by columns, the privacy-unit column, one :class:`Aggregate`
per output column, the contribution bounds and the partition selection rule. It holds no data and
no budget; ``plan`` splits a grant among its steps and ``aggregate`` runs it.

What each aggregate reads (the two-stage aggregation of §4.2.3). After stability bounding, a unit
keeps at most ``max_partitions_contributed`` (C_u) partitions, sampled uniformly, and in each at
most ``max_contributions_per_partition`` (m) of its rows, sampled uniformly. Then:

=================  =========================================================  ==================
kind               the unit's contribution to one partition                   bounds [low, high]
=================  =========================================================  ==================
COUNT              its number of kept rows, in [0, m]                         none
COUNT(column)      its number of kept rows where column is not NULL, [0, m]   none
COUNT_DISTINCT     1                                                          none
SUM (scope UNIT)   the sum of ALL its non-NULL values, clamped into [low, high] the unit's total
SUM (scope ROW)    the sum of its kept non-NULL values, each clamped          each row's value
AVG, VAR, STDDEV   its kept non-NULL values, each clamped into [low, high]    each row's value
QUANTILE           its kept non-NULL values, each clamped into [low, high]    each row's value
=================  =========================================================  ==================

NULLs (BigQuery's semantics, for every aggregate that reads a column): a NULL or NaN value is
skipped by that aggregate, never replaced (not by 0, not by a midpoint). COUNT(column) counts
the non-NULL values; SUM adds the non-NULL values; AVG, VAR, STDDEV and the quantiles are of
the non-NULL values (AVG divides by their count, not by the rows'); a partition whose values
are all NULL still gets a noisy release (of an empty set: AVG then reads its noisy sums near
0, and is clamped into [low, high]). COUNT(*) counts rows whatever their values.
An infinite value is a value: it is clamped to the nearer bound. aggregators.py shows why
skipping keeps every sensitivity.

SUM's bounds apply to the unit's total in the partition by default (the seed's ANON_SUM, and
BigQuery's contribution_bounds_per_group); ``scope=BoundsScope.ROW`` clamps each row instead
(BigQuery's contribution_bounds_per_row, PipelineDP's min_value/max_value). A row-scoped SUM
with the same column and literal bounds as an AVG/VAR/STDDEV of the query, and COUNT(column)
of that column, are post-processed from that aggregate's noisy row count and centred sum (budget.py).

``low``/``high`` left ``None`` are inferred with DP from the data (§4.2.5), at a budget share of
their own. MEDIAN, MIN, MAX and NTILE are quantiles: q = 0.5, 0, 1 and the NTILE's fraction.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Optional

# The unit a release states (the release protocol's), re-exported: the operator takes it.
from sage_tfx.release.guarantee import GuaranteeUnit  # noqa: F401


class AggregateKind(str, enum.Enum):
    COUNT = "count"                    # COUNT(*): rows; COUNT(col): rows where col is not null
    COUNT_DISTINCT = "count_distinct"  # COUNT(DISTINCT unit): privacy units
    SUM = "sum"
    AVG = "avg"
    VAR = "var"
    STDDEV = "stddev"
    QUANTILE = "quantile"              # NTILE / MEDIAN / MIN / MAX


class SelectionRule(str, enum.Enum):
    """Which partitions (group-by keys) may appear in the release (mechanisms/selection.py)."""
    LAPLACE_THRESHOLD = "laplace_threshold"      # the seed's tau-thresholding, noisy unit count
    GAUSSIAN_THRESHOLD = "gaussian_threshold"
    TRUNCATED_GEOMETRIC = "truncated_geometric"  # Desfontaines et al. 2022
    # Gopi et al. 2020: Gaussian noise on each partition's sum of unit weights 1 / sqrt(k) (a
    # unit in k partitions); L2 sensitivity 1 instead of sqrt(C_u): the most partitions.
    WEIGHTED_GAUSSIAN = "weighted_gaussian"
    PUBLIC = "public"                            # listed by the caller: no selection, no budget


def default_selection(max_partitions_contributed: int) -> SelectionRule:
    """The selection rule of a query that names none (AggregationQuery's, and so SQL's): the
    weighted Gaussian where a unit may be in several partitions (its L2 sensitivity stays 1
    where a count's is sqrt(C): it keeps a group from fewer units from C = 2 on, e.g. 44
    units in one group against the truncated geometric's 100 at C = 4, selection epsilon 0.5,
    delta 1e-6), the truncated geometric at C = 1 (there Gaussian tails cost more than
    geometric ones: 26 units against 42)."""
    return (SelectionRule.TRUNCATED_GEOMETRIC if max_partitions_contributed == 1
            else SelectionRule.WEIGHTED_GAUSSIAN)


class NoiseKind(str, enum.Enum):
    """The additive noise of the aggregates: Laplace (pure epsilon, L1 sensitivity C_u * Delta)
    or Gaussian (uses delta, L2 sensitivity sqrt(C_u) * Delta: less noise when C_u > 1)."""
    LAPLACE = "laplace"
    GAUSSIAN = "gaussian"


class BoundsScope(str, enum.Enum):
    """What [low, high] clamps: the unit's total in the partition, or each of its rows."""
    UNIT = "unit"
    ROW = "row"


_BOUNDED_KINDS = (AggregateKind.SUM, AggregateKind.AVG, AggregateKind.VAR, AggregateKind.STDDEV,
                  AggregateKind.QUANTILE)
_ROW_VALUE_KINDS = (AggregateKind.AVG, AggregateKind.VAR, AggregateKind.STDDEV,
                    AggregateKind.QUANTILE)


class QueryError(ValueError):
    """A query the operator refuses; the message names what is wrong. Raised before anything is
    read or charged."""


def _as_enum(holder, field: str, enum_type) -> None:
    """Store a valid string option as its enum member (the code compares members with ``is``);
    an invalid one stays as given for ``check()`` to refuse with its name."""
    value = getattr(holder, field)
    if value is not None and not isinstance(value, enum_type):
        try:
            object.__setattr__(holder, field, enum_type(value))
        except ValueError:
            pass


@dataclasses.dataclass(frozen=True)
class Aggregate:
    """One DP output column. ``name`` defaults to ``kind`` or ``kind_column`` (``median_fare``
    for q = 0.5). ``low``/``high``: see the module table; None infers them with DP."""
    kind: AggregateKind
    column: Optional[str] = None
    low: Optional[float] = None
    high: Optional[float] = None
    q: Optional[float] = None
    name: Optional[str] = None
    scope: Optional[BoundsScope] = None  # None: UNIT for SUM, ROW for the others

    def __post_init__(self):
        _as_enum(self, "kind", AggregateKind)
        _as_enum(self, "scope", BoundsScope)

    @classmethod
    def count(cls, column: Optional[str] = None, name: Optional[str] = None) -> "Aggregate":
        """COUNT(*), or with ``column`` the count of rows where it is not null (NaN in a
        pandas frame is null): each kept row adds 0 or 1, so the sensitivity is COUNT(*)'s."""
        return cls(AggregateKind.COUNT, column, name=name)

    @classmethod
    def count_distinct(cls, name: Optional[str] = None) -> "Aggregate":
        return cls(AggregateKind.COUNT_DISTINCT, name=name)

    @classmethod
    def median(cls, column: str, low: Optional[float] = None, high: Optional[float] = None,
               name: Optional[str] = None) -> "Aggregate":
        return cls(AggregateKind.QUANTILE, column, low, high, q=0.5, name=name)

    @classmethod
    def minimum(cls, column: str, low: Optional[float] = None, high: Optional[float] = None,
                name: Optional[str] = None) -> "Aggregate":
        return cls(AggregateKind.QUANTILE, column, low, high, q=0.0, name=name)

    @classmethod
    def maximum(cls, column: str, low: Optional[float] = None, high: Optional[float] = None,
                name: Optional[str] = None) -> "Aggregate":
        return cls(AggregateKind.QUANTILE, column, low, high, q=1.0, name=name)

    @property
    def output_name(self) -> str:
        if self.name:
            return self.name
        if self.kind is AggregateKind.QUANTILE:
            label = {0.0: "min", 0.5: "median", 1.0: "max"}.get(self.q, f"quantile_{self.q:g}")
            return f"{label}_{self.column}"
        kind = getattr(self.kind, "value", self.kind)  # an invalid kind is named by check()
        return str(kind) if self.column is None else f"{kind}_{self.column}"

    @property
    def bounded(self) -> bool:
        """True for the aggregates that clamp values into [low, high]."""
        return self.kind in _BOUNDED_KINDS

    @property
    def bounds_inferred(self) -> bool:
        return self.bounded and self.low is None

    def largest_change(self, max_rows: int) -> Optional[float]:
        """The most one unit moves one of this aggregate's noisy sums in one partition, at most
        ``max_rows`` rows read (aggregators.py's Delta table; the centred squares' |clamp -
        mid|^2 <= h^2 bound is the largest of its terms), or None without literal bounds (the
        DP bounds lie within +-2^50). Non-finite when the bounds' midpoint or width is."""
        if not self.bounded or self.low is None:
            return None
        if not (math.isfinite(self.low + self.high) and math.isfinite(self.high - self.low)):
            return math.inf  # the midpoint or the width overflows
        if self.kind is AggregateKind.SUM:
            return max(abs(self.low), abs(self.high)) * (max_rows if self.bounds_rows else 1)
        if self.kind is AggregateKind.QUANTILE:  # one bucket per level of the tree per row
            return float(max_rows * QUANTILE_LEVELS)
        half = (self.high - self.low) / 2.0
        return max_rows * (half if self.kind is AggregateKind.AVG else max(half, half * half))

    @property
    def bounds_rows(self) -> bool:
        """True when [low, high] clamps each row's value, False when it clamps the unit's sum."""
        return self.kind in _ROW_VALUE_KINDS or self.scope == BoundsScope.ROW

    def check(self) -> None:
        where = f"aggregate {self.output_name!r}"
        try:
            kind = AggregateKind(self.kind)
        except ValueError:
            raise QueryError(f"{where}: unknown kind {self.kind!r}; one of "
                             f"{[k.value for k in AggregateKind]}") from None
        if kind is AggregateKind.COUNT_DISTINCT and self.column is not None:
            raise QueryError(f"{where}: count_distinct counts units; it takes no column")
        if kind in (AggregateKind.COUNT, AggregateKind.COUNT_DISTINCT):
            if (self.low, self.high, self.q, self.scope) != (None,) * 4:
                raise QueryError(f"{where}: {kind.value} takes no bounds, q or scope")
            if self.column is not None and not (isinstance(self.column, str) and self.column):
                raise QueryError(f"{where}: count's column must be a column name, got "
                                 f"{self.column!r}")
            return
        if not self.column:
            raise QueryError(f"{where}: {kind.value} needs a column")
        if (self.low is None) != (self.high is None):
            raise QueryError(f"{where}: give both bounds or neither (neither infers them with "
                             f"DP), got low={self.low!r} high={self.high!r}")
        if self.low is not None:
            if not (math.isfinite(self.low) and math.isfinite(self.high)
                    and self.low < self.high):
                raise QueryError(f"{where}: bounds must be finite with low < high, got "
                                 f"[{self.low!r}, {self.high!r}]")
        if self.scope is not None:
            try:
                scope = BoundsScope(self.scope)
            except ValueError:
                raise QueryError(f"{where}: unknown bounds scope {self.scope!r}") from None
            if scope is BoundsScope.UNIT and kind is not AggregateKind.SUM:
                raise QueryError(f"{where}: only SUM can clamp the unit's total; {kind.value} "
                                 "clamps each row")
        if kind is AggregateKind.QUANTILE:
            if self.q is None or not 0.0 <= self.q <= 1.0:
                raise QueryError(f"{where}: quantile needs q in [0, 1], got {self.q!r}")
        elif self.q is not None:
            raise QueryError(f"{where}: q is for quantiles, not {kind.value}")


# The largest magnitude a released sum or its noise scale may reach: 2^1000 (about 1.07e301).
# Accumulated sums saturate at it (aggregators.saturated), and a query whose bounds let one unit
# move a sum, or whose noise scale, beyond it is refused before anything is charged. Below
# 2^1023 by a factor of 2^23, so a saturated sum plus its noise (beyond 2^23 noise scales with
# probability e^-8388608) stays finite.
MAX_MAGNITUDE = 2.0 ** 1000


# The quantile tree (aggregators.py): QUANTILE_LEVELS levels, each bucket split in
# QUANTILE_BRANCHING; a row is counted once per level.
QUANTILE_BRANCHING = 4
QUANTILE_LEVELS = 3


# BigQuery's max_groups_contributed default (WITH DIFFERENTIAL_PRIVACY OPTIONS) and PipelineDP's
# usual setting; an analyst who knows the data sets both.
DEFAULT_MAX_PARTITIONS_CONTRIBUTED = 4
# Rows of one unit in one partition that COUNT(*) and the row-value aggregates read: the
# sensitivity of COUNT(*) and of the row-value aggregates grows linearly with it.
DEFAULT_MAX_CONTRIBUTIONS_PER_PARTITION = 8


@dataclasses.dataclass(frozen=True)
class AggregationQuery:
    """One DP GROUP BY. ``public_partitions``: the group-by key tuples to release (with
    ``selection=SelectionRule.PUBLIC``): rows in other partitions are dropped before bounding,
    and listed partitions without rows are released with noise. ``infer_bounds``: whether
    aggregates without literal bounds get DP bounds (§4.2.5) or are refused."""
    group_by: tuple[str, ...]
    unit_column: str
    aggregates: tuple[Aggregate, ...]
    max_partitions_contributed: int = DEFAULT_MAX_PARTITIONS_CONTRIBUTED
    max_contributions_per_partition: int = DEFAULT_MAX_CONTRIBUTIONS_PER_PARTITION
    selection: Optional[SelectionRule] = None  # None: default_selection(C)
    public_partitions: Optional[tuple[tuple, ...]] = None
    noise: NoiseKind = NoiseKind.LAPLACE
    infer_bounds: bool = True  # False: an aggregate without literal bounds is refused

    def __post_init__(self):
        if self.selection is None:
            object.__setattr__(self, "selection",
                               default_selection(self.max_partitions_contributed))
        _as_enum(self, "selection", SelectionRule)
        _as_enum(self, "noise", NoiseKind)
        for field in ("group_by", "aggregates"):  # lists from a parser become tuples
            if isinstance(getattr(self, field), list):
                object.__setattr__(self, field, tuple(getattr(self, field)))
        if isinstance(self.public_partitions, (list, tuple)):
            object.__setattr__(self, "public_partitions", tuple(
                tuple(key) if isinstance(key, list) else key for key in self.public_partitions))

    @property
    def partitions_per_unit(self) -> int:
        """C_eff: the most partitions one unit touches after bounding, the factor of every
        sensitivity (C_eff Delta in L1, sqrt(C_eff) Delta in L2: aggregators.py).

        Selected partitions: C_u. Public partitions (a query without GROUP BY is one):
        min(C_u, G), G = len(public_partitions). Why: rows outside the G listed partitions are
        dropped before bounding, so a unit's pairs lie in at most G partitions, and bounding
        keeps at most C_u of them: the unit's vector is nonzero in at most min(C_u, G)
        partitions (the L0 bound), each moved by at most Delta. G is the public list's length
        (public, checked distinct), never the count of partitions the data fills, so the noise
        scale is the same on neighbouring tables. The plan's events are per unit of
        sensitivity: the charge does not depend on C_eff, only the noise's scale does."""
        if self.selection == SelectionRule.PUBLIC and isinstance(self.public_partitions, tuple):
            return max(1, min(self.max_partitions_contributed, len(self.public_partitions)))
        return self.max_partitions_contributed

    def largest_change(self, aggregate: Aggregate) -> Optional[float]:
        """The most one unit moves the L1 norm of one of the aggregate's noisy sums over the
        C_eff partitions it touches (None: bounds inferred with DP, small by construction)."""
        per_partition = aggregate.largest_change(self.max_contributions_per_partition)
        return None if per_partition is None else self.partitions_per_unit * per_partition

    def _check_magnitudes(self) -> None:
        """Refuse bounds whose worst case is not finite (issue 29): one unit's change to a sum
        must stay below MAX_MAGNITUDE, so that sums saturating there keep their sensitivity and
        their noise scale is finite."""
        for option in ("max_partitions_contributed", "max_contributions_per_partition"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return  # refused below, by name
        for aggregate in self.aggregates:
            change = self.largest_change(aggregate)
            if change is not None and not change <= MAX_MAGNITUDE:
                raise QueryError(
                    f"aggregate {aggregate.output_name!r}: bounds [{aggregate.low!r}, "
                    f"{aggregate.high!r}] let one unit move a released sum by up to {change:g} "
                    f"(over {self.partitions_per_unit} group(s) per unit and "
                    f"{self.max_contributions_per_partition} rows per group), beyond 2^1000 "
                    f"(about {MAX_MAGNITUDE:.3g}), where sums saturate; narrow the bounds")

    def check(self, columns=None) -> None:
        """Raise QueryError naming the first problem; with ``columns`` (the table's column
        names) also refuse unknown columns."""
        if not self.group_by or not all(isinstance(c, str) and c for c in self.group_by):
            raise QueryError(f"group_by must name at least one column, got {self.group_by!r}")
        if len(set(self.group_by)) != len(self.group_by):
            raise QueryError(f"group_by repeats a column: {self.group_by!r}")
        if not isinstance(self.unit_column, str) or not self.unit_column:
            raise QueryError(f"unit_column must name the privacy-unit column, got "
                             f"{self.unit_column!r}")
        if self.unit_column in self.group_by:
            raise QueryError(f"group_by contains the unit column {self.unit_column!r}: every "
                             "partition would hold one unit's rows")
        if not self.aggregates:
            raise QueryError("a query needs at least one aggregate")
        for aggregate in self.aggregates:
            aggregate.check()
            if aggregate.bounds_inferred and not self.infer_bounds:
                raise QueryError(f"aggregate {aggregate.output_name!r} has no bounds and bounds "
                                 "inference is off (infer_bounds=False): give [low, high]")
        self._check_magnitudes()
        names = [a.output_name for a in self.aggregates]
        clashes = sorted({n for n in names if names.count(n) > 1}
                         | (set(names) & set(self.group_by)))
        if clashes:
            raise QueryError(f"output column names clash: {clashes}; name the aggregates")
        for option in ("max_partitions_contributed", "max_contributions_per_partition"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise QueryError(f"{option} must be a positive integer, got {value!r}")
        try:
            selection = SelectionRule(self.selection)
            NoiseKind(self.noise)
        except ValueError as error:
            raise QueryError(f"unknown option: {error}") from None
        if (selection is SelectionRule.PUBLIC) != (self.public_partitions is not None):
            raise QueryError("public_partitions and selection=SelectionRule.PUBLIC go together "
                             f"(got selection={selection.value!r}, public_partitions "
                             f"{'given' if self.public_partitions is not None else 'absent'})")
        if self.public_partitions is not None:
            width = len(self.group_by)
            bad = [key for key in self.public_partitions
                   if not isinstance(key, tuple) or len(key) != width]
            if bad:
                raise QueryError(f"public_partitions must be tuples of {width} key values "
                                 f"(one per group_by column), got {bad[:3]!r}")
            if len(set(self.public_partitions)) != len(self.public_partitions):
                raise QueryError("public_partitions lists a key twice")
        if columns is not None:
            wanted = list(self.group_by) + [self.unit_column] + [
                a.column for a in self.aggregates if a.column is not None]
            missing = [c for c in dict.fromkeys(wanted) if c not in set(columns)]
            if missing:
                raise QueryError(f"unknown column(s) {missing}; the table has {list(columns)}")
