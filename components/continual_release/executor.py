"""ContinualRelease's executor: one TFX run of a window's continual release.

Order (charge before release): the query and the window are checked; the previous run's state
directory is copied into this run's `state` artifact; this run's Examples are read (mapped to
the declared columns by the record rule, components/record_rule.py, so no record's content can
stop the run after its charge) and turned into records with their public micro-batches
(dp_statistics/continual/sources.py); then `release.run_window` charges the window's grant on
the first run only (the state keeps its id) and runs the micro-batches after the saved step up
to the run's `through` trigger. Records of a later micro-batch wait in the state (waiting.parquet)
for the run that reaches their trigger; records of a micro-batch already run (late arrivals) are
dropped: which, depends only on the record's time and the public trigger schedule.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils

from sage_tfx import console, release
from sage_tfx.components.privacy_grant import write_grant
from sage_tfx.dp_statistics.aggregation.spec import QueryError
from sage_tfx.dp_statistics.continual import sources
from sage_tfx.dp_statistics.continual.release import STATE_DIR, record_released, run_window
from sage_tfx.dp_statistics.continual.spec import StreamQuery
from sage_tfx.private_files import open_private, private_directory

WAITING_FILE = "waiting.parquet"  # records that arrived before their micro-batch's trigger
RELEASES_DIR = "releases"         # every trigger's release so far (carried from run to run)
_CONSUMER = "ContinualRelease"
_TYPES = ("int", "float", "string")


def query_of(columns: dict[str, str], **fields) -> StreamQuery:
    """The checked StreamQuery of the component's parameters (ValueError naming the problem)."""
    unknown = {name: kind for name, kind in columns.items() if kind not in _TYPES}
    if unknown:
        raise ValueError(f"columns {unknown}: each type must be one of {list(_TYPES)}")
    query = StreamQuery(**fields)
    try:
        query.check(columns)
    except QueryError as error:
        raise ValueError(str(error)) from None
    return query


def _through_step(window: sources.Window, micro_batches: int, through: Optional[int]) -> int:
    """The last trigger at or before `through` (all T without it)."""
    if through is None:
        return micro_batches
    return int(np.searchsorted(window.trigger_times(micro_batches), float(through),
                               side="right"))


def _save_waiting(directory: str, waiting: sources.Records) -> None:
    """Written even when no record waits: whether the file exists must not tell a reader of
    the pipeline root that a record arrived before its trigger."""
    path = os.path.join(directory, WAITING_FILE)
    # Raw records: readable by the owner only, like the state beside them.
    with open_private(f"{path}.partial") as out:
        pq.write_table(waiting.to_arrow(), out)
    os.replace(f"{path}.partial", path)


class Executor(base_executor.BaseExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        # TensorFlow (reading Examples) and the ledger only when the component runs.
        from sage_tfx.components.util.examples_io import read_rows
        from sage_tfx.sage_access.ledger import BlockLedger
        from sage_tfx.sage_access.store import parse

        columns = json.loads(exec_properties["columns"])
        query = query_of(
            columns, key_column=exec_properties["key_column"],
            unit_column=exec_properties["unit_column"],
            time_column=exec_properties["time_column"],
            value_column=exec_properties.get("value_column") or None,
            value_bound=float(exec_properties["value_bound"]),
            contribution_limit=int(exec_properties["contribution_limit"]),
            micro_batches=int(exec_properties["micro_batches"]),
            epsilon=float(exec_properties["epsilon"]), delta=float(exec_properties["delta"]),
            mechanism=exec_properties.get("mechanism") or "auto")
        store = exec_properties["ledger_store"]
        ledger = BlockLedger(parse(store), exec_properties["ledger_context"])
        window = sources.window_of_blocks(ledger, json.loads(exec_properties["window_blocks"]))
        total = query.micro_batches
        last = _through_step(window, total, exec_properties.get("through"))

        state_artifact = artifact_utils.get_single_instance(output_dict["state"])
        directory = state_artifact.uri
        previous = input_dict.get("previous_state") or []
        private_directory(directory)  # waiting records and the operator's state: private
        if previous:
            shutil.copytree(artifact_utils.get_single_instance(previous).uri, directory,
                            dirs_exist_ok=True)
        rows = read_rows([e.uri for e in input_dict["examples"]], columns)
        arrived = sources.records_of(
            rows, sources.Columns(query.unit_column, query.key_column, query.time_column,
                                  query.value_column), window, total)
        waiting_path = os.path.join(directory, WAITING_FILE)
        if os.path.exists(waiting_path):
            arrived = sources.Records.from_arrow(pq.read_table(waiting_path)).then(arrived)

        pipeline = exec_properties.get("pipeline_name") or (
            self._context.pipeline_info.id if self._context and self._context.pipeline_info
            else None)
        state = run_window(ledger, query, window, arrived,
                           os.path.join(directory, STATE_DIR),
                           os.path.join(directory, RELEASES_DIR), consumer=_CONSUMER,
                           through_step=last, pipeline=pipeline,
                           run_id=self._context.pipeline_run_id if self._context else None)
        _save_waiting(directory, arrived.take(arrived.batches > state.step))

        state_artifact.set_string_custom_property("grant_id", state.grant_id)
        state_artifact.set_string_custom_property("window_blocks",
                                                  json.dumps(list(state.blocks)))
        state_artifact.set_int_custom_property("committed_step", state.step)
        state_artifact.set_int_custom_property("micro_batches", total)
        write_grant(artifact_utils.get_single_instance(output_dict["grant"]),
                    ledger.find_grant(state.grant_id), store)
        statistics = artifact_utils.get_single_instance(output_dict["statistics"])
        self._publish(statistics, query, window, state, os.path.join(directory, RELEASES_DIR),
                      ledger.for_tests)
        record_released(ledger, query, state, _CONSUMER, statistics.uri)  # written: last

    @staticmethod
    def _publish(target, query: StreamQuery, window: sources.Window, state,
                 releases: str, ledger_for_tests: bool) -> None:
        """The latest trigger's release as DPStatistics (release.csv and .parquet, every
        trigger so far under triggers/), with its guarantee (as the ledger records it)."""
        os.makedirs(target.uri, exist_ok=True)
        if os.path.isdir(releases):
            shutil.copytree(releases, os.path.join(target.uri, "triggers"), dirs_exist_ok=True)
        latest = os.path.join(releases, f"release-{state.step:06d}.csv")
        table = pd.read_csv(latest, dtype={"key": str}) if state.step and os.path.exists(
            latest) else pd.DataFrame({"key": [], "value": [], "updated": []})
        guarantee = state.guarantee(ledger_for_tests)
        release.write_csv(table, os.path.join(target.uri, "release.csv"), guarantee)
        release.write_parquet(table, os.path.join(target.uri, "release.parquet"), guarantee)
        trigger_time = window.trigger_times(query.micro_batches)[state.step - 1] \
            if state.step else window.start
        # Exact decimal strings: ML Metadata's SQLite backend rounds doubles to 6 places.
        target.set_string_custom_property("epsilon", repr(float(query.epsilon)))
        target.set_string_custom_property("delta", repr(float(query.delta)))
        target.set_string_custom_property("unit", guarantee.neighbours)
        target.set_string_custom_property("guarantee", guarantee.sentence())
        target.set_string_custom_property("grant_id", state.grant_id)
        target.set_string_custom_property(
            "query", f"continual {query.statistic.value} by {query.key_column} over blocks "
                     f"{', '.join(state.blocks)}: trigger {state.step} of "
                     f"{query.micro_batches} (at {pd.Timestamp(trigger_time, unit='s', tz='UTC')})")
        target.set_string_custom_property("columns", json.dumps(list(table.columns)))
        target.set_int_custom_property("trigger", state.step)
        console.report("ContinualRelease: trigger %d of %d released; %s", state.step,
                       query.micro_batches, guarantee.sentence())
