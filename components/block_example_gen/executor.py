"""BlockExampleGen's executor: new records -> one Examples artifact per block, registered in the ledger.

Blocks are keyed by a public attribute (Sage §4.4): a timestamp feature cut into calendar
months, days or hours (event-level DP), or an integer user id cut into fixed-width ranges
(user-level DP). Within a block, records go to the `train` or `test` split by a keyed hash of
the record, so the split is stable and independent of record order.

Nothing stored here depends on the records beyond the records themselves (issue 16 §1): the
blocks registered are those of the stream's public schedule, [schedule_start, schedule_end) of
the key, whether or not a record fell in them (an empty month is still a block, with empty
splits); no count is stored, logged or printed; a record outside the schedule or without a
usable key (a number, or an ISO 8601 date) is dropped without a trace (the add-or-remove-one
relation covers dropping a record, and nothing says whether any was). Adding or removing one
record therefore changes only the contents of one block's data files.

Blocks are immutable once registered (their budget may already be spent): a schedule naming a
block the ledger already has is refused (before any record is read). Data is written before the
blocks are registered, so a registered block always has its Examples, and the run's blocks are
registered together as its last step (all or none), so a run that failed can be run again.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Iterable, Optional

import apache_beam as beam
import tensorflow as tf
from google.protobuf.message import DecodeError
from tfx.types import artifact_utils

from sage_tfx.components.block_example_gen import constants as block_keys
from sage_tfx.components.block_example_gen.csv_rows import (check_csv_headers, column_types,
                                                            csv_records)
from sage_tfx.components.util.beam_executor import BeamExecutor
from sage_tfx.components.util.examples_io import SPLITS, EVAL_SPLIT, TRAIN_SPLIT
from sage_tfx.dp_statistics.cells import unix_seconds
from sage_tfx.dp_statistics.tables import record_block_key
from sage_tfx.private_files import private_directory, restrict_tree
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.ledger import EXAMPLES, BlockLedger, NewBlock
from sage_tfx.sage_access.schedule import TIME_UNITS, block_of, schedule
from sage_tfx.sage_access.store import parse


def _key_value(example: tf.train.Example, key: str) -> Optional[float]:
    """The record's block key in Unix seconds (or a user id); None (the record is dropped) if it
    carries neither a finite number nor text holding one or an ISO 8601 date or time (read as
    UTC when it names no zone, e.g. "2024-01-05" or "2024-01-05T10:30:00+01:00"):
    cells.unix_seconds, the one reader of times."""
    feature = example.features.feature.get(key)
    if feature is None:
        return None
    kind = feature.WhichOneof("kind")
    if kind == "bytes_list":
        if not feature.bytes_list.value:
            return None
        seconds = unix_seconds(feature.bytes_list.value[0].decode("utf-8", "replace"))
        return None if math.isnan(seconds) else seconds
    values = getattr(feature, kind).value if kind in ("int64_list", "float_list") else None
    if not values or not math.isfinite(values[0]):
        return None
    return values[0]


def place(record: bytes, key: str, block_by: str, users_per_block: int, first: int,
          last: int) -> Optional[str]:
    """The scheduled block a serialized record falls in, or None: the record is dropped when it
    is no tf.Example, has no usable key, or its key lies outside the public schedule [first,
    last). The range is checked before block_of, which cannot place every number: one record
    must not be able to stop the ingestion."""
    try:
        value = _key_value(tf.train.Example.FromString(record), key)
    except DecodeError:
        return None
    if value is None or not first <= value < last:
        return None
    return block_of(value, block_by, users_per_block)[0]


def _split_of(serialized: bytes, test_fraction: float) -> str:
    digest = hashlib.blake2b(serialized, digest_size=8, key=b"sage-tfx-split").digest()
    return EVAL_SPLIT if int.from_bytes(digest, "big") / 2 ** 64 < test_fraction else TRAIN_SPLIT


DATA_FILE = "data_tfrecord-00000-of-00001.gz"


def _write_records(path: str, records: Iterable[bytes]) -> None:
    with tf.io.TFRecordWriter(path, options="GZIP") as writer:
        for record in records:
            writer.write(record)


class _WriteBlockSplit(beam.DoFn):
    def __init__(self, output_uri: str):
        self._output_uri = output_uri

    def process(self, keyed: tuple[tuple[str, str], Iterable[bytes]]):
        (block_id, split), records = keyed
        directory = os.path.join(self._output_uri, block_id, f"Split-{split}")
        tf.io.gfile.makedirs(directory)
        _write_records(os.path.join(directory, DATA_FILE), records)


class Executor(BeamExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        block_by = exec_properties["block_by"]
        users_per_block = int(exec_properties.get("users_per_block") or 0)
        if block_by not in TIME_UNITS + ("users",):
            raise ValueError(f"block_by must be one of {TIME_UNITS + ('users',)}, got {block_by!r}")
        if block_by == "users" and users_per_block < 1:
            raise ValueError("block_by='users' needs users_per_block >= 1")
        test_fraction = float(exec_properties["test_fraction"])
        if not 0 <= test_fraction < 1:
            raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
        input_format = exec_properties["input_format"]
        key = exec_properties["block_key"]
        ledger = BlockLedger(parse(exec_properties["ledger_store"]), exec_properties["ledger_context"])
        first, last = int(exec_properties["schedule_start"]), int(exec_properties["schedule_end"])
        blocks = schedule(first, last, block_by, users_per_block)
        scheduled = {block[0] for block in blocks}
        known = {b.block_id for b in ledger.blocks()}
        existing = sorted(scheduled & known)
        if existing:
            raise BadRequest(
                f"ledger {ledger.context!r} already has block(s) {existing}: blocks are immutable "
                "once registered (their budget may already be spent, so new records would change "
                "what was granted), so a schedule naming them is refused. Ingest the next period: "
                "set schedule_start to the end of the last registered block, with a new input "
                "directory holding only its records, or run training without BlockExampleGen")

        if input_format == "csv" and not input_dict.get("input_examples"):
            files = sorted(tf.io.gfile.glob(os.path.join(exec_properties["input_base"], "*.csv")))
            columns = exec_properties.get("columns")
            names, types = column_types(json.loads(columns) if columns else None)
            check_csv_headers(files, names, key)

        template = artifact_utils.get_single_instance(output_dict["examples"])
        output_uri = template.uri
        # Raw records: nobody else may enter the directory while Beam writes into it.
        private_directory(output_uri)
        with self._make_beam_pipeline() as pipeline:
            if input_dict.get("input_examples"):
                patterns = [os.path.join(upstream.uri, "Split-*", "*")
                            for upstream in input_dict["input_examples"]]
                records = (pipeline | "Patterns" >> beam.Create(patterns)
                           | "ReadExamples" >> beam.io.ReadAllFromTFRecord())
            elif input_format == "csv":
                records = (pipeline | "CsvFiles" >> beam.Create(files)
                           | "ReadCsv" >> beam.FlatMap(csv_records, types))
            elif input_format == "tfrecord":
                records = pipeline | "ReadTFRecord" >> beam.io.ReadFromTFRecord(
                    os.path.join(exec_properties["input_base"], "*"))
            else:
                raise ValueError(f"input_format must be 'csv' or 'tfrecord', got {input_format!r}")

            def keyed(record: bytes):
                block_id = place(record, key, block_by, users_per_block, first, last)
                if block_id is not None:
                    yield (block_id, _split_of(record, test_fraction)), record

            _ = (records
                 | "KeyByBlock" >> beam.FlatMap(keyed)
                 | "GroupByBlock" >> beam.GroupByKey()
                 | "Write" >> beam.ParDo(_WriteBlockSplit(output_uri)))

        outputs, registered = [], []
        for block_id, span, start, end in blocks:
            for split in SPLITS:
                directory = os.path.join(output_uri, block_id, f"Split-{split}")
                tf.io.gfile.makedirs(directory)
                if not tf.io.gfile.exists(os.path.join(directory, DATA_FILE)):
                    _write_records(os.path.join(directory, DATA_FILE), [])  # no record fell here
            examples = type(template)()
            examples.uri = os.path.join(output_uri, block_id)
            examples.split_names = artifact_utils.encode_split_names(list(SPLITS))
            examples.span = span
            examples.set_string_custom_property(block_keys.BLOCK_ID, block_id)
            examples.set_string_custom_property(block_keys.BLOCK_START, start)
            examples.set_string_custom_property(block_keys.BLOCK_END, end)
            if block_by == "users":  # DPAggregate states the user-level unit from this
                record_block_key(examples.uri, key)
            registered.append(NewBlock(block_id, float(exec_properties["block_epsilon"]),
                                       float(exec_properties["block_delta"]), start, end,
                                       examples.uri, EXAMPLES))
            outputs.append(examples)
        with tf.io.gfile.GFile(os.path.join(output_uri, "blocks.json"), "w") as summary:
            json.dump([list(block) for block in blocks], summary)
        restrict_tree(output_uri)  # what Beam and TF wrote with the umask's modes: 0600 / 0700
        # Registered last, all in one ledger change, in key order (so "most recent" in the
        # ledger follows the stream): an ingestion that fails before this registered nothing,
        # and running it again is not refused for blocks it half-registered.
        ledger.add_blocks(registered)
        if int(exec_properties.get("per_block_artifacts", 1)) == 0:
            # One artifact for the run: the blocks are its subdirectories (and the ledger's
            # data_uri of each); the first block's span, as TFX spans name a run's first period.
            template.split_names = artifact_utils.encode_split_names(list(SPLITS))
            template.span = blocks[0][1]
            template.set_string_custom_property(block_keys.BLOCK_IDS,
                                                json.dumps([block[0] for block in blocks]))
            outputs = [template]
        output_dict["examples"][:] = outputs
