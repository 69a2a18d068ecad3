"""A workload spec in JSON (what the MatrixMechanism component and `sage-tfx workload-answer`
take) and the histogram of records over its declared domain.

    {"attributes": [
        {"name": "duration", "feature": "trip_seconds", "bins": [0, 300, 600, 1200, 3600]},
        {"name": "hour", "feature": "trip_start_hour", "size": 24},
        {"name": "payment", "feature": "payment_type", "categories": ["Cash", "Credit Card"]}],
     "queries": [{"kind": "all_ranges", "attributes": ["duration"]},
                 {"kind": "marginals", "attributes": ["hour", "payment"], "way": 2}]}

An attribute's domain is ``size`` integer codes 0..size-1, or the ``bins`` [b_i, b_i+1) of a
number (len(bins) - 1 cells), or a list of ``categories``. Query kinds (QueryKind): all_ranges
and prefix (the CDF) over one ordered attribute; identity (every cell of the listed attributes);
marginals and range_marginals of ``way`` of the listed attributes. Attributes a query does not
list are summed over (Total). Everything in the spec is public and checked before any grant is
used; a query naming an attribute outside the declared domain is refused.

The record rule (components/record_rule.py) for the histogram: a record whose value of an
attribute is missing, not a number, or outside the declared domain counts in that attribute's
public ``default`` cell (code 0 unless the spec names another). The map acts on each record
alone and every record lands in exactly one cell, so neighbouring datasets give histograms that
differ by one record in one cell: the matrix mechanism's sensitivity (its columns) holds, and
what runs (the cells, the strategy, the noise) does not depend on the data.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from sage_tfx.choices import Choice
from sage_tfx.dp_statistics.matrix.workload import Block, BlockKind, DomainError, Workload


class QueryKind(Choice):
    ALL_RANGES = "all_ranges"
    PREFIX = "prefix"
    IDENTITY = "identity"
    MARGINALS = "marginals"
    RANGE_MARGINALS = "range_marginals"


@dataclasses.dataclass(frozen=True)
class Attribute:
    name: str
    feature: str
    size: int
    bins: Optional[tuple[float, ...]] = None
    categories: Optional[tuple[str, ...]] = None
    default: int = 0

    def codes(self, values: Sequence[Any]) -> np.ndarray:
        """Each value's cell; missing, non-numeric and out-of-domain values -> ``default``."""
        if self.categories is not None:
            index = {category: i for i, category in enumerate(self.categories)}
            return np.array([index.get(_text(v), self.default) for v in values], np.int64)
        numbers = np.array([_number(v) for v in values], dtype=np.float64)
        if self.bins is not None:
            codes = np.searchsorted(self.bins, numbers, side="right") - 1
            inside = (numbers >= self.bins[0]) & (numbers < self.bins[-1])
        else:
            # Decided on the floats, then cast only in-domain values: casting inf or a huge
            # value would print a RuntimeWarning, a log line that depends on one record.
            inside = (np.isfinite(numbers) & (numbers == np.floor(numbers)) & (numbers >= 0)
                      & (numbers < self.size))
            return np.where(inside, numbers, self.default).astype(np.int64)
        return np.where(inside & np.isfinite(numbers), codes, self.default).astype(np.int64)


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _number(value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    attributes: tuple[Attribute, ...]
    workload: Workload

    @property
    def features(self) -> list[str]:
        return [a.feature for a in self.attributes]

    def histogram(self, columns: Mapping[str, Sequence[Any]]) -> np.ndarray:
        """The data vector: one count per cell of the declared domain, each record once
        (``columns`` maps each attribute's feature to one value per record)."""
        lengths = {len(columns[a.feature]) for a in self.attributes}
        if len(lengths) != 1:
            raise ValueError(f"feature columns of different lengths: {sorted(lengths)}")
        codes = [a.codes(columns[a.feature]) for a in self.attributes]
        flat = np.ravel_multi_index(codes, self.workload.sizes)
        return np.bincount(flat, minlength=self.workload.cells).astype(np.int64)


def _attribute(raw: Mapping[str, Any]) -> Attribute:
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise DomainError(f"every attribute needs a name, got {raw!r}")
    given = [key for key in ("size", "bins", "categories") if key in raw]
    if len(given) != 1:
        raise DomainError(f"attribute {name!r}: give exactly one of size, bins, categories")
    bins = categories = None
    if "size" in raw:
        size = raw["size"]
        if not (isinstance(size, int) and size >= 1):
            raise DomainError(f"attribute {name!r}: size must be a positive integer")
    elif "bins" in raw:
        bins = tuple(float(b) for b in raw["bins"])
        if len(bins) < 2 or any(b >= c for b, c in zip(bins, bins[1:])) or not all(
                math.isfinite(b) for b in bins):
            raise DomainError(f"attribute {name!r}: bins must be >= 2 increasing finite edges")
        size = len(bins) - 1
    else:
        categories = tuple(str(c) for c in raw["categories"])
        if not categories or len(set(categories)) != len(categories):
            raise DomainError(f"attribute {name!r}: categories must be distinct and non-empty")
        size = len(categories)
    default = raw.get("default", 0)
    if not (isinstance(default, int) and 0 <= default < size):
        raise DomainError(f"attribute {name!r}: default must be a cell code in [0, {size})")
    return Attribute(name, str(raw.get("feature", name)), size, bins, categories, default)


def _terms(query: Mapping[str, Any], names: list[str], sizes: list[int]) -> list[tuple]:
    try:
        kind = QueryKind.parse(query.get("kind"), "query kind")
    except ValueError as error:
        raise DomainError(str(error)) from None
    listed = query.get("attributes", names)
    unknown = [a for a in listed if a not in names]
    if unknown or not listed:
        raise DomainError(f"query {query!r} names attributes outside the declared domain "
                          f"{names}: {unknown}")
    positions = [names.index(a) for a in listed]
    if kind in (QueryKind.ALL_RANGES, QueryKind.PREFIX, QueryKind.IDENTITY):
        if kind is not QueryKind.IDENTITY and len(positions) != 1:
            raise DomainError(f"{kind.value} queries range over one ordered attribute")
        chosen_sets = [positions]
        block_kind = {QueryKind.ALL_RANGES: BlockKind.ALL_RANGES,
                      QueryKind.PREFIX: BlockKind.PREFIX,
                      QueryKind.IDENTITY: BlockKind.IDENTITY}[kind]
    else:
        way = query.get("way")
        if not (isinstance(way, int) and 1 <= way <= len(positions)):
            raise DomainError(f"{kind.value}: way must be an integer in [1, {len(positions)}]")
        chosen_sets = list(itertools.combinations(positions, way))
        block_kind = (BlockKind.IDENTITY if kind is QueryKind.MARGINALS
                      else BlockKind.ALL_RANGES)
    return [tuple(Block(block_kind if i in chosen else BlockKind.TOTAL, size)
                  for i, size in enumerate(sizes)) for chosen in chosen_sets]


def parse_spec(raw) -> WorkloadSpec:
    """A WorkloadSpec from the JSON text or the decoded object (refuses what it cannot use)."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as error:
            raise DomainError(f"the workload spec is not JSON: {error}") from None
    if not isinstance(raw, Mapping) or not raw.get("attributes") or not raw.get("queries"):
        raise DomainError("a workload spec needs non-empty 'attributes' and 'queries'")
    attributes = tuple(_attribute(a) for a in raw["attributes"])
    names, sizes = [a.name for a in attributes], [a.size for a in attributes]
    terms = [term for query in raw["queries"] for term in _terms(query, names, sizes)]
    return WorkloadSpec(attributes, Workload(tuple(names), tuple(sizes), tuple(terms)))
