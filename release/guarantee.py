"""The one statement of what a release guarantees, rendered the same everywhere: the CLI's
output, the files' metadata (CSV sidecar JSON, Parquet schema metadata), ML Metadata and the
ledger's web page all show `Guarantee.sentence()` or `Guarantee.to_json()`.

A guarantee is (epsilon, delta)-DP for adding or removing one *unit* (Sage's add-or-remove-one
relation, the ledger's): one record of the granted blocks (the ledger's default unit), all rows
of one privacy unit within the blocks read (a table cut by time: a unit's rows in other blocks
are covered by those blocks' budgets), or all rows of one unit overall (a table whose blocks are
cut by a keyed hash of the unit, so each unit lies in one block).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from sage_tfx.choices import Choice


class GuaranteeUnit(Choice):
    """What one neighbouring step adds or removes."""
    RECORD = "record"
    UNIT_WITHIN_BLOCKS_READ = "unit_within_blocks_read"
    UNIT = "unit"

    def describe(self, unit_column: Optional[str] = None) -> str:
        """The neighbouring relation in words (`unit_column` names the unit's ids)."""
        if self is GuaranteeUnit.RECORD:
            return "one record of the granted blocks"
        if not unit_column:
            raise ValueError(f"a {self.value} guarantee names its unit column")
        if self is GuaranteeUnit.UNIT:
            return f"all rows of one {unit_column}"
        return f"all rows of one {unit_column} within the blocks read"


@dataclasses.dataclass(frozen=True)
class Guarantee:
    """(epsilon, delta)-DP for adding or removing `unit` (of `unit_column`), paid by grant
    `grant_id` on `blocks`; `mechanism` says how, when the front door states it (e.g. the matrix
    mechanism's sensitivity). `other_units` ((unit, unit column) pairs): a release over blocks
    of several kinds (tables of other unit columns, Examples) is DP for adding or removing any
    one of these too, each one moving the output as much as `unit` does. `for_tests`: the
    grant's ledger was created for tests, where a fixed seed may have drawn the noise: the
    sentence says the guarantee then does not hold."""
    epsilon: float
    delta: float
    unit: GuaranteeUnit
    unit_column: Optional[str]
    grant_id: Optional[str]
    blocks: tuple[str, ...]
    mechanism: Optional[str] = None
    other_units: tuple[tuple[GuaranteeUnit, Optional[str]], ...] = ()
    for_tests: bool = False

    def __post_init__(self):
        object.__setattr__(self, "unit", GuaranteeUnit(self.unit))
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "other_units", tuple(
            (GuaranteeUnit(unit), column) for unit, column in self.other_units))
        for unit, column in ((self.unit, self.unit_column), *self.other_units):
            unit.describe(column)  # refuses a unit without its column

    @property
    def neighbours(self) -> str:
        """What one neighbouring step adds or removes, in words."""
        return " or ".join(unit.describe(column) for unit, column in
                           ((self.unit, self.unit_column), *self.other_units))

    def sentence(self) -> str:
        """The guarantee in one line, e.g. "(1, 1e-06)-DP for adding or removing all rows of
        one uid within the blocks read; grant 3f2a... on blocks b1, b2"."""
        how = f" ({self.mechanism})" if self.mechanism else ""
        blocks = (f"blocks {', '.join(self.blocks)}" if len(self.blocks) <= 4 else
                  f"{len(self.blocks)} blocks {self.blocks[0]} .. {self.blocks[-1]}")
        paid = (f"; grant {self.grant_id} on {blocks}" if self.grant_id
                else "; no grant (a run outside the ledger)")
        tests = ("; ledger created for tests: a fixed seed may have drawn the noise, and then "
                 "this guarantee does not hold" if self.for_tests else "")
        return (f"({_at_least(self.epsilon)}, {_at_least(self.delta)})-DP for adding or removing "
                f"{self.neighbours}{how}{paid}{tests}")

    def to_json(self) -> dict:
        return {"epsilon": self.epsilon, "delta": self.delta, "unit": self.unit.value,
                "unit_column": self.unit_column, "neighbours": self.neighbours,
                "grant_id": self.grant_id, "blocks": list(self.blocks),
                "mechanism": self.mechanism,
                "other_units": [[unit.value, column] for unit, column in self.other_units],
                "ledger_for_tests": self.for_tests, "guarantee": self.sentence()}

    @classmethod
    def from_json(cls, values: dict) -> "Guarantee":
        return cls(values["epsilon"], values["delta"], values["unit"], values["unit_column"],
                   values["grant_id"], tuple(values["blocks"]), values.get("mechanism"),
                   tuple(tuple(pair) for pair in values.get("other_units", ())),
                   bool(values.get("ledger_for_tests", False)))


def _at_least(value: float) -> str:
    """`value` in at most 6 significant digits, rounded up: a stated epsilon or delta is never
    smaller than the one charged (1/3 reads 0.333334, not 0.333333)."""
    text = f"{value:.6g}"
    if float(text) >= value:
        return text
    exponent = math.floor(math.log10(abs(value))) - 5
    return f"{math.ceil(value / 10 ** exponent) * 10 ** exponent:.6g}"


def weakest_unit(units: Sequence[GuaranteeUnit]) -> GuaranteeUnit:
    """The unit a release over several tables can promise: the unit overall only if every
    table promises it (a unit split across time blocks is covered within the blocks read)."""
    units = [GuaranteeUnit(unit) for unit in units]
    if units and all(unit is GuaranteeUnit.UNIT for unit in units):
        return GuaranteeUnit.UNIT
    return GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ
