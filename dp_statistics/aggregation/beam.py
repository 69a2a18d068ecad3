"""The Beam engine: the same steps as local.py over aggregators.py's math, for data that does not
fit one machine (DirectRunner in tests; Flink/Dataflow in production).

Input: a PCollection of rows as dicts (column -> value). Output of :class:`AggregateTransform`:
a PCollection holding one ``Release``. Rows are grouped by (partition, unit) and each pair's rows
shuffled (step 1), grouped by unit and at most C_u pairs sampled (step 2), turned into
contribution vectors by ``aggregators.pair_contributions`` on batches of pairs (step 3) and
summed per partition; the partitions' accumulators then meet in one element, where
``local.release_accumulated`` adds the noise and selects partitions (step 4). DP bounds (§4.2.5):
each pair's values are counted into the log histogram, the histograms summed globally and turned
into bounds by ``aggregators.infer_bounds`` (noise from sage_tfx.mechanisms), a side input of
step 3. Sampling uses ``sage_tfx.randomness.secret_rng`` per DoFn instance (a seeded test run:
one generator per key, :class:`_KeyedSampling`).
"""
from __future__ import annotations

import hashlib
import numbers
import pickle
from typing import Optional

import apache_beam as beam
import numpy as np
import pandas as pd
import pyarrow as pa
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.windowed_value import WindowedValue

from sage_tfx.dp_statistics.aggregation import aggregators
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
    """The value a partition's key shows for ``value``'s class, before `_widest`: no -0.0, one
    null."""
    if _equality_class(value) is None:
        return None
    return value + 0.0 if isinstance(value, (float, np.floating)) else value


def _type_rank(value) -> int:
    if isinstance(value, (bool, np.bool_)):
        return 0
    return 1 if isinstance(value, numbers.Integral) else 2


def _widest(keys) -> tuple:
    """One representative per class, the same whatever the rows' order: in each column the
    widest type seen (bool < int < float), so a column of one type keeps that type."""
    return tuple(max(values, key=_type_rank) for values in zip(*keys))


class _KeyedSampling(beam.DoFn):
    """Sampling randomness that does not depend on how the runner split the work.

    Unseeded (the product), each DoFn instance draws from ``secret_rng()``: every pair's
    permutation is uniform whatever worker, bundle or input order it gets, so the release's law
    does not depend on the split. Seeded (tests only), a fixed seed per instance would make the
    outcome depend on which elements each worker saw and in what order (and give every worker
    the same stream); instead each key gets its own generator, seeded by (seed, stage, a SHA-256
    of the key's repr), and its values are put in a canonical order first, so a seeded run gives
    the same sample on any runner, with any number of workers."""

    STAGE = 0

    def __init__(self, seed: Optional[int]):
        self._seed = seed

    def setup(self):
        self._rng = secret_rng() if self._seed is None else None

    def _sampling(self, key, values: list, canonical) -> tuple[np.random.Generator, list]:
        if self._seed is None:
            return self._rng, values
        digest = hashlib.sha256(repr(key).encode()).digest()
        words = np.frombuffer(digest, dtype="<u4").tolist()
        rng = np.random.Generator(np.random.PCG64DXSM(
            np.random.SeedSequence([self._seed, self.STAGE, *words])))
        return rng, sorted(values, key=canonical)


class _ShufflePair(_KeyedSampling):
    """Step 1: one (partition, unit) pair's rows in a uniformly random order, as arrays."""

    STAGE = 1

    def __init__(self, columns: list[str], presence: set[str], seed: Optional[int]):
        super().__init__(seed)
        self._columns, self._presence = columns, presence

    def process(self, element):
        (partition, unit), rows = element
        rng, rows = self._sampling((partition, unit), list(rows), self._values_text)
        order = rng.permutation(len(rows))
        columns = {c: np.array([(float("nan") if pd.isna(rows[i].get(c)) else 1.0)
                                if c in self._presence else _number_or_nan(rows[i].get(c))
                                for i in order])
                   for c in self._columns}
        yield unit, (partition, len(rows), columns)

    def _values_text(self, row) -> str:
        # rows equal in the columns read are interchangeable: this orders the multiset
        return repr([row.get(c) for c in self._columns])



class _SamplePartitions(_KeyedSampling):
    """Step 2: at most C_u of a unit's pairs, uniformly, each with the number the unit kept
    (its selection weight's k)."""

    STAGE = 2

    def __init__(self, max_partitions: int, seed: Optional[int]):
        super().__init__(seed)
        self._max_partitions = max_partitions

    def process(self, element):
        unit, pairs = element
        # a unit has one pair per partition: the partition's repr orders them
        rng, pairs = self._sampling(unit, list(pairs), lambda pair: repr(pair[0]))
        kept = rng.permutation(len(pairs))[:self._max_partitions]
        for index in kept:
            yield (*pairs[index], len(kept))


def _one_pair(size: int) -> tuple[np.ndarray, np.ndarray]:
    """``pair_of_row`` and ``rank_in_pair`` of one pair whose rows are already shuffled."""
    return np.zeros(size, dtype=np.int64), np.arange(size)


def _given_bounds(query: AggregationQuery, inferred: dict) -> dict:
    bounds = {a.output_name: (a.low, a.high) for a in query.aggregates
              if a.bounded and not a.bounds_inferred}
    bounds.update({name: value[0] for name, value in inferred.items()})
    return bounds


def _pair_histogram(pair, query: AggregationQuery, name: str) -> np.ndarray:
    aggregate = next(a for a in query.aggregates if a.output_name == name)
    _, size, columns, _ = pair
    pair_of_row, rank = _one_pair(size)
    return aggregators.log_histogram(aggregators.bounds_input(
        aggregate, pair_of_row, rank, 1, columns[aggregate.column],
        query.max_contributions_per_partition))


class _Contribute(beam.DoFn):
    """Step 3 on a batch of pairs: ``aggregators.pair_contributions`` is vectorised over pairs,
    and one call per pair cost more CPU than all of Beam's own work on them (about 70 us per
    pair, 2 x 10^5 pairs at 10^6 rows). Each pair's vector is the one a call on that pair alone
    gives (its rows are summed in the same order). Output: (partition, the pair's contribution
    split by sign: rows [positive parts, negative parts]), summed apart so that the totals
    saturate as on the local engine (aggregators.saturated)."""

    BATCH_PAIRS = 1024

    def __init__(self, query: AggregationQuery):
        self._query = query

    def start_bundle(self):
        self._pairs, self._bounds = [], None

    def process(self, pair, inferred: dict):
        if self._bounds is None:  # one global side input: the same for every pair
            self._bounds = _given_bounds(self._query, inferred)
        self._pairs.append(pair)
        if len(self._pairs) >= self.BATCH_PAIRS:
            yield from self._flush()

    def finish_bundle(self):
        for contribution in self._flush():
            yield WindowedValue(contribution, MIN_TIMESTAMP, [GlobalWindow()])

    def _flush(self) -> list:
        pairs, self._pairs = self._pairs, []
        if not pairs:
            return []
        sizes = np.array([size for _, size, _, _ in pairs])
        pair_of_row = np.repeat(np.arange(len(pairs)), sizes)
        rank_in_pair = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        columns = {c: np.concatenate([pair_columns[c] for _, _, pair_columns, _ in pairs])
                   for c in pairs[0][2]}
        partitions_of_unit = np.array([kept for _, _, _, kept in pairs])
        vectors = aggregators.pair_contributions(self._query, self._bounds, pair_of_row,
                                                 rank_in_pair, len(pairs), columns,
                                                 partitions_of_unit)
        signed = np.stack([np.maximum(vectors, 0.0), np.maximum(-vectors, 0.0)], axis=1)
        return [(pair[0], signed[i]) for i, pair in enumerate(pairs)]


def _sum_signed(parts) -> np.ndarray:
    """The sum of sign-split contributions; a part that overflows is inf, which saturates."""
    with np.errstate(over="ignore"):
        return np.sum(list(parts), axis=0)


class AccumulateTransform(beam.PTransform):
    """rows (dicts) -> (the partitions' (key tuple, sign-split contribution sums) pairs, the
    inferred bounds as (output name, ((low, high), event)) pairs): steps 1-3 and the DP
    bounds."""

    def __init__(self, query: AggregationQuery, plan: BudgetPlan, seed: Optional[int] = None):
        super().__init__()
        query.check()
        check_plan(query, plan)
        self._query, self._plan, self._seed = query, plan, seed

    def expand(self, rows):
        query = self._query
        group_by, unit_column = list(query.group_by), query.unit_column
        selection_public = SelectionRule(query.selection) is SelectionRule.PUBLIC
        # Public: each class -> the listed key itself (spec refuses a key listed twice, so no
        # two listed keys are ==; with nulls as one class, NULL matches None as on local).
        public = ({tuple(map(_equality_class, key)): key for key in query.public_partitions}
                  if selection_public else None)

        def partition(row):
            # A row without a key column has a null key there (the local engine's frame has
            # NaN): raising would stop a charged run because of one row.
            return tuple(row.get(c) for c in group_by)

        def pair_key(row):
            # Why classes, not raw keys: C_eff = min(C_u, G) and m bound a unit's effect only
            # if it holds ONE pair per (partition, unit). Grouping raw keys made u@0.0 and
            # u@-0.0 (or u@1 and u@1.0/True) two pairs of one public partition, each with its
            # own m rows and its own count: one unit moved COUNT by 2m under noise for m.
            # Keyed by the classes of both (the unit's too: 1 and 1.0 are one unit, as
            # pd.factorize has it), every pair is one (partition, unit) as the local engine
            # forms them, so step 2's C_u and step 3's m bound each unit as derived there.
            return (tuple(map(_equality_class, partition(row))),
                    _equality_class(row[unit_column]))

        def wanted(row):
            if pd.isna(row.get(unit_column)):
                return False  # owned by nobody (None, or NaN from a pandas frame)
            # The local engine's rule (local.representable_rows), on this row alone.
            texts = [v for v in (*partition(row), row[unit_column]) if isinstance(v, str)]
            if texts and not representable_ids(texts).all():
                return False
            return public is None or tuple(map(_equality_class, partition(row))) in public

        owned = rows | "Owned" >> beam.Filter(wanted)
        if public is None:  # the key each selected class shows: the same on any runner
            representatives = (owned
                               | "ClassKeys" >> beam.Map(lambda row: (
                                   pair_key(row)[0],
                                   tuple(map(_representative, partition(row)))))
                               | "Representatives" >> beam.CombinePerKey(_widest))
        else:
            representatives = rows.pipeline | "PublicKeys" >> beam.Create(list(public.items()))
        pairs = (owned
                 | "ByPair" >> beam.Map(lambda row: (pair_key(row), row))
                 | "GroupPairs" >> beam.GroupByKey()
                 | "ShufflePair" >> beam.ParDo(_ShufflePair(value_columns(query), presence_columns(query),
                                                self._seed))
                 | "GroupUnits" >> beam.GroupByKey()
                 | "SampleC" >> beam.ParDo(_SamplePartitions(query.max_partitions_contributed,
                                                             self._seed)))
        histograms = []
        for aggregate in query.aggregates:
            if aggregate in bounds_inferred_by_step(query):
                name = aggregate.output_name
                histograms.append(
                    pairs
                    | f"Histogram[{name}]" >> beam.Map(_pair_histogram, query, name)
                    | f"SumHistogram[{name}]" >> beam.CombineGlobally(
                        lambda hs: np.sum([*hs, np.zeros(aggregators.LOG_HISTOGRAM_SIZE)],
                                          axis=0))
                    | f"Bounds[{name}]" >> beam.Map(
                        lambda h, a=aggregate: (a.output_name, aggregators.infer_bounds(
                            query, a, self._plan, h))))
        inferred = (tuple(histograms) | "AllBounds" >> beam.Flatten() if histograms
                    else rows.pipeline | "NoBounds" >> beam.Create([]))
        vectors = pairs | "Contribute" >> beam.ParDo(_Contribute(query),
                                                     beam.pvalue.AsDict(inferred))
        if public is not None:  # listed partitions without rows are released too
            width = aggregators.layout(query).width
            zeros = (rows.pipeline | "PublicZeros" >> beam.Create(
                [(key, np.zeros((2, width))) for key in public]))
            vectors = (vectors, zeros) | "WithPublic" >> beam.Flatten()
        sums = vectors | "SumPartitions" >> beam.CombinePerKey(_sum_signed)
        # a class all of whose pairs step 2 dropped has a key but no sums: not a partition here
        shown = ((sums, representatives) | "WithKeys" >> beam.CoGroupByKey()
                 | "ShownKeys" >> beam.FlatMapTuple(
                     lambda _, joined: [(joined[1][0], joined[0][0])] if joined[0] else []))
        return (shown, inferred)


class GatherAccumulated(beam.PTransform):
    """AccumulateTransform's output -> one ``local.Accumulated`` (what ``local.accumulate``
    returns: the pre-noise sums of every partition and the inferred bounds). ``schema``: the
    rows' Arrow schema when they came from a table, so the keys keep their declared types as
    on the local engine (else pandas infers them, as for a frame)."""

    def __init__(self, query: AggregationQuery, schema: Optional[pa.Schema] = None):
        super().__init__()
        self._query, self._schema = query, schema

    def expand(self, accumulated):
        vectors, inferred = accumulated
        return (vectors
                | "Gather" >> beam.combiners.ToList()
                | "Pack" >> beam.Map(_accumulated, self._query, beam.pvalue.AsDict(inferred),
                                     self._schema))


class AggregateTransform(beam.PTransform):
    """rows (dicts) -> one Release: ``query`` at ``plan``'s budget (local.aggregate's contract,
    ``intervals`` included). ``seed`` fixes the sampling for tests only."""

    def __init__(self, query: AggregationQuery, plan: BudgetPlan,
                 unit: GuaranteeUnit = GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ,
                 seed: Optional[int] = None, schema: Optional[pa.Schema] = None,
                 intervals: bool = False):
        super().__init__()
        self._accumulate = AccumulateTransform(query, plan, seed)
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


_CHUNK_ROWS = 10_000


def _write_pickle(path: str, value) -> None:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path) as file:
        file.write(pickle.dumps(value))


def _read_pickle(path: str):
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path) as file:
        return pickle.loads(file.read())


def run_transform(rows, transform, options=None):
    """Run ``transform`` on ``rows`` in a pipeline of its own and return its one output.

    Rows and output cross between this process and the workers as pickle files in a fresh
    directory under the options' ``--temp_location`` (on a cluster: a bucket the workers and
    this process both reach, with the access control of the data), or under a local temporary
    directory without one (workers on this machine); the directory is deleted afterwards. The
    rows go in chunks of 10^4, read by the workers, rather than inside the job graph: a
    ``beam.Create`` of them put every row into the pipeline that the runner's service stores
    (and Beam inferred a type hint from each row and bz2-compressed them all, in this process:
    most of a run's time). The output is a Release (noisy values only) except in the tests'
    pre-noise runs."""
    import tempfile
    import uuid

    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

    shared = (options or PipelineOptions()).view_as(GoogleCloudOptions).temp_location
    with tempfile.TemporaryDirectory() as local:
        directory = FileSystems.join(shared or local, f"sage-tfx-run-{uuid.uuid4().hex}")
        output = FileSystems.join(directory, "output.pickle")
        try:
            rows = list(rows)
            chunks = []
            for index, start in enumerate(range(0, len(rows), _CHUNK_ROWS)):
                chunks.append(FileSystems.join(directory, f"rows-{index:06d}.pickle"))
                _write_pickle(chunks[-1], rows[start:start + _CHUNK_ROWS])
            del rows
            with beam.Pipeline(options=options) as pipeline:
                _ = (pipeline | "Chunks" >> beam.Create(chunks)
                     | "Rows" >> beam.FlatMap(_read_pickle) | "Run" >> transform
                     | "Save" >> beam.Map(lambda result: _write_pickle(output, result)))
            return _read_pickle(output)
        finally:
            if shared and FileSystems.exists(directory):
                FileSystems.delete([directory])


def _records(rows, query: AggregationQuery):
    """(the rows as dicts, their Arrow schema if they came from a table)."""
    if isinstance(rows, pa.Table):
        query.check(rows.column_names)
        return rows.to_pylist(), rows.schema  # Python ints: exact beyond 2^53, None for null
    if isinstance(rows, pd.DataFrame):
        query.check(rows.columns)
        return rows.to_dict("records"), None
    return rows, None


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


def _accumulated(pairs: list, query: AggregationQuery, inferred: dict,
                 schema: Optional[pa.Schema] = None) -> Accumulated:
    width = aggregators.layout(query).width
    keys = _keys([partition for partition, _ in pairs], query, schema)
    matrix = aggregators.saturated(*np.stack([signed for _, signed in pairs], axis=1)) \
        if pairs else np.zeros((0, width))
    events = {BOUNDS_STEP_PREFIX + name: value[1] for name, value in inferred.items()}
    return Accumulated(keys, matrix, _given_bounds(query, inferred), events)


def aggregate_with_beam(rows, query: AggregationQuery, plan: BudgetPlan,
                        unit: GuaranteeUnit = GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ, *,
                        options: Optional[beam.options.pipeline_options.PipelineOptions] = None,
                        seed: Optional[int] = None, intervals: bool = False):
    """Run :class:`AggregateTransform` on ``rows`` (a pyarrow.Table, a pandas frame or an
    iterable of dicts) in a pipeline of its own (DirectRunner unless ``options`` say
    otherwise); the Release."""
    records, schema = _records(rows, query)
    return run_transform(records, AggregateTransform(query, plan, unit, seed, schema, intervals),
                         options)
