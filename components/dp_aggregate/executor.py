"""DPAggregate's executor: check the grant, read its Examples, run the query on Beam, release.

Order: the grant was charged by the ledger (BlockLedger component); `require_grant` checks it and
the Examples against the ledger's records; the query was checked when the pipeline was built and
is checked again here before a record is read; inside the release protocol (`release.consume`:
the outcome of the query's steps is recorded on the grant), `frontend.run` consumes every step's
share (once, in the ledger) before the operator runs; the release is written with its
guarantee. Records are
mapped to the declared columns by the record rule (components/record_rule.py) first, so no
record's content can stop the run after its charge; a number that is missing, unreadable or
not finite is NULL, skipped by each aggregate as in the SQL engine (BigQuery's semantics).
"""
from __future__ import annotations

import json
import os
from typing import Any

import pyarrow as pa
from apache_beam.options.pipeline_options import PipelineOptions
from tfx.types import artifact_utils

from sage_tfx import console, release
from sage_tfx.components.privacy_grant import require_grant
from sage_tfx.components.util.beam_executor import BeamExecutor
from sage_tfx.components.util.examples_io import feature_spec, read_rows
from sage_tfx.dp_statistics.aggregation import frontend, relation, sql
from sage_tfx.dp_statistics.aggregation.beam import aggregate_with_beam
from sage_tfx.dp_statistics.aggregation.sql import ARROW_TYPES
from sage_tfx.dp_statistics.tables import guarantee_unit_of_blocks

_CONSUMER = "DPAggregate"


def query_inputs(query: str, unit_column: str, columns: dict[str, str]) -> tuple:
    """The parsed query and the schemas it is checked against: every FROM name is the
    Examples, with their declared columns (frontend.check_query's arguments)."""
    feature_spec(columns)
    if unit_column not in columns:
        raise sql.QueryError(f"unit_column {unit_column!r} is not one of the columns "
                             f"{sorted(columns)}")
    schema = pa.schema([(name, ARROW_TYPES[kind]) for name, kind in columns.items()])
    parsed = sql.parse(query)
    names = sql.table_names(parsed)
    return (parsed, {n: sql.TableSchema(unit_column, columns) for n in names},
            {n: schema for n in names})


class Executor(BeamExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        info = require_grant(input_dict["grant"], input_dict["examples"], consumer=_CONSUMER)
        columns = json.loads(exec_properties["columns"])
        unit_column = exec_properties["unit_column"]
        planned = frontend.planned_for_grant(
            *query_inputs(exec_properties["query"], unit_column, columns), info.record,
            info.ledger.accounting)
        frontend.check_grant(planned, info.record, info.ledger.accounting)
        options = PipelineOptions(self._beam_pipeline_args or [])

        def beam_engine(rows_table, aggregation_query, budget, unit, intervals):
            return aggregate_with_beam(rows_table, aggregation_query, budget, unit,
                                       options=options, intervals=intervals)

        # The unit comes from how the granted blocks were cut (their records), never from a
        # parameter: user-level only when every block was cut by the unit column.
        unit = guarantee_unit_of_blocks(info.ledger, info.blocks, unit_column)
        target = artifact_utils.get_single_instance(output_dict["statistics"])
        steps = [step.name for step in planned.budget.steps]
        with release.consume(info.ledger, info.record, steps, _CONSUMER) as charged:
            charged.phase = "reading the granted Examples"
            data = read_rows([e.uri for e in input_dict["examples"]], columns, numeric_nulls=True)
            rows = relation.evaluate(planned.checked, lambda _: data)
            charged.phase = "running the query"
            non_negative = bool(exec_properties.get("non_negative_counts"))
            result = frontend.run(rows, planned, charged, unit, engine=beam_engine,
                                  intervals=bool(exec_properties.get("intervals")),
                                  non_negative_counts=non_negative)
            guarantee = charged.guarantee(unit, unit_column, mechanism=frontend.stated_mechanism(
                planned, non_negative))
            charged.phase = "writing the release"
            os.makedirs(target.uri, exist_ok=True)
            release.write_csv(result.table, os.path.join(target.uri, "release.csv"), guarantee)
            release.write_parquet(result.table, os.path.join(target.uri, "release.parquet"),
                                  guarantee)
            # Exact decimal strings: ML Metadata's SQLite backend rounds doubles to 6 places.
            target.set_string_custom_property("epsilon", repr(float(result.epsilon)))
            target.set_string_custom_property("delta", repr(float(result.delta)))
            target.set_string_custom_property("unit", guarantee.neighbours)
            target.set_string_custom_property("guarantee", guarantee.sentence())
            target.set_string_custom_property("grant_id", info.grant_id)
            target.set_string_custom_property("query", exec_properties["query"])
            target.set_string_custom_property("columns", json.dumps(list(result.table.columns)))
            charged.released([target.uri], guarantee)
        console.report("DPAggregate: released %d group(s); %s", len(result.table),
                       guarantee.sentence())
