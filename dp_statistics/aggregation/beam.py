"""The Beam engine: the same steps as local.py, by its vectorised kernels, for data that does not
fit one machine (DirectRunner in tests; Flink/Dataflow in production).

Input: a PCollection of rows as dicts (column -> value), or (``batched``) of batches of rows,
each a pandas frame, an Arrow record batch or a list of dicts (what ``aggregate_with_beam``
hands over). Output of :class:`AggregateTransform`: a PCollection holding one ``Release``.
Records move in batches (issue 47): each batch becomes arrays (`_Prepare`: each identity column
as the classes rows are grouped by, `_Classes`; the value columns as doubles) and is split by
a hash of the unit's class into ``buckets`` buckets; one shuffle by bucket (GroupByKey) gives
each bucket all the rows of its units, where the local engine's kernels run steps 1-2
(``local.keep_pairs``: each pair's rows in a random order, at most C_u pairs per unit) and step
3 (``local.contributions``), summed per partition within the bucket; a second shuffle by a hash
of the partition's class sums each partition over the buckets of units. The partitions' sums
(one element per bucket of partitions, never the rows) then meet in one element, where
``local.release_accumulated`` adds the noise and selects partitions (step 4). DP bounds
(§4.2.5): each bucket's kept values are counted into the log histogram
(``local.bounds_histogram``), the histograms summed globally and turned into bounds by
``aggregators.infer_bounds`` (noise from sage_tfx.mechanisms), a side input of step 3.
Sampling uses ``sage_tfx.randomness.secret_rng`` per DoFn instance (a seeded test run: one
generator per key, `_keyed_pairs`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import numbers
import pickle
from typing import Optional

import apache_beam as beam
import numpy as np
import pandas as pd
import pyarrow as pa
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.windowed_value import WindowedValue

from sage_tfx.dp_statistics.aggregation import aggregators, local
from sage_tfx.dp_statistics.aggregation.budget import (BOUNDS_STEP_PREFIX, BudgetPlan,
                                                       bounds_inferred_by_step)
from sage_tfx.dp_statistics.aggregation.local import (Accumulated, check_plan,
                                                      presence_columns, release_accumulated,
                                                      value_columns)
from sage_tfx.dp_statistics.aggregation.spec import (AggregationQuery, GuaranteeUnit,
                                                     SelectionRule)
from sage_tfx.dp_statistics.identifiers import representable_ids
from sage_tfx.randomness import secret_rng


def _number_or_nan(value) -> float:
    """A value that is not a number is NULL (NaN, skipped by the aggregates): refusing the query
    because of one row would reveal that the row is there (local.numeric_column)."""
    try:
        return float(value) if value is not None else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def _equality_class(value):
    """A hashable encoding of ``value`` that two values share exactly when they are equal as
    the local engine groups them (pd.factorize: by ==): 0.0 and -0.0, 1, 1.0 and True, and all
    nulls (None, NaN, pd.NA) are one class each. Beam groups by a key's *encoding*, where these
    differ, so every key is mapped to its class before any grouping."""
    if isinstance(value, (str, bytes)):
        return value
    null = pd.isna(value)
    if isinstance(null, (bool, np.bool_)) and null:
        return None
    if isinstance(value, (bool, np.bool_, numbers.Integral)):
        return ("number", int(value))
    if isinstance(value, (float, np.floating)):
        number = float(value)  # exact: a double holds any float32/float64
        return ("number", int(number) if number.is_integer() else number)
    return ("value", value)


def _representative(value):
    """The value a partition's key shows for ``value``'s class, before `_Classes.widest`: no -0.0, one
    null."""
    if _equality_class(value) is None:
        return None
    return value + 0.0 if isinstance(value, (float, np.floating)) else value


def _type_rank(value) -> int:
    if isinstance(value, (bool, np.bool_)):
        return 0
    return 1 if isinstance(value, numbers.Integral) else 2


# --- identity columns as arrays ----------------------------------------------------------------

def _object_array(values) -> np.ndarray:
    """A 1-d object array of ``values`` (tuples stay elements, not rows)."""
    values = list(values)
    return np.fromiter(values, dtype=object, count=len(values))


_SPLITMIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_NULL_HASH = 0x6A09E667F3BCC908


def _mixed(words: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser of uint64 words (integer arithmetic, wrapping: the same bits on
    every CPU and process, unlike Python's salted hash of a str)."""
    words = words.astype(np.uint64) + np.uint64(_SPLITMIX[0])
    words = (words ^ (words >> np.uint64(30))) * np.uint64(_SPLITMIX[1])
    words = (words ^ (words >> np.uint64(27))) * np.uint64(_SPLITMIX[2])
    return words ^ (words >> np.uint64(31))


def _hashes_of_classes(classes: np.ndarray) -> np.ndarray:
    """A hash of each class (_equality_class's values): ("number", v) with v in int64 as
    :meth:`_Classes.hashes` hashes integers, text as pandas' keyed hash (a fixed key), anything
    else by a digest of its repr."""
    out = np.full(len(classes), _NULL_HASH, dtype=np.uint64)
    numbers, texts = [], []
    for i, value in enumerate(classes):
        if value is None:
            continue
        if isinstance(value, str):
            texts.append(i)
        elif (isinstance(value, tuple) and value[0] == "number" and isinstance(value[1], int)
              and -2 ** 63 <= value[1] < 2 ** 63):
            numbers.append(i)
        else:
            out[i] = int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(),
                                    "little")
    if numbers:
        out[numbers] = _mixed(np.array([classes[i][1] for i in numbers], np.int64).view(np.uint64))
    if texts:
        out[texts] = pd.util.hash_array(classes[texts])
    return out


@dataclasses.dataclass(frozen=True)
class _Classes:
    """One identity column (a group-by column or the unit) of some rows as the classes Beam
    groups by (`_equality_class`), in arrays. A column of integers (or bools, or floats that are
    all integral): ``ints`` holds each class ("number", v)'s v, ``null`` where the value is null,
    ``rank`` each value's type rank (`_type_rank`: its key shows as a bool, int or float).
    Otherwise ``objects`` holds each row's class (None: null) and ``shown`` its
    `_representative`; ``strings`` when each is a str or None (its own class and
    representative: hashed and checked without a loop in Python)."""
    ints: Optional[np.ndarray] = None
    null: Optional[np.ndarray] = None
    rank: Optional[np.ndarray] = None
    objects: Optional[np.ndarray] = None
    shown: Optional[np.ndarray] = None
    strings: bool = False

    def __len__(self) -> int:
        return len(self.ints if self.ints is not None else self.objects)

    def take(self, index) -> "_Classes":
        if self.ints is not None:
            return _Classes(self.ints[index], self.null[index], self.rank[index])
        return _Classes(objects=self.objects[index], shown=self.shown[index],
                        strings=self.strings)

    @staticmethod
    def concat(pieces: list) -> "_Classes":
        if all(piece.ints is not None for piece in pieces):
            return _Classes(*(np.concatenate([getattr(piece, name) for piece in pieces])
                              for name in ("ints", "null", "rank")))
        pieces = [piece.as_objects() for piece in pieces]
        return _Classes(objects=np.concatenate([piece.objects for piece in pieces]),
                        shown=np.concatenate([piece.shown for piece in pieces]),
                        strings=all(piece.strings for piece in pieces))

    def class_values(self) -> list:
        """Each row's class, as `_equality_class` gives it."""
        if self.ints is None:
            return self.objects.tolist()
        return [None if null else ("number", value)
                for value, null in zip(self.ints.tolist(), self.null.tolist())]

    def shown_values(self) -> list:
        """Each row's key as released (`_representative`)."""
        if self.ints is None:
            return self.shown.tolist()
        cast = (bool, int, float)  # by type rank
        return [None if null else cast[rank](value) for value, null, rank in
                zip(self.ints.tolist(), self.null.tolist(), self.rank.tolist())]

    def as_objects(self) -> "_Classes":
        if self.ints is None:
            return self
        return _Classes(objects=_object_array(self.class_values()),
                        shown=_object_array(self.shown_values()))

    def is_null(self) -> np.ndarray:
        return self.null if self.ints is not None else pd.isna(self.objects)

    def representable(self) -> np.ndarray:
        """The rows whose text (if it is text) is representable (identifiers.py)."""
        if self.ints is not None:
            return np.ones(len(self), dtype=bool)
        if self.strings:
            return representable_ids(self.objects)
        return representable_ids([v if isinstance(v, str) else None for v in self.objects])

    def hashes(self) -> np.ndarray:
        if self.ints is None and not self.strings:
            return _hashes_of_classes(self.objects)
        hashes = (_mixed(self.ints.view(np.uint64)) if self.ints is not None
                  else pd.util.hash_array(self.objects))
        hashes[self.is_null()] = _NULL_HASH
        return hashes

    def factorize(self) -> tuple[np.ndarray, int]:
        """Codes 0..k-1 of the k classes (local.factorize: by value, nulls one class)."""
        if self.ints is None:
            return local.factorize(self.objects)
        if not self.null.any():
            return local.factorize(self.ints)
        codes = local.combined_codes([local.factorize(np.where(self.null, 0, self.ints)),
                                      (self.null.astype(np.int64), 2)])
        return codes, int(codes.max()) + 1

    def widest(self, codes: np.ndarray, count: int) -> "_Classes":
        """The ``count`` classes of ``codes`` (0..count-1), each showing its widest
        representative among these rows (in each column the widest type
        seen, bool < int < float: a class holding 1 and 1.0 shows 1.0; the same whatever the
        rows' order)."""
        first = local.first_occurrences(codes)
        if self.ints is not None:
            rank = np.zeros(count, dtype=np.int8)
            np.maximum.at(rank, codes, self.rank)
            return _Classes(self.ints[first], self.null[first], rank)
        if self.strings:
            return self.take(first)
        shown, best = [None] * count, [-1] * count
        for code, value in zip(codes.tolist(), self.shown.tolist()):
            if _type_rank(value) > best[code]:
                best[code], shown[code] = _type_rank(value), value
        return _Classes(objects=self.objects[first], shown=_object_array(shown))


def _float_classes(values: np.ndarray) -> _Classes:
    null = np.isnan(values)
    present = values[~null]
    if np.isfinite(present).all() and (np.floor(present) == present).all() and (
            np.abs(present) < 2.0 ** 63).all():
        return _Classes(np.where(null, 0.0, values).astype(np.int64), null,
                        np.full(len(values), 2, dtype=np.int8))
    return _generic_classes(_object_array(values.tolist()))


def _generic_classes(values: np.ndarray) -> _Classes:
    """Each value's class and representative, one by one."""
    return _Classes(objects=_object_array(map(_equality_class, values)),
                    shown=_object_array(map(_representative, values)))


def _integer_classes(values: np.ndarray, null: np.ndarray, rank: int) -> _Classes:
    return _Classes(values.astype(np.int64), null, np.full(len(values), rank, dtype=np.int8))


def _object_classes(values: np.ndarray) -> _Classes:
    """The classes of Python values: without a loop in Python when all of one type."""
    kind = pd.api.types.infer_dtype(values, skipna=True)
    null = pd.isna(values)
    if kind == "string":
        classes = values.copy()
        classes[null] = None
        return _Classes(objects=classes, shown=classes, strings=True)
    if kind in ("integer", "boolean"):
        ints = np.zeros(len(values), dtype=np.int64)
        try:
            ints[~null] = values[~null].astype(np.int64)
        except OverflowError:  # beyond int64: one class per Python int, below
            pass
        else:
            return _Classes(ints, null, np.full(len(values), int(kind == "integer"), np.int8))
    if kind == "floating":
        return _float_classes(np.where(null, np.nan, values).astype(np.float64))
    return _generic_classes(values)


def _as_numpy(column) -> np.ndarray:
    """A batch's column (pandas, Arrow or object array) as a numpy array of its values, numbers
    typed where they were (Python objects otherwise, as a dict row holds them)."""
    if isinstance(column, (pa.Array, pa.ChunkedArray)):
        kind = column.type
        if pa.types.is_floating(kind) or pa.types.is_integer(kind) or pa.types.is_boolean(kind):
            if column.null_count == 0 and kind != pa.uint64():
                return column.to_numpy(zero_copy_only=False)
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            return column.to_numpy(zero_copy_only=False)  # None where null
        return _object_array(column.to_pylist())
    if isinstance(column, pd.Series):
        native = isinstance(column.dtype, np.dtype) and column.dtype.kind in "biuf"
        return column.to_numpy() if native else column.to_numpy(dtype=object)
    return column


def _classes_of(column) -> _Classes:
    if isinstance(column, (pa.Array, pa.ChunkedArray)) and column.null_count and (
            pa.types.is_integer(column.type) or pa.types.is_boolean(column.type)) and (
            column.type != pa.uint64()):
        null = column.is_null().to_numpy(zero_copy_only=False)
        return _integer_classes(column.fill_null(0).cast(pa.int64()).to_numpy(
            zero_copy_only=False), null, int(pa.types.is_integer(column.type)))
    values = _as_numpy(column)
    none = np.zeros(len(values), dtype=bool)
    if values.dtype.kind == "b":
        return _integer_classes(values, none, 0)
    if values.dtype.kind == "i" or (values.dtype.kind == "u" and values.dtype.itemsize < 8):
        return _integer_classes(values, none, 1)
    if values.dtype.kind == "f":
        return _float_classes(values.astype(np.float64))
    return _object_classes(values if values.dtype == object else _object_array(values.tolist()))


def _value_column(column, presence: bool) -> np.ndarray:
    """A value column as doubles: `_number_or_nan` of each value, or (``presence``: read only
    by COUNT(col)) 1.0 where set and NaN where null, as for a dict row."""
    if isinstance(column, (pa.Array, pa.ChunkedArray)) and (
            pa.types.is_floating(column.type) or pa.types.is_integer(column.type)
            or pa.types.is_boolean(column.type)):
        column = column.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    values = _as_numpy(column)
    if values.dtype.kind in "biuf":
        numbers = values.astype(np.float64)  # float(v) of each: the same rounding
        return np.where(np.isnan(numbers), np.nan, 1.0) if presence else numbers
    if presence:
        return np.where(pd.isna(values), np.nan, 1.0)
    return np.fromiter(map(_number_or_nan, values), dtype=np.float64, count=len(values))


def _column(batch, name: str):
    """Column ``name`` of a batch (a pandas frame, an Arrow record batch or a list of dict
    rows); a column a batch lacks is null (a dict row without the key: row.get is None)."""
    if isinstance(batch, pd.DataFrame):
        return batch[name] if name in batch.columns else _object_array([None] * len(batch))
    if isinstance(batch, pa.RecordBatch):
        index = batch.schema.get_field_index(name)
        return batch.column(index) if index >= 0 else _object_array([None] * batch.num_rows)
    return _object_array(row.get(name) for row in batch)


def _python_values(column) -> list:
    """The column's values as a dict row holds them (to_dict / to_pylist)."""
    if isinstance(column, (pa.Array, pa.ChunkedArray)):
        return column.to_pylist()
    return column.tolist()


def _tuple_hashes(columns: list) -> np.ndarray:
    hashes = np.zeros(len(columns[0]), dtype=np.uint64)
    for column in columns:
        hashes = _mixed(hashes ^ column.hashes())
    return hashes


def _partition_codes(columns: list) -> tuple[np.ndarray, int]:
    codes = local.combined_codes([column.factorize() for column in columns])
    return codes, int(codes.max()) + 1 if codes.size else 0


def _by_bucket(hashes: np.ndarray, buckets: int):
    """(bucket, the indices of the rows in it) for each bucket that holds any."""
    bucket = (hashes % np.uint64(buckets)).astype(np.int64)
    order = np.argsort(bucket, kind="stable")
    counts = np.bincount(bucket, minlength=buckets)
    ends = np.cumsum(counts)
    for index in np.flatnonzero(counts):
        yield int(index), order[ends[index] - counts[index]:ends[index]]


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Rows in arrays: their unit's and partition's classes, the value columns read as doubles,
    and (a seeded run only) the repr of each row's values read (as a dict row holds them)."""
    unit: _Classes
    partition: list
    values: dict
    texts: Optional[np.ndarray]

    def take(self, index) -> "_Rows":
        return _Rows(self.unit.take(index), [c.take(index) for c in self.partition],
                     {c: v[index] for c, v in self.values.items()},
                     None if self.texts is None else self.texts[index])

    @staticmethod
    def concat(pieces: list) -> "_Rows":
        return _Rows(_Classes.concat([p.unit for p in pieces]),
                     [_Classes.concat(list(c)) for c in zip(*(p.partition for p in pieces))],
                     {c: np.concatenate([p.values[c] for p in pieces]) for c in pieces[0].values},
                     None if pieces[0].texts is None
                     else np.concatenate([p.texts for p in pieces]))


@dataclasses.dataclass(frozen=True)
class _Kept:
    """A bucket of units after steps 1-2: the partitions its rows fell in (``partition``: their
    classes, each showing its widest key among these rows) and the kept pairs
    (``pairs.pair_partition`` indexes ``partition``), their rows' values in pair order."""
    partition: list
    pairs: local.KeptPairs
    ordered: dict


@dataclasses.dataclass(frozen=True)
class _Sums:
    """Partitions' partial sums: classes (and widest keys), the sign-split sums of their kept
    pairs' vectors (aggregators.saturated: summed apart, saturated once at the end), and how
    many kept pairs each has (none: a partition only through pairs step 2 dropped)."""
    partition: list
    positive: np.ndarray
    negative: np.ndarray
    pairs: np.ndarray

    def take(self, index) -> "_Sums":
        return _Sums([c.take(index) for c in self.partition], self.positive[index],
                     self.negative[index], self.pairs[index])

    @staticmethod
    def concat(pieces: list) -> "_Sums":
        return _Sums([_Classes.concat(list(c)) for c in zip(*(p.partition for p in pieces))],
                     *(np.concatenate([getattr(p, name) for p in pieces])
                       for name in ("positive", "negative", "pairs")))


def _group_sums(groups: np.ndarray, matrix: np.ndarray, count: int) -> np.ndarray:
    """The (count, width) sums of ``matrix``'s rows by group (an overflow is inf)."""
    return np.stack([np.bincount(groups, weights=matrix[:, j], minlength=count)
                     for j in range(matrix.shape[1])], axis=1).reshape(count, matrix.shape[1])


# --- the stages ----------------------------------------------------------------------------------

class _BatchRows(beam.DoFn):
    """Dict rows -> lists of up to BATCH_ROWS of them, a bundle's rows at a time."""

    BATCH_ROWS = 50_000

    def start_bundle(self):
        self._rows = []

    def process(self, row):
        self._rows.append(row)
        if len(self._rows) >= self.BATCH_ROWS:
            rows, self._rows = self._rows, []
            yield rows

    def finish_bundle(self):
        if self._rows:
            yield WindowedValue(self._rows, MIN_TIMESTAMP, [GlobalWindow()])


# Elements sent through the shuffle by unit (batches, not rows). Runners count every
# PCollection's elements in their monitoring anyway; this one is for tests.
UNIT_SHUFFLE_ELEMENTS = Metrics.counter("sage_tfx.aggregation.beam", "unit_shuffle_elements")


class _Prepare(beam.DoFn):
    """A batch of rows -> the rows to aggregate, split by their unit's bucket: (bucket, _Rows).
    Which rows, each by its own content (local.representable_rows' rule): a unit that is not
    null, text keys and unit representable (identifiers.py), and with public partitions a
    listed partition."""

    def __init__(self, query: AggregationQuery, public: Optional[set], buckets: int,
                 seeded: bool):
        self._query, self._public, self._buckets, self._seeded = query, public, buckets, seeded

    def process(self, batch):
        query = self._query
        unit = _classes_of(_column(batch, query.unit_column))
        partition = [_classes_of(_column(batch, c)) for c in query.group_by]
        keep = ~unit.is_null() & unit.representable()
        for column in partition:
            keep &= column.representable()
        if self._public is not None and len(keep):
            codes, _ = _partition_codes(partition)
            first = local.first_occurrences(codes)
            classes = zip(*(column.take(first).class_values() for column in partition))
            keep &= np.array([key in self._public for key in classes], dtype=bool)[codes]
        index = np.flatnonzero(keep)
        presence, columns = presence_columns(query), value_columns(query)
        texts = None
        if self._seeded:  # the repr of each row's values read, `_keyed_pairs`' canonical order
            read = [_python_values(_column(batch, c)) for c in columns]
            texts = _object_array(repr(list(values)) for values in zip(*read)) if read else \
                _object_array([repr([])] * len(keep))
        rows = _Rows(unit, partition,
                     {c: _value_column(_column(batch, c), c in presence) for c in columns},
                     texts)
        for bucket, members in _by_bucket(unit.take(index).hashes(), self._buckets):
            UNIT_SHUFFLE_ELEMENTS.inc()
            yield bucket, rows.take(index[members])


def _keyed_rng(seed: int, stage: int, key) -> np.random.Generator:
    """A seeded run's generator for one key: seeded by (seed, stage, a SHA-256 of its repr)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    words = np.frombuffer(digest, dtype="<u4").tolist()
    return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence([seed, stage, *words])))


def _keyed_pairs(rows: _Rows, unit_codes: np.ndarray, partition_codes: np.ndarray,
                 max_partitions: int, seed: int) -> local.KeptPairs:
    """Steps 1-2 of a seeded run (tests only), the same sample on any runner and split: each
    pair's rows in the order of their values' repr (rows equal there are interchangeable), then in
    the order of a permutation drawn from the pair's own generator (stage 1, key (partition
    class, unit class)); each unit's pairs in the order of their partition class's repr, the
    first C_u of a permutation from the unit's own generator (stage 2, key its class)."""
    unit_class = rows.unit.take(local.first_occurrences(unit_codes)).class_values()
    first = local.first_occurrences(partition_codes)
    partition_class = list(zip(*(c.take(first).class_values() for c in rows.partition)))
    pair_codes = local.combined_codes([(unit_codes, int(unit_codes.max()) + 1),
                                       (partition_codes, len(partition_class))])
    order = np.argsort(pair_codes, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(pair_codes[order]) != 0])
    texts, by_unit = rows.texts, {}
    for members in np.split(order, starts[1:]):
        unit, partition = int(unit_codes[members[0]]), int(partition_codes[members[0]])
        rng = _keyed_rng(seed, 1, (partition_class[partition], unit_class[unit]))
        members = np.array(sorted(members.tolist(), key=texts.__getitem__))
        by_unit.setdefault(unit, []).append((partition, members[rng.permutation(len(members))]))
    kept = []
    for unit, pairs in by_unit.items():
        rng = _keyed_rng(seed, 2, unit_class[unit])
        pairs = sorted(pairs, key=lambda pair: repr(partition_class[pair[0]]))
        chosen = rng.permutation(len(pairs))[:max_partitions]
        kept.extend((*pairs[i], len(chosen)) for i in chosen)
    sizes = np.array([len(members) for _, members, _ in kept], dtype=np.int64)
    return local.KeptPairs(
        np.concatenate([members for _, members, _ in kept]).astype(np.int64),
        np.repeat(np.arange(len(kept)), sizes),
        np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes),
        np.array([partition for partition, _, _ in kept], dtype=np.int64),
        np.array([count for _, _, count in kept], dtype=np.int64))


class _BoundUnits(beam.DoFn):
    """Steps 1-2 on one bucket of units (every row of each of its units: the unit shuffle put
    them here), by the local engine's kernel (local.keep_pairs). Unseeded (the product), each
    DoFn instance draws from ``secret_rng()``: each pair's row order and each unit's choice of
    pairs is uniform whatever the worker, bundle or bucket, so the release's law does not depend
    on the split. Seeded (tests only), `_keyed_pairs`: one generator per key, as before batching,
    so a seeded run gives the same sample on any runner, with any number of workers."""

    def __init__(self, query: AggregationQuery, seed: Optional[int]):
        self._query, self._seed = query, seed

    def setup(self):
        self._rng = secret_rng() if self._seed is None else None

    def process(self, element):
        _, pieces = element
        rows = _Rows.concat(list(pieces))
        unit_codes, _ = rows.unit.factorize()
        partition_codes, count = _partition_codes(rows.partition)
        maximum = self._query.max_partitions_contributed
        kept = (local.keep_pairs(self._query, unit_codes, partition_codes, count, self._rng)
                if self._seed is None else
                _keyed_pairs(rows, unit_codes, partition_codes, maximum, self._seed))
        yield _Kept([c.widest(partition_codes, count) for c in rows.partition], kept,
                    {c: values[kept.order] for c, values in rows.values.items()})


class _Contribute(beam.DoFn):
    """Step 3 on a bucket's kept pairs (local.contributions), summed per partition apart by
    sign (aggregators.saturated), then split by the partition's bucket: (bucket, _Sums)."""

    def __init__(self, query: AggregationQuery, buckets: int):
        self._query, self._buckets = query, buckets

    def process(self, kept: _Kept, inferred: dict):
        vectors = local.contributions(self._query, _given_bounds(self._query, inferred),
                                      kept.pairs, kept.ordered)
        count, partition = len(kept.partition[0]), kept.pairs.pair_partition
        sums = _Sums(kept.partition, _group_sums(partition, np.maximum(vectors, 0.0), count),
                     _group_sums(partition, np.maximum(-vectors, 0.0), count),
                     np.bincount(partition, minlength=count))
        for bucket, members in _by_bucket(_tuple_hashes(kept.partition), self._buckets):
            yield bucket, sums.take(members)


class _SumPartitions(beam.DoFn):
    """One bucket of partitions: their sums over every bucket of units, and the key each shows
    (the widest over all its rows, or the listed key itself with public partitions): (keys,
    positive sums, negative sums) of the partitions with a kept pair (a class all of whose
    pairs step 2 dropped has a key but no sums: not a partition here)."""

    def __init__(self, public: Optional[dict]):
        self._public = public

    def process(self, element):
        _, pieces = element
        sums = _Sums.concat(list(pieces))
        codes, count = _partition_codes(sums.partition)
        with np.errstate(over="ignore"):  # an overflow is inf, which saturates
            positive = _group_sums(codes, sums.positive, count)
            negative = _group_sums(codes, sums.negative, count)
        shown = np.flatnonzero(np.bincount(codes, weights=sums.pairs, minlength=count) > 0)
        columns = [c.widest(codes, count).take(shown) for c in sums.partition]
        keys = ([self._public[key] for key in zip(*(c.class_values() for c in columns))]
                if self._public is not None else
                list(zip(*(c.shown_values() for c in columns))))
        yield keys, positive[shown], negative[shown]


def _public_zeros(query: AggregationQuery, buckets: int) -> list:
    """Each listed partition with zero sums and one pair (so that it is released without rows),
    by bucket as `_Contribute` sends the data's."""
    listed = [_classes_of(_object_array(key[i] for key in query.public_partitions))
              for i in range(len(query.group_by))]
    width, count = aggregators.layout(query).width, len(query.public_partitions)
    zeros = _Sums(listed, np.zeros((count, width)), np.zeros((count, width)),
                  np.ones(count, dtype=np.int64))
    return [(bucket, zeros.take(members))
            for bucket, members in _by_bucket(_tuple_hashes(listed), buckets)]


def _given_bounds(query: AggregationQuery, inferred: dict) -> dict:
    bounds = {a.output_name: (a.low, a.high) for a in query.aggregates
              if a.bounded and not a.bounds_inferred}
    bounds.update({name: value[0] for name, value in inferred.items()})
    return bounds


class AccumulateTransform(beam.PTransform):
    """rows (dicts; ``batched``: batches of rows, each a pandas frame, an Arrow record batch or
    a list of dicts) -> (the partitions' (keys, positive sums, negative sums) by bucket of
    partitions, the inferred bounds as (output name, ((low, high), event)) pairs): steps 1-3
    and the DP bounds. ``buckets``: how many buckets of units (and of partitions) the two
    shuffles group by: the parallelism of the stages after them."""

    def __init__(self, query: AggregationQuery, plan: BudgetPlan, seed: Optional[int] = None,
                 batched: bool = False, buckets: int = 16):
        super().__init__()
        query.check()
        check_plan(query, plan)
        self._query, self._plan, self._seed = query, plan, seed
        self._batched, self._buckets = batched, buckets

    def expand(self, rows):
        query = self._query
        selection_public = SelectionRule(query.selection) is SelectionRule.PUBLIC
        # Public: each class -> the listed key itself (spec refuses a key listed twice, so no
        # two listed keys are ==; with nulls as one class, NULL matches None as on local).
        public = ({tuple(map(_equality_class, key)): key for key in query.public_partitions}
                  if selection_public else None)
        # Why classes, not raw keys: C_eff = min(C_u, G) and m bound a unit's effect only if it
        # holds ONE pair per (partition, unit). Grouping raw keys made u@0.0 and u@-0.0 (or u@1
        # and u@1.0/True) two pairs of one public partition, each with its own m rows and its
        # own count: one unit moved COUNT by 2m under noise for m. Grouped by the classes of
        # both (the unit's too: 1 and 1.0 are one unit, as pd.factorize has it), every pair is
        # one (partition, unit) as the local engine forms them, so step 2's C_u and step 3's m
        # bound each unit as derived there. A unit's rows all reach one bucket (the shuffle is
        # by a hash of its class), so steps 1-2 see all of them at once, as on the local engine.
        batches = rows if self._batched else rows | "Batch" >> beam.ParDo(_BatchRows())
        kept = (batches
                | "Prepare" >> beam.ParDo(_Prepare(query, None if public is None else set(public),
                                                   self._buckets, self._seed is not None))
                | "GroupUnits" >> beam.GroupByKey()
                | "BoundUnits" >> beam.ParDo(_BoundUnits(query, self._seed)))
        histograms = []
        for aggregate in bounds_inferred_by_step(query):
            name = aggregate.output_name
            histograms.append(
                kept
                | f"Histogram[{name}]" >> beam.Map(
                    lambda k, a=aggregate: local.bounds_histogram(query, a, k.pairs, k.ordered))
                | f"SumHistogram[{name}]" >> beam.CombineGlobally(
                    lambda hs: np.sum([*hs, np.zeros(aggregators.LOG_HISTOGRAM_SIZE)], axis=0))
                | f"Bounds[{name}]" >> beam.Map(
                    lambda h, a=aggregate: (a.output_name, aggregators.infer_bounds(
                        query, a, self._plan, h))))
        inferred = (tuple(histograms) | "AllBounds" >> beam.Flatten() if histograms
                    else rows.pipeline | "NoBounds" >> beam.Create([]))
        sums = kept | "Contribute" >> beam.ParDo(_Contribute(query, self._buckets),
                                                 beam.pvalue.AsDict(inferred))
        if public is not None:  # listed partitions without rows are released too
            zeros = rows.pipeline | "PublicZeros" >> beam.Create(
                _public_zeros(query, self._buckets))
            sums = (sums, zeros) | "WithPublic" >> beam.Flatten()
        partitions = (sums | "GroupPartitions" >> beam.GroupByKey()
                      | "SumPartitions" >> beam.ParDo(_SumPartitions(public)))
        return (partitions, inferred)


class GatherAccumulated(beam.PTransform):
    """AccumulateTransform's output -> one ``local.Accumulated`` (what ``local.accumulate``
    returns: the pre-noise sums of every partition and the inferred bounds), the partitions'
    sums (not rows: one element per bucket of partitions) gathered for the release, which
    selects among all of them. ``schema``: the rows' Arrow schema when they came from a table,
    so the keys keep their declared types as on the local engine (else pandas infers them, as
    for a frame)."""

    def __init__(self, query: AggregationQuery, schema: Optional[pa.Schema] = None):
        super().__init__()
        self._query, self._schema = query, schema

    def expand(self, accumulated):
        partitions, inferred = accumulated
        return (partitions
                | "Gather" >> beam.combiners.ToList()
                | "Pack" >> beam.Map(_accumulated, self._query, beam.pvalue.AsDict(inferred),
                                     self._schema))


class AggregateTransform(beam.PTransform):
    """rows (dicts; ``batched``: batches of rows, AccumulateTransform) -> one Release: ``query``
    at ``plan``'s budget (local.aggregate's contract, ``intervals`` included). ``seed`` fixes
    the sampling for tests only; ``buckets``: AccumulateTransform's."""

    def __init__(self, query: AggregationQuery, plan: BudgetPlan,
                 unit: GuaranteeUnit = GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ,
                 seed: Optional[int] = None, schema: Optional[pa.Schema] = None,
                 intervals: bool = False, batched: bool = False, buckets: int = 16):
        super().__init__()
        self._accumulate = AccumulateTransform(query, plan, seed, batched, buckets)
        self._query, self._plan, self._unit, self._schema = query, plan, unit, schema
        self._intervals = intervals

    def expand(self, rows):
        return (rows
                | "Accumulate" >> self._accumulate
                | "GatherAccumulated" >> GatherAccumulated(self._query, self._schema)
                | "Release" >> beam.Map(_release, self._query, self._plan, self._unit,
                                        self._intervals))


def _release(accumulated: Accumulated, query: AggregationQuery, plan: BudgetPlan,
             unit: GuaranteeUnit, intervals: bool):
    return release_accumulated(query, plan, accumulated, unit, intervals)


_CHUNK_ROWS = 100_000


def _write_pickle(path: str, value) -> None:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path) as file:
        file.write(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _read_pickle(path: str):
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path) as file:
        return pickle.loads(file.read())


def run_transform(batches, transform, options=None):
    """Run ``transform`` on ``batches`` in a pipeline of its own and return its one output;
    each element of ``batches`` reaches the transform as one element.

    Batches and output cross between this process and the workers as pickle files in a fresh
    directory under the options' ``--temp_location`` (on a cluster: a bucket the workers and
    this process both reach, with the access control of the data), or under a local temporary
    directory without one (workers on this machine); the directory is deleted afterwards. The
    batches go as files read by the workers, rather than inside the job graph: a
    ``beam.Create`` of rows put every row into the pipeline that the runner's service stores
    (and Beam inferred a type hint from each row and bz2-compressed them all, in this process:
    most of a run's time). The output is a Release (noisy values only) except in the tests'
    pre-noise runs."""
    import tempfile
    import uuid

    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

    shared = (options or PipelineOptions()).view_as(GoogleCloudOptions).temp_location
    with tempfile.TemporaryDirectory() as local_directory:
        directory = FileSystems.join(shared or local_directory, f"sage-tfx-run-{uuid.uuid4().hex}")
        output = FileSystems.join(directory, "output.pickle")
        try:
            chunks = []
            for index, batch in enumerate(batches):
                chunks.append(FileSystems.join(directory, f"rows-{index:06d}.pickle"))
                _write_pickle(chunks[-1], batch)
            with beam.Pipeline(options=options) as pipeline:
                _ = (pipeline | "Chunks" >> beam.Create(chunks)
                     | "Rows" >> beam.Map(_read_pickle) | "Run" >> transform
                     | "Save" >> beam.Map(lambda result: _write_pickle(output, result)))
            return _read_pickle(output)
        finally:
            if shared and FileSystems.exists(directory):
                FileSystems.delete([directory])


def _batches(rows, query: AggregationQuery):
    """(the rows as batches of at most 10^5: Arrow record batches of a table, slices of a
    frame, lists of dicts; their Arrow schema if they came from a table)."""
    if isinstance(rows, pa.Table):
        query.check(rows.column_names)
        return rows.to_batches(max_chunksize=_CHUNK_ROWS), rows.schema
    if isinstance(rows, pd.DataFrame):
        query.check(rows.columns)
        return [rows.iloc[start:start + _CHUNK_ROWS]
                for start in range(0, len(rows), _CHUNK_ROWS)], None
    rows = list(rows)
    return [rows[start:start + _CHUNK_ROWS] for start in range(0, len(rows), _CHUNK_ROWS)], None


def _keys(partitions: list, query: AggregationQuery,
          schema: Optional[pa.Schema]) -> pd.DataFrame:
    """The partitions' key tuples as a frame: in the schema's types when given (public keys
    that do not fit their column's type stay Python objects, as on the local engine)."""
    columns = list(query.group_by)
    if schema is not None:
        try:
            return pa.table({column: pa.array([key[i] for key in partitions],
                                              schema.field(column).type)
                             for i, column in enumerate(columns)}).to_pandas(
                                 types_mapper=pd.ArrowDtype)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass
    return pd.DataFrame(partitions, columns=columns)


def _accumulated(parts: list, query: AggregationQuery, inferred: dict,
                 schema: Optional[pa.Schema] = None) -> Accumulated:
    width = aggregators.layout(query).width
    keys = _keys([key for part in parts for key in part[0]], query, schema)
    positive, negative = ([np.concatenate([np.zeros((0, width))] + [part[i] for part in parts])
                           for i in (1, 2)])
    events = {BOUNDS_STEP_PREFIX + name: value[1] for name, value in inferred.items()}
    return Accumulated(keys, aggregators.saturated(positive, negative),
                       _given_bounds(query, inferred), events)


def aggregate_with_beam(rows, query: AggregationQuery, plan: BudgetPlan,
                        unit: GuaranteeUnit = GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ, *,
                        options: Optional[beam.options.pipeline_options.PipelineOptions] = None,
                        seed: Optional[int] = None, intervals: bool = False,
                        buckets: int = 16):
    """Run :class:`AggregateTransform` on ``rows`` (a pyarrow.Table, a pandas frame or an
    iterable of dicts) in a pipeline of its own (DirectRunner unless ``options`` say
    otherwise); the Release."""
    batches, schema = _batches(rows, query)
    return run_transform(batches, AggregateTransform(query, plan, unit, seed, schema, intervals,
                                                     batched=True, buckets=buckets), options)
