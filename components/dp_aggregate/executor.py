"""DPAggregate's executor: check the grant, read its Examples, run the query on Beam, release.

Order: the grant was charged by the ledger (BlockLedger component); `require_grant` checks it and
the Examples against the ledger's records; the query was checked when the pipeline was built and
is checked again here before a record is read; `frontend.run` consumes every step's share (once,
in the ledger) before the operator runs; the release is written with its guarantee. Records are
mapped to the declared columns by the record rule (components/record_rule.py) first, so no
record's content can stop the run after its charge.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf
from apache_beam.options.pipeline_options import PipelineOptions
from tfx.dsl.components.base import base_beam_executor
from tfx.types import artifact_utils

from sage_tfx import console
from sage_tfx.components import record_rule
from sage_tfx.components.privacy_grant import require_grant
from sage_tfx.dp_statistics.aggregation import frontend, relation, sql
from sage_tfx.dp_statistics.aggregation.beam import aggregate_with_beam
from sage_tfx.dp_statistics.aggregation.sql import ARROW_TYPES
from sage_tfx.dp_statistics.tables import guarantee_unit_of_blocks

_TF_TYPES = {"int": tf.int64, "float": tf.float32, "string": tf.string}
_CONSUMER = "DPAggregate"


def feature_spec(columns: dict[str, str]) -> dict:
    unknown = {name: kind for name, kind in columns.items() if kind not in _TF_TYPES}
    if unknown:
        raise sql.QueryError(f"columns {unknown}: each type must be one of {sorted(_TF_TYPES)}")
    return {name: tf.io.FixedLenFeature([], _TF_TYPES[kind]) for name, kind in columns.items()}


def prepared(query: str, unit_column: str, columns: dict[str, str]) -> frontend.PreparedQuery:
    """The query checked against the Examples' declared columns (any FROM name is them)."""
    feature_spec(columns)
    if unit_column not in columns:
        raise sql.QueryError(f"unit_column {unit_column!r} is not one of the columns "
                             f"{sorted(columns)}")
    schema = pa.schema([(name, ARROW_TYPES[kind]) for name, kind in columns.items()])
    names = [table.name for table in sql.parse(query).select.find_all(sql.exp.Table)]
    return frontend.prepare(query, {n: sql.TableSchema(unit_column, columns) for n in names},
                            {n: schema for n in names})


def read_rows(examples_uris: list[str], columns: dict[str, str]) -> pa.Table:
    """Every record of the Examples (all splits), mapped to `columns` by the record rule."""
    spec = feature_spec(columns)
    files = sorted(f for uri in examples_uris
                   for f in tf.io.gfile.glob(os.path.join(uri, "Split-*", "*")))
    serialized = [bytes(r.numpy()) for r in tf.data.TFRecordDataset(files, "GZIP")] \
        if files else []
    clean = record_rule.sanitise_records(serialized, spec)
    parsed = tf.io.parse_example(tf.constant(clean, dtype=tf.string), spec) if clean else {}
    arrays = []
    for name, kind in columns.items():
        values = parsed[name].numpy() if clean else np.zeros(0)
        if kind == "string":
            values = [v.decode("utf-8", "replace") for v in values]
        arrays.append(pa.array(values, ARROW_TYPES[kind]))
    return pa.Table.from_arrays(arrays, names=list(columns))


class Executor(base_beam_executor.BaseBeamExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        grant = require_grant(input_dict["grant"], input_dict["examples"], consumer=_CONSUMER)
        columns = json.loads(exec_properties["columns"])
        query = prepared(exec_properties["query"], exec_properties["unit_column"], columns)
        data = read_rows([e.uri for e in input_dict["examples"]], columns)
        rows = relation.evaluate(query.checked, lambda _: data)
        options = PipelineOptions(self._beam_pipeline_args or [])

        def beam_engine(rows_table, aggregation_query, budget, unit):
            return aggregate_with_beam(rows_table, aggregation_query, budget, unit,
                                       options=options)

        # The unit comes from how the granted blocks were cut (their records), never from a
        # parameter: user-level only when every block was cut by the unit column.
        unit = guarantee_unit_of_blocks(grant.ledger, grant.blocks,
                                        exec_properties["unit_column"])
        release = frontend.run(rows, query.query, grant, grant.share, unit, query.columns,
                               engine=beam_engine, accounting=grant.ledger.accounting)
        target = artifact_utils.get_single_instance(output_dict["statistics"])
        os.makedirs(target.uri, exist_ok=True)
        release.table.to_csv(os.path.join(target.uri, "release.csv"), index=False)
        pq.write_table(pa.Table.from_pandas(release.table, preserve_index=False),
                       os.path.join(target.uri, "release.parquet"))
        # Exact decimal strings: ML Metadata's SQLite backend rounds doubles to 6 places.
        target.set_string_custom_property("epsilon", repr(float(release.epsilon)))
        target.set_string_custom_property("delta", repr(float(release.delta)))
        target.set_string_custom_property("unit", release.unit)
        target.set_string_custom_property("grant_id", grant.grant_id)
        target.set_string_custom_property("query", exec_properties["query"])
        target.set_string_custom_property("columns", json.dumps(list(release.table.columns)))
        console.report("DPAggregate: released %d group(s) at (%s, %s)-DP for adding or removing "
                       "%s", len(release.table), release.epsilon, release.delta, release.unit)
