"""The data vector of granted blocks, each privacy unit counted once, and the Gaussian event
the matrix mechanism runs: what `sage-tfx workload-answer` and the MatrixMechanism component
share. No TensorFlow unless a block holds Examples (BlockExampleGen's TFRecords)."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet
from dp_accounting import dp_event

from sage_tfx import mechanisms
from sage_tfx.dp_statistics import tables
from sage_tfx.dp_statistics.aggregation.aggregators import rows_per_unit
from sage_tfx.dp_statistics.matrix.spec import WorkloadSpec
from sage_tfx.dp_statistics.tables import ROWS_FILE
from sage_tfx.randomness import secret_rng
from sage_tfx.release import GuaranteeUnit


def answers_table(labels, answered):
    """One row per query: its label, noisy answer and expected RMSE (what both front doors
    write)."""
    import pandas as pd

    return pd.DataFrame({"query": list(labels), "answer": answered.answers,
                         "expected_rmse": answered.query_rmse})


def mechanism_text(strategy) -> str:
    """How the release is made, for its Guarantee: the strategy family and its sensitivity."""
    return (f"Gaussian matrix mechanism, strategy: {strategy.name} (the family of least "
            f"expected error for this workload), L2 sensitivity {strategy.l2_sensitivity:.6g} "
            "(the strategy's largest column norm)")


def block_histogram(spec: WorkloadSpec, data_uri: str) -> np.ndarray:
    """The data vector of one block that is no ingested table, each record once:
    BlockExampleGen's Examples, or rows.parquet written without a table record. A spec feature
    the rows lack reads as missing in every row (the record rule: its attribute's default
    cell), as a feature absent from an Example does."""
    rows_file = os.path.join(data_uri, ROWS_FILE)
    if not os.path.exists(rows_file):  # TensorFlow reads Examples: imported only for them
        from sage_tfx.components.matrix_mechanism.executor import examples_histogram

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
    """The data vector of a grant's blocks and what one neighbouring step adds or removes (the
    units its guarantee is for: (GuaranteeUnit, unit column) pairs, any one of which moves one
    cell)."""
    vector: np.ndarray
    units: tuple[tuple[GuaranteeUnit, Optional[str]], ...]


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
    units = [(tables.guarantee_unit_of_blocks(
        ledger, [b for b, (t, _) in table_blocks.items() if t.unit_column == column], column),
        column) for column in sorted({table.unit_column for table, _ in table_blocks.values()})]
    if record_blocks:
        units.append((GuaranteeUnit.RECORD, None))
    return GrantedHistogram(vector, tuple(units))


def planned_event(epsilon: float, delta: float) -> dp_event.GaussianDpEvent:
    """What mechanism.answer_workload runs on an (epsilon, delta) share."""
    return dp_event.GaussianDpEvent(
        mechanisms.gaussian_sigma(l2_sensitivity=1.0, epsilon=epsilon, delta=delta))
