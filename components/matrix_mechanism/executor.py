"""MatrixMechanism executor: grant check, histogram, matrix mechanism, CSV + Parquet + MLMD.

Order: the spec is parsed and the strategy chosen (both data independent) before the grant's
share is consumed; the share's recorded event must be the Gaussian that runs; the records of
both splits are read, each mapped to one cell by the record rule (spec.py: a bad or
out-of-domain value counts in its attribute's public default cell; bytes that are no
tf.Example read as an empty one), and only the mechanism's output is written or logged.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet
import tensorflow as tf
from dp_accounting import dp_event
from google.protobuf.message import DecodeError
from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils

from sage_tfx import console, mechanisms
from sage_tfx.components.privacy_grant import require_grant
from sage_tfx.components.util.examples_io import SPLITS, read_split
from sage_tfx.dp_statistics.matrix import eigen_design, mechanism
from sage_tfx.dp_statistics.matrix.spec import WorkloadSpec, parse_spec
from sage_tfx.dp_statistics import tables
from sage_tfx.dp_statistics.aggregation.aggregators import rows_per_unit
from sage_tfx.dp_statistics.tables import ROWS_FILE
from sage_tfx.randomness import secret_rng

GUARANTEE = ("({epsilon}, {delta})-DP for adding or removing {unit} (Gaussian matrix mechanism, "
             "L2 sensitivity {sensitivity:.6g} = the strategy's largest column norm)")
RECORD_UNIT = "one record of the granted blocks"


def record_columns(serialized: Iterable[bytes], features: Sequence[str]) -> dict[str, list]:
    """Each record's first value of each feature (None when absent); a record that does not
    parse as a tf.Example reads as an empty one (the record rule: a public default)."""
    columns = {feature: [] for feature in features}
    for record in serialized:
        example = tf.train.Example()
        try:
            example.ParseFromString(record)
        except DecodeError:
            example = tf.train.Example()
        for feature in features:
            field = example.features.feature.get(feature)
            kind = field.WhichOneof("kind") if field is not None else None
            values = getattr(field, kind).value if kind else []
            columns[feature].append(values[0] if len(values) else None)
    return columns


def examples_histogram(spec: WorkloadSpec, examples_uri: str) -> np.ndarray:
    """The data vector of every record in the Examples' splits."""
    records = [r for split in SPLITS for r in read_split(examples_uri, split).numpy()]
    return spec.histogram(record_columns(records, spec.features))


def block_histogram(spec: WorkloadSpec, data_uri: str) -> np.ndarray:
    """The data vector of one block that is no ingested table, each record once:
    BlockExampleGen's Examples, or rows.parquet written without a table record. A spec feature
    the rows lack reads as missing in every row (the record rule: its attribute's default
    cell), as a feature absent from an Example does."""
    rows_file = os.path.join(data_uri, ROWS_FILE)
    if not os.path.exists(rows_file):
        return examples_histogram(spec, data_uri)
    present = set(pyarrow.parquet.read_schema(rows_file).names)
    rows = pyarrow.parquet.read_table(rows_file, columns=sorted(present & set(spec.features)))
    return spec.histogram({feature: _feature_values(rows, present, feature)
                           for feature in spec.features})


def _feature_values(rows: pa.Table, present, feature: str) -> list:
    """A feature's value in each row; None in every row when the rows lack it."""
    return rows.column(feature).to_pylist() if feature in present else [None] * rows.num_rows


@dataclasses.dataclass(frozen=True)
class GrantedHistogram:
    """The data vector of a grant's blocks and, in words, what one neighbouring step adds or
    removes (the unit its guarantee is for)."""
    vector: np.ndarray
    unit: str


def granted_histogram(spec: WorkloadSpec, ledger, block_ids: Sequence[str],
                      rng: Optional[np.random.Generator] = None) -> GrantedHistogram:
    """The data vector of the granted blocks, in which each privacy unit counts once.

    Privacy. The sensitivity (mechanism.py) is for a data vector that one neighbouring step
    moves by one cell. An ingested table's promise is per unit, its unit column (tables.py):
    a unit with k rows would move up to k cells, a loss of up to k x epsilon. So of each unit's
    rows in ALL the granted blocks of tables, one is kept, chosen uniformly at random
    (aggregators.rows_per_unit, the operator's sampling; `rng` is fixed in tests only), and a
    unit is a (unit column, id) pair: tables naming the same unit column hold the same people
    (tables.py), so such a unit is counted once over all of them. Adding or removing a unit
    then moves one cell, and which row another unit keeps does not depend on it. The unit
    stated is what tables.guarantee_unit_of_blocks says for each unit column's blocks (the
    unit, or the unit within the blocks read). A block that is no table (BlockExampleGen's
    Examples: one record is one unit) counts each record, as before."""
    vector = np.zeros(spec.workload.cells, dtype=np.int64)
    record_blocks, table_blocks = [], {}
    owners = tables.tables_of(ledger, block_ids)
    for block in ledger.blocks(list(block_ids)):
        table = owners[block.block_id]
        if table is None:
            vector += block_histogram(spec, block.data_uri)
            record_blocks.append(block.block_id)
        else:
            table_blocks[block.block_id] = (table, block.data_uri)
    parts, unit_codes, code_of = [], [], {}
    for table, data_uri in table_blocks.values():
        present = set(table.columns)
        rows = pyarrow.parquet.read_table(
            os.path.join(data_uri, ROWS_FILE),
            columns=sorted((present & set(spec.features)) | {table.unit_column}))
        parts.append((rows, present))
        unit_codes += [code_of.setdefault((table.unit_column, unit), len(code_of))
                       for unit in rows.column(table.unit_column).to_pylist()]
    kept = rows_per_unit(np.asarray(unit_codes, dtype=np.int64), 1,
                         secret_rng() if rng is None else rng)
    if parts:
        vector += spec.histogram({feature: np.concatenate(
            [np.asarray(_feature_values(rows, present, feature), dtype=object)
             for rows, present in parts])[kept] for feature in spec.features})
    units = [tables.guarantee_unit_of_blocks(
        ledger, [b for b, (t, _) in table_blocks.items() if t.unit_column == column],
        column).describe(column)
        for column in sorted({table.unit_column for table, _ in table_blocks.values()})]
    if record_blocks:
        units.append(RECORD_UNIT if not units else
                     "one record of the granted blocks that are no table")
    return GrantedHistogram(vector, " or ".join(units))


def planned_event(epsilon: float, delta: float) -> dp_event.GaussianDpEvent:
    """What mechanism.answer_workload runs on an (epsilon, delta) share."""
    return dp_event.GaussianDpEvent(
        mechanisms.gaussian_sigma(l2_sensitivity=1.0, epsilon=epsilon, delta=delta))


def write_answers(directory: str, labels, release) -> None:
    table = pa.table({"query": labels, "answer": release.answers,
                      "expected_rmse": release.query_rmse})
    os.makedirs(directory, exist_ok=True)
    pyarrow.csv.write_csv(table, os.path.join(directory, "answers.csv"))
    pyarrow.parquet.write_table(table, os.path.join(directory, "answers.parquet"))


def pipeline_strategy_cache(output_uri: str) -> str:
    """`strategies` under the pipeline root: TFX lays an output out as
    <pipeline root>/<component id>/<output key>/<execution id>."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.normpath(output_uri)))), "strategies")


class Executor(base_executor.BaseExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        spec = parse_spec(exec_properties["workload_spec"])
        answers = artifact_utils.get_single_instance(output_dict["answers"])
        strategy = eigen_design(spec.workload, cache_dir=exec_properties.get("strategy_cache")
                                or pipeline_strategy_cache(answers.uri))
        strategy.require_support(spec.workload)   # refused before anything is charged
        examples = artifact_utils.get_single_instance(input_dict["examples"])
        grant = require_grant(input_dict["grant"], [examples])
        step = exec_properties.get("grant_step") or "statistics"
        epsilon, delta = grant.share(step)
        grant.check_event(step, planned_event(epsilon, delta))
        release = mechanism.answer_workload(spec.workload, strategy,
                                            examples_histogram(spec, examples.uri),
                                            epsilon=epsilon, delta=delta)
        grant.check_event(step, release.event)
        write_answers(answers.uri, spec.workload.labels(), release)
        for name, value in (("epsilon", epsilon), ("delta", delta),
                            ("expected_rmse", release.expected_rmse)):
            answers.set_float_custom_property(name, float(value))
        answers.set_int_custom_property("queries", spec.workload.query_count)
        answers.set_string_custom_property("strategy", strategy.name)
        answers.set_string_custom_property("event", str(release.event))
        answers.set_string_custom_property("guarantee", GUARANTEE.format(
            epsilon=epsilon, delta=delta, unit=RECORD_UNIT,
            sensitivity=strategy.l2_sensitivity))
        answers.set_string_custom_property("query_rmse", json.dumps(
            [float(v) for v in release.query_rmse]))
        console.report("MatrixMechanism: %d queries answered at (%.3g, %.3g), expected RMSE "
                       "%.4g per query", spec.workload.query_count, epsilon, delta,
                       release.expected_rmse)
