"""The continual-release query, frozen (issue 19; DP-SQLP, Zhang et al. 2023, §3).

``SELECT key, COUNT(*) | SUM(value) ... GROUP BY key`` over one event-time window, released at T
public trigger times: a :class:`StreamQuery` names the columns, the per-record value bound L, the
per-unit contribution limit C (records over the whole window), the number of micro-batches T and
the window's (epsilon, delta). It holds no data and no state; ``budget.plan`` calibrates the
trees and ``operator.step`` runs one micro-batch.

The neighbouring relation: add or remove all records of one unit (``unit_column``) within the
window's ledger blocks; trigger times are public (a function of the window, never of the data).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

from sage_tfx.choices import Choice
from sage_tfx.dp_statistics.aggregation.spec import QueryError
from sage_tfx.release import Guarantee, GuaranteeUnit

# Trigger steps, tree leaves and rounds are int32 in the state; 2^20 micro-batches is already
# far more than a window's refreshes (one a second for 12 days).
MAX_MICRO_BATCHES = 2 ** 20


class StreamStatistic(Choice):
    """What each key's released number estimates."""
    COUNT = "count"  # COUNT(*): each kept record adds 1 (value 1, L = 1)
    SUM = "sum"      # SUM(value): each kept record adds its value clamped into [-L, L]


class StreamMechanism(Choice):
    """How the running sums are noised (budget.py): binary trees with Honaker's estimator, the
    column-normalised BLT square-root factorization (factorization.py), or the one of smaller
    worst-step error for the window's number of micro-batches (public: the choice depends on T
    alone)."""
    TREE = "tree"
    FACTORIZATION = "factorization"
    AUTO = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamQuery:
    """One continual GROUP BY over one window. ``value_column`` None is COUNT(*) (then
    ``value_bound`` must be 1: the value of every record is 1)."""
    key_column: str
    unit_column: str
    time_column: str
    value_column: Optional[str] = None
    value_bound: float = 1.0
    contribution_limit: int = 32
    micro_batches: int = 100
    epsilon: float
    delta: float
    mechanism: str = StreamMechanism.AUTO

    @property
    def statistic(self) -> StreamStatistic:
        return StreamStatistic.COUNT if self.value_column is None else StreamStatistic.SUM

    def check(self, columns: Optional[Iterable[str]] = None) -> None:
        """Raise QueryError naming the first problem; with ``columns`` (the input's column
        names) also refuse a column the input does not have. Nothing is read or charged."""
        named = {"key_column": self.key_column, "unit_column": self.unit_column,
                 "time_column": self.time_column}
        if self.value_column is not None:
            named["value_column"] = self.value_column
        for option, column in named.items():
            if not isinstance(column, str) or not column:
                raise QueryError(f"{option} must name a column, got {column!r}")
        if len(set(named.values())) != len(named):
            raise QueryError(f"the key, unit, time and value columns must differ, got {named}")
        bound = self.value_bound
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not (
                math.isfinite(bound) and bound > 0):
            raise QueryError(f"value_bound must be a positive finite number, got {bound!r}")
        if self.value_column is None and bound != 1:
            raise QueryError(f"COUNT(*) (no value_column) counts each record as 1: value_bound "
                             f"must be 1, got {bound!r}")
        for option, limit in (("contribution_limit", None), ("micro_batches",
                                                             MAX_MICRO_BATCHES)):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (
                    limit is not None and value > limit):
                raise QueryError(f"{option} must be an integer in [1, {limit or 'inf'}], got "
                                 f"{value!r}")
        epsilon, delta = self.epsilon, self.delta
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not (
                math.isfinite(epsilon) and epsilon > 0):
            raise QueryError(f"epsilon must be a positive finite number, got {epsilon!r}")
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
            raise QueryError(f"delta must be in (0, 1) (key selection and the Gaussian trees "
                             f"spend some), got {delta!r}")
        if self.mechanism not in StreamMechanism.values():
            raise QueryError(f"mechanism must be one of {StreamMechanism.values()}, got "
                             f"{self.mechanism!r}")
        if columns is not None:
            have = set(columns)
            missing = [column for column in named.values() if column not in have]
            if missing:
                raise QueryError(f"unknown column(s) {missing}; the input has {sorted(have)}")

    def guarantee(self, blocks: Iterable[str], grant_id: Optional[str],
                  mechanism: Optional[str] = None, for_tests: bool = False) -> Guarantee:
        """What every release of the window states: all records of one unit within the
        window's blocks (a unit's records in other blocks are paid for by those blocks), and
        which mechanism ran (StreamBudget.statement) when the caller knows the budget;
        `for_tests`: the grant's ledger was created for tests (Guarantee says what that means)."""
        return Guarantee(self.epsilon, self.delta, GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ,
                         self.unit_column, grant_id, tuple(str(block) for block in blocks),
                         mechanism, for_tests=for_tests)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, fields: dict) -> "StreamQuery":
        return cls(**fields)
