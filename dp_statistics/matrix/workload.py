"""Workloads of linear counting queries over a declared domain (pure numpy).

The data vector ``x`` has one cell per element of the domain ``size_1 x ... x size_k`` (row-major,
the last attribute fastest); a linear query is a row ``w`` and its answer ``w . x``. A workload
``W`` (m x n) is a union of TERMS, each the Kronecker product of one query BLOCK per attribute
(or one block over all n cells, for workloads with no product structure):

    W = [ W_1 ; W_2 ; ... ],   W_t = B_t1 (x) B_t2 (x) ... (x) B_tk.

Blocks are the 1D building blocks (identity: every cell; total: the sum; all ranges; prefixes,
the CDF; explicit rows), optionally with their cells permuted. Everything the matrix mechanism's
error needs is the Gram matrix and the number of queries:

    W^T W = sum_t (B_t1^T B_t1) (x) ... (x) (B_tk^T B_tk),    m = sum_t prod_i m(B_ti),

and for a Kronecker strategy both stay factored, so a 10^6-cell domain never forms an n x n
matrix. Closed forms of the block Grams (0-based cells i, j of a size-d attribute):
identity I; total 1 1^T; all ranges (min(i, j) + 1)(d - max(i, j)) (the ranges [a, b] with
a <= min, b >= max); prefixes d - max(i, j) (the prefixes [0, b] with b >= max).

A Workload is a frozen, hashable spec (its fingerprint is a SHA-256 of its canonical bytes): the
strategy cache (strategy.eigen_design) is keyed by it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
from typing import Optional, Sequence

import numpy as np

from sage_tfx.choices import Choice


class BlockKind(Choice):
    IDENTITY = "identity"
    TOTAL = "total"
    ALL_RANGES = "all_ranges"
    PREFIX = "prefix"
    EXPLICIT = "explicit"


class DomainError(ValueError):
    """A query, data vector or record outside the workload's declared domain."""


def _frozen_array(values, dtype=np.float64) -> np.ndarray:
    array = np.array(values, dtype=dtype)
    array.setflags(write=False)
    return array


@dataclasses.dataclass(frozen=True, eq=False)
class Block:
    """One attribute's queries: ``kind`` over ``size`` cells; ``rows`` (m x size) for EXPLICIT;
    ``permutation``: query cell j of the base block reads cell permutation[j] of the data."""
    kind: BlockKind
    size: int
    rows: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)
    permutation: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if not (isinstance(self.size, (int, np.integer)) and self.size >= 1):
            raise DomainError(f"a block needs a positive integer size, got {self.size!r}")
        object.__setattr__(self, "size", int(self.size))
        if (self.kind is BlockKind.EXPLICIT) != (self.rows is not None):
            raise ValueError("rows are given exactly for EXPLICIT blocks")
        if self.rows is not None:
            rows = _frozen_array(self.rows)
            if rows.ndim != 2 or rows.shape[1] != self.size or rows.shape[0] == 0:
                raise DomainError(f"explicit queries must be a non-empty matrix with one column "
                                  f"per cell ({self.size}); got shape {rows.shape}")
            if not np.all(np.isfinite(rows)):
                raise ValueError("explicit query weights must be finite")
            object.__setattr__(self, "rows", rows)
        if self.permutation is not None:
            permutation = _frozen_array(self.permutation, np.int64)
            if sorted(permutation.tolist()) != list(range(self.size)):
                raise DomainError(f"a permutation of the {self.size} cells is required")
            object.__setattr__(self, "permutation", permutation)

    @functools.cached_property
    def fingerprint(self) -> bytes:
        digest = hashlib.sha256(f"{self.kind.value}:{self.size}".encode())
        for part in (self.rows, self.permutation):
            digest.update(b"|" if part is None else part.tobytes() + str(part.shape).encode())
        return digest.digest()

    def __eq__(self, other):
        return isinstance(other, Block) and self.fingerprint == other.fingerprint

    def __hash__(self):
        return hash(self.fingerprint)

    @property
    def query_count(self) -> int:
        return {BlockKind.IDENTITY: self.size, BlockKind.TOTAL: 1,
                BlockKind.ALL_RANGES: self.size * (self.size + 1) // 2,
                BlockKind.PREFIX: self.size,
                BlockKind.EXPLICIT: 0 if self.rows is None else self.rows.shape[0]}[self.kind]

    def _ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """(first, last) cell of each query of a range-like block, in query order."""
        if self.kind is BlockKind.ALL_RANGES:
            return np.triu_indices(self.size)
        return np.zeros(self.size, dtype=np.int64), np.arange(self.size)

    def _inverse_permutation(self) -> np.ndarray:
        return np.argsort(self.permutation)

    def gram(self) -> np.ndarray:
        """B^T B (size x size), by the closed forms of the module docstring."""
        d = self.size
        cells = np.arange(d)
        low, high = np.minimum.outer(cells, cells), np.maximum.outer(cells, cells)
        gram = {BlockKind.IDENTITY: lambda: np.eye(d), BlockKind.TOTAL: lambda: np.ones((d, d)),
                BlockKind.ALL_RANGES: lambda: (low + 1.0) * (d - high),
                BlockKind.PREFIX: lambda: (d - high).astype(np.float64),
                BlockKind.EXPLICIT: lambda: self.rows.T @ self.rows}[self.kind]()
        if self.permutation is not None:
            inverse = self._inverse_permutation()
            gram = gram[np.ix_(inverse, inverse)]
        return gram

    def dense(self) -> np.ndarray:
        """B itself (query_count x size); for small blocks (ranges grow as size^2)."""
        d = self.size
        if self.kind is BlockKind.EXPLICIT:
            base = np.array(self.rows)
        elif self.kind is BlockKind.IDENTITY:
            base = np.eye(d)
        elif self.kind is BlockKind.TOTAL:
            base = np.ones((1, d))
        else:
            first, last = self._ranges()
            cells = np.arange(d)
            base = ((cells >= first[:, None]) & (cells <= last[:, None])).astype(np.float64)
        if self.permutation is not None:
            permuted = np.empty_like(base)
            permuted[:, self.permutation] = base
            return permuted
        return base

    def apply(self, values: np.ndarray, axis: int) -> np.ndarray:
        """B applied along ``axis`` of ``values`` (ranges by prefix sums: O(m), not O(m d))."""
        values = np.moveaxis(np.asarray(values, dtype=np.float64), axis, 0)
        if self.permutation is not None:
            values = values[self.permutation]
        if self.kind is BlockKind.IDENTITY:
            out = values
        elif self.kind is BlockKind.TOTAL:
            out = values.sum(axis=0, keepdims=True)
        elif self.kind is BlockKind.EXPLICIT:
            out = np.tensordot(self.rows, values, axes=(1, 0))
        else:
            first, last = self._ranges()
            prefix = np.concatenate([np.zeros((1,) + values.shape[1:]), np.cumsum(values, 0)])
            out = prefix[last + 1] - prefix[first]
        return np.moveaxis(out, 0, axis)

    def quadratic_forms(self, matrix: np.ndarray) -> np.ndarray:
        """diag(B M B^T): each query's b^T M b, in query order (ranges by a 2D prefix sum)."""
        matrix = np.asarray(matrix, dtype=np.float64)
        if self.permutation is not None:
            matrix = matrix[np.ix_(self.permutation, self.permutation)]
        if self.kind is BlockKind.IDENTITY:
            return np.diag(matrix).copy()
        if self.kind is BlockKind.TOTAL:
            return np.array([matrix.sum()])
        if self.kind is BlockKind.EXPLICIT:
            return np.einsum("ij,jk,ik->i", self.rows, matrix, self.rows)
        first, last = self._ranges()
        table = np.zeros((self.size + 1, self.size + 1))
        table[1:, 1:] = matrix.cumsum(0).cumsum(1)
        return (table[last + 1, last + 1] - table[first, last + 1] - table[last + 1, first]
                + table[first, first])

    def labels(self, attribute: str) -> list[str]:
        """Readable names of the queries (cells as base-block positions)."""
        if self.kind is BlockKind.IDENTITY:
            names = [f"{attribute}={i}" for i in range(self.size)]
        elif self.kind is BlockKind.TOTAL:
            names = [f"{attribute}=*"]
        elif self.kind is BlockKind.EXPLICIT:
            names = [f"{attribute}:q{i}" for i in range(self.rows.shape[0])]
        else:
            first, last = self._ranges()
            names = [f"{attribute} in [{a},{b}]" for a, b in zip(first, last)]
        return names if self.permutation is None else [f"{n} (permuted)" for n in names]


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
    """A union of Kronecker-product terms over the domain ``sizes`` of ``attributes``.

    Each term is a tuple of one Block per attribute (sizes matching), or a single Block over
    all ``prod(sizes)`` cells (a flat term)."""
    attributes: tuple[str, ...]
    sizes: tuple[int, ...]
    terms: tuple[tuple[Block, ...], ...]

    def __post_init__(self):
        object.__setattr__(self, "attributes", tuple(self.attributes))
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        object.__setattr__(self, "terms", tuple(tuple(t) for t in self.terms))
        if len(self.attributes) != len(self.sizes) or not self.sizes:
            raise DomainError("a domain needs one size per attribute")
        if len(set(self.attributes)) != len(self.attributes):
            raise DomainError(f"attribute names repeat: {self.attributes}")
        if any(size < 1 for size in self.sizes):
            raise DomainError(f"attribute sizes must be positive, got {self.sizes}")
        if not self.terms:
            raise ValueError("a workload needs at least one query")
        for term in self.terms:
            shape = tuple(block.size for block in term)
            if shape != self.sizes and shape != (self.cells,):
                raise DomainError(f"a term over cells {shape} is outside the declared domain "
                                  f"{dict(zip(self.attributes, self.sizes))} ({self.cells} "
                                  f"cells)")

    @property
    def cells(self) -> int:
        return int(np.prod(self.sizes))

    @functools.cached_property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(repr((self.attributes, self.sizes)).encode())
        for term in self.terms:
            digest.update(b"term")
            for block in term:
                digest.update(block.fingerprint)
        return digest.hexdigest()

    def __eq__(self, other):
        return isinstance(other, Workload) and self.fingerprint == other.fingerprint

    def __hash__(self):
        return hash(self.fingerprint)

    def is_product(self) -> bool:
        """True when every term has one block per attribute (Kronecker strategies apply)."""
        return len(self.sizes) > 1 and all(len(t) == len(self.sizes) for t in self.terms)

    def term_query_counts(self) -> list[int]:
        return [int(np.prod([b.query_count for b in term])) for term in self.terms]

    @property
    def query_count(self) -> int:
        return sum(self.term_query_counts())

    def gram(self) -> np.ndarray:
        """W^T W (n x n, dense): for workloads up to a few thousand cells."""
        gram = np.zeros((self.cells, self.cells))
        for term in self.terms:
            gram += functools.reduce(np.kron, [block.gram() for block in term])
        return gram

    def dense(self) -> np.ndarray:
        """W (m x n, dense): for small workloads (tests, explicit use)."""
        return np.vstack([functools.reduce(np.kron, [b.dense() for b in term])
                          for term in self.terms])

    def answer(self, data_vector) -> np.ndarray:
        """W x for a data vector over the domain (flat, row-major), in query order."""
        vector = np.asarray(data_vector, dtype=np.float64)
        if vector.shape != (self.cells,):
            raise DomainError(f"the data vector has shape {vector.shape}; the declared domain "
                              f"{dict(zip(self.attributes, self.sizes))} has {self.cells} cells")
        answers = []
        for term in self.terms:
            values = vector.reshape(self.sizes if len(term) == len(self.sizes) else (-1,))
            for axis, block in enumerate(term):
                values = block.apply(values, axis)
            answers.append(values.reshape(-1))
        return np.concatenate(answers)

    def labels(self) -> list[str]:
        """One readable name per query, in query order."""
        names = []
        for term in self.terms:
            attributes = (self.attributes if len(term) == len(self.attributes)
                          else ("cells",))
            per_block = [b.labels(a) for a, b in zip(attributes, term)]
            names += [" & ".join(p for p in parts if not p.endswith("=*")) or "total"
                      for parts in itertools.product(*per_block)]
        return names


# --- constructors ---

def _one_attribute(size: int, block: Block, name: str = "x") -> Workload:
    return Workload((name,), (size,), ((block,),))


def all_ranges(size: int) -> Workload:
    """All size (size + 1) / 2 intervals [a, b] of an ordered attribute."""
    return _one_attribute(size, Block(BlockKind.ALL_RANGES, size))


def permuted_ranges(size: int, rng: np.random.Generator) -> Workload:
    """All ranges with the cells in a random order (paper §5.1: semantically equivalent to
    all_ranges, but locality-based strategies no longer see the order)."""
    return _one_attribute(size, Block(BlockKind.ALL_RANGES, size,
                                      permutation=rng.permutation(size)))


def cdf(size: int) -> Workload:
    """The prefixes [0, b], b = 0..size-1 (the empirical CDF)."""
    return _one_attribute(size, Block(BlockKind.PREFIX, size))


def explicit(matrix, attributes: Sequence[str] = ("x",),
             sizes: Optional[Sequence[int]] = None) -> Workload:
    """Any query matrix (m x n) over a domain (default: one attribute of n cells)."""
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2:
        raise ValueError(f"a query matrix must be 2D, got shape {matrix.shape}")
    sizes = (matrix.shape[1],) if sizes is None else tuple(sizes)
    cells = int(np.prod(sizes))
    if matrix.shape[1] != cells:
        raise DomainError(f"the query matrix has {matrix.shape[1]} columns; the declared "
                          f"domain {dict(zip(attributes, sizes))} has {cells} cells")
    return Workload(tuple(attributes), sizes, ((Block(BlockKind.EXPLICIT, cells, matrix),),))


def random_ranges(size: int, count: int, rng: np.random.Generator) -> Workload:
    """``count`` ranges drawn by Xiao et al.'s two-step sampling: a length uniform in
    [1, size], then a start uniform among the positions where it fits."""
    lengths = rng.integers(1, size + 1, count)
    starts = rng.integers(0, size - lengths + 1)
    cells = np.arange(size)
    rows = (cells >= starts[:, None]) & (cells < (starts + lengths)[:, None])
    return explicit(rows.astype(np.float64))


def width_ranges(size: int, width: int) -> Workload:
    """The size - width + 1 ranges of exactly ``width`` consecutive cells (a sliding window;
    HDMM's "width32" benchmark workload with width 32)."""
    if not 1 <= width <= size:
        raise DomainError(f"a range width must lie in [1, {size}], got {width}")
    starts = np.arange(size - width + 1)[:, None]
    cells = np.arange(size)
    return explicit(((cells >= starts) & (cells < starts + width)).astype(np.float64))


def predicates(size: int, count: int, rng: np.random.Generator) -> Workload:
    """``count`` predicate queries sampled uniformly: each cell in or out with probability 1/2."""
    return explicit(rng.integers(0, 2, (count, size)).astype(np.float64))


def ranges_2d(rows: int, columns: int) -> Workload:
    """All axis-aligned rectangles of a rows x columns grid: AllRanges (x) AllRanges."""
    return Workload(("row", "column"), (rows, columns),
                    ((Block(BlockKind.ALL_RANGES, rows), Block(BlockKind.ALL_RANGES, columns)),))


def _marginal_terms(sizes: Sequence[int], way: int, kind: BlockKind) -> tuple:
    if not 0 <= way <= len(sizes):
        raise DomainError(f"{way}-way marginals need {way} of the {len(sizes)} attributes")
    return tuple(tuple(Block(kind if i in chosen else BlockKind.TOTAL, size)
                       for i, size in enumerate(sizes))
                 for chosen in itertools.combinations(range(len(sizes)), way))


def marginals(attributes: Sequence[str], sizes: Sequence[int], ways: Sequence[int]) -> Workload:
    """Every k-way marginal for k in ``ways``: for each k attributes, one count per combination
    of their values (Identity on them, Total on the others)."""
    terms = sum((_marginal_terms(sizes, k, BlockKind.IDENTITY) for k in ways), ())
    return Workload(tuple(attributes), tuple(sizes), terms)


def range_marginals(attributes: Sequence[str], sizes: Sequence[int],
                    ways: Sequence[int]) -> Workload:
    """Every k-way range marginal (paper §2.1): for each k attributes, every product of ranges
    on them, summed over the others (AllRanges on them, Total elsewhere)."""
    terms = sum((_marginal_terms(sizes, k, BlockKind.ALL_RANGES) for k in ways), ())
    return Workload(tuple(attributes), tuple(sizes), terms)


def union(*workloads: Workload) -> Workload:
    """The queries of several workloads over the same domain, in order."""
    first = workloads[0]
    for other in workloads[1:]:
        if (other.attributes, other.sizes) != (first.attributes, first.sizes):
            raise DomainError(f"cannot join workloads over different domains: "
                              f"{first.sizes} and {other.sizes}")
    return Workload(first.attributes, first.sizes, sum((w.terms for w in workloads), ()))
