"""BlockExampleGen: ingest new records as Sage blocks (one TFX span = one block)."""
from __future__ import annotations

import datetime as dt
import json
from typing import Mapping, Optional, Sequence, Union

from tfx.dsl.components.base import base_beam_component, executor_spec
from tfx.types import channel, component_spec, standard_artifacts

from sage_tfx.components.block_example_gen import csv_rows, executor
from sage_tfx.components.dag_guard import PrivateExamples, ProducesPrivateRecords


class BlockExampleGenSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "input_base": component_spec.ExecutionParameter(type=str, optional=True),
        "input_format": component_spec.ExecutionParameter(type=str),
        "block_key": component_spec.ExecutionParameter(type=str),
        "block_by": component_spec.ExecutionParameter(type=str),
        "schedule_start": component_spec.ExecutionParameter(type=int),
        "schedule_end": component_spec.ExecutionParameter(type=int),
        "users_per_block": component_spec.ExecutionParameter(type=int, optional=True),
        "test_fraction": component_spec.ExecutionParameter(type=float),
        "block_epsilon": component_spec.ExecutionParameter(type=float),
        "block_delta": component_spec.ExecutionParameter(type=float),
        "ledger_store": component_spec.ExecutionParameter(type=str),
        "ledger_context": component_spec.ExecutionParameter(type=str),
        # 1 (default): one Examples artifact per block; 0: one for the whole run, holding each
        # block in a subdirectory (pipelines/kubeflow.py sets it: TFX's Kubeflow V2 entrypoint
        # passes exactly one artifact per output).
        "per_block_artifacts": component_spec.ExecutionParameter(type=int, optional=True),
        # The CSV columns as a JSON list of names or {name: type} (the table's public schema),
        # checked against every file's header before anything is registered
        # (csv_rows.check_csv_headers); the types are the features' (csv_rows.FEATURE_KINDS).
        "columns": component_spec.ExecutionParameter(type=str, optional=True),
    }
    INPUTS = {
        # Examples from another ExampleGen (e.g. TFX's CsvExampleGen), all splits, instead of files.
        "input_examples": component_spec.ChannelParameter(type=standard_artifacts.Examples,
                                                          optional=True),
    }
    OUTPUTS = {"examples": component_spec.ChannelParameter(type=PrivateExamples)}


class BlockExampleGen(ProducesPrivateRecords, base_beam_component.BaseBeamComponent):
    """Reads CSV (with a header) or TFRecord files of tf.train.Example under `input_base`, cuts
    them into blocks by `block_key` (or the records of `input_examples`, the output of any TFX
    ExampleGen, all splits), writes one Examples artifact (splits train/test) per block and
    registers each block in the ledger with the stream's ceiling (block_epsilon, block_delta).

    schedule: the stream's public key range [schedule_start, schedule_end) (unix seconds, or
    user ids with block_by="users"), both block boundaries. Every block of the range is
    registered, records or not; records outside it are dropped. Which blocks exist never
    depends on the data (issue 16 §1).

    block_by: "month", "day" or "hour" for a unix-seconds timestamp key (event-level DP), or
    "users" with `users_per_block` for an integer user-id key (user-level DP, Sage §4.4).

    columns: the CSV files' columns (the table's public schema, any order), as names or as
    {name: "int" | "float" | "string"}. A file whose header misses one, adds one or repeats one
    is refused, naming the column, before any block is registered (and so before anything can
    be charged); without `columns` every file must have the first file's header. The block key
    must be a column. Each column's feature type is its declared type, the same in every
    record (a float column's "0" is a float); a column without one (or every column, without
    `columns`) is text, which the DP components' record rule reads as the number their
    feature spec asks for, record by record. Never a type guessed from the cells, which would
    let one record change how the others are stored. The block key may be typed "int" or text
    (a float32 would round Unix seconds by up to 64 s).
    """

    SPEC_CLASS = BlockExampleGenSpec
    EXECUTOR_SPEC = executor_spec.BeamExecutorSpec(executor.Executor)

    def __init__(self, block_key: str, ledger_store: str, block_epsilon: float,
                 block_delta: float, schedule_start: int, schedule_end: int,
                 input_base: Optional[str] = None, block_by: str = "month",
                 input_format: str = "csv", users_per_block: Optional[int] = None,
                 test_fraction: float = 0.2, ledger_context: str = "default",
                 input_examples: Optional[channel.Channel] = None,
                 columns: Optional[Union[Sequence[str], Mapping[str, str]]] = None):
        if (input_base is None) == (input_examples is None):
            raise ValueError("BlockExampleGen reads either files under input_base or the "
                             "Examples of another ExampleGen: give exactly one")
        if not int(schedule_start) < int(schedule_end):
            raise ValueError(f"the schedule [{schedule_start}, {schedule_end}) is empty")
        if columns is not None:
            names, types = csv_rows.column_types(columns)
            if len(set(names)) != len(names) or block_key not in names:
                raise ValueError(f"columns {names} must name each column once, the block "
                                 f"key {block_key!r} among them")
            if types.get(block_key, "string") not in ("int", "string"):
                raise ValueError(f"the block key {block_key!r} must be typed int or string, "
                                 f"not {types[block_key]!r}")
            columns = dict(types) if types else names
        super().__init__(spec=BlockExampleGenSpec(input_examples=input_examples,
            input_base=input_base, input_format=input_format, block_key=block_key,
            block_by=block_by, schedule_start=int(schedule_start),
            schedule_end=int(schedule_end), users_per_block=users_per_block, test_fraction=test_fraction,
            block_epsilon=block_epsilon, block_delta=block_delta, ledger_store=ledger_store,
            ledger_context=ledger_context,
            columns=None if columns is None else json.dumps(columns),
            examples=channel.Channel(type=PrivateExamples)))


def month_schedule(first_month: str, last_month: str) -> tuple[int, int]:
    """(schedule_start, schedule_end) in unix seconds for the calendar months
    first_month..last_month ("YYYY-MM", inclusive, UTC)."""
    start = dt.datetime.strptime(first_month, "%Y-%m").replace(tzinfo=dt.timezone.utc)
    last = dt.datetime.strptime(last_month, "%Y-%m").replace(tzinfo=dt.timezone.utc)
    end = (last + dt.timedelta(days=32)).replace(day=1)
    if end <= start:
        raise ValueError(f"month {last_month} is before {first_month}")
    return int(start.timestamp()), int(end.timestamp())
