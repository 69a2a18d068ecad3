"""BlockExampleGen's executor: new records -> one Examples artifact per block, registered in the ledger.

Blocks are keyed by a public attribute (Sage §4.4): a timestamp feature cut into calendar
months, days or hours (event-level DP), or an integer user id cut into fixed-width ranges
(user-level DP). Within a block, records go to the `train` or `test` split by a keyed hash of
the record, so the split is stable and independent of record order.

Blocks are immutable once registered (their budget may already be spent): data for a block the
ledger already has is refused, naming the blocks. Data is written before a block is registered,
so a registered block always has its Examples.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from typing import Any, Iterable

import apache_beam as beam
import tensorflow as tf
from tfx.components.example_gen.csv_example_gen.executor import _CsvToExample
from tfx.dsl.components.base import base_beam_executor
from tfx.types import artifact_utils

from sage_tfx.sage_access.ledger import BlockLedger
from sage_tfx.sage_access.store import parse

SPLITS = ("train", "test")
TIME_UNITS = ("month", "day", "hour")


def block_of(value: float, block_by: str, users_per_block: int) -> tuple[str, int, str, str]:
    """(block id, span, start, end) of a key value. Spans increase with the key."""
    if block_by == "users":
        index = int(value) // users_per_block
        low, high = index * users_per_block, (index + 1) * users_per_block
        return f"users-{low:09d}-{high - 1:09d}", index, str(low), str(high)
    moment = dt.datetime.fromtimestamp(int(value), tz=dt.timezone.utc)
    if block_by == "month":
        start = moment.replace(day=1, hour=0, minute=0, second=0)
        end = (start + dt.timedelta(days=32)).replace(day=1)
        return start.strftime("%Y-%m"), start.year * 12 + start.month - 1, start.isoformat(), end.isoformat()
    if block_by == "day":
        start = moment.replace(hour=0, minute=0, second=0)
        end = start + dt.timedelta(days=1)
        return start.strftime("%Y-%m-%d"), int(start.timestamp()) // 86400, start.isoformat(), end.isoformat()
    start = moment.replace(minute=0, second=0)
    end = start + dt.timedelta(hours=1)
    return start.strftime("%Y-%m-%dT%H"), int(start.timestamp()) // 3600, start.isoformat(), end.isoformat()


def _key_value(example: tf.train.Example, key: str) -> float:
    feature = example.features.feature.get(key)
    values = None
    if feature is not None:
        kind = feature.WhichOneof("kind")
        values = getattr(feature, kind).value if kind in ("int64_list", "float_list") else None
    if not values:
        if feature is not None and feature.WhichOneof("kind") == "bytes_list":
            # The value itself is not repeated: an error message must not carry a record.
            raise ValueError(f"the block key {key!r} holds text (such as a date string); it must "
                             "be Unix seconds (an integer, e.g. 1704067200 for 2024-01-01 UTC)")
        raise ValueError(f"a record has no numeric value for the block key {key!r}: "
                         "every record must carry it")
    return values[0]


def _split_of(serialized: bytes, test_fraction: float) -> str:
    digest = hashlib.blake2b(serialized, digest_size=8, key=b"sage-tfx-split").digest()
    return "test" if int.from_bytes(digest, "big") / 2 ** 64 < test_fraction else "train"


class _WriteBlockSplit(beam.DoFn):
    def __init__(self, output_uri: str):
        self._output_uri = output_uri

    def process(self, keyed: tuple[tuple, Iterable[bytes]]):
        (block_id, span, start, end, split), records = keyed
        directory = os.path.join(self._output_uri, block_id, f"Split-{split}")
        tf.io.gfile.makedirs(directory)
        count = 0
        with tf.io.TFRecordWriter(os.path.join(directory, "data_tfrecord-00000-of-00001.gz"),
                                  options="GZIP") as writer:
            for record in records:
                writer.write(record)
                count += 1
        yield block_id, span, start, end, split, count


class Executor(base_beam_executor.BaseBeamExecutor):

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

        template = artifact_utils.get_single_instance(output_dict["examples"])
        output_uri = template.uri
        with self._make_beam_pipeline() as pipeline:
            if input_dict.get("input_examples"):
                patterns = [os.path.join(upstream.uri, "Split-*", "*")
                            for upstream in input_dict["input_examples"]]
                records = (pipeline | "Patterns" >> beam.Create(patterns)
                           | "ReadExamples" >> beam.io.ReadAllFromTFRecord())
            elif input_format == "csv":
                examples = pipeline | "ReadCsv" >> _CsvToExample(
                    {"input_base": exec_properties["input_base"]}, "*.csv")
                records = examples | "Serialize" >> beam.Map(lambda e: e.SerializeToString())
            elif input_format == "tfrecord":
                records = pipeline | "ReadTFRecord" >> beam.io.ReadFromTFRecord(
                    os.path.join(exec_properties["input_base"], "*"))
            else:
                raise ValueError(f"input_format must be 'csv' or 'tfrecord', got {input_format!r}")

            def keyed(record: bytes):
                value = _key_value(tf.train.Example.FromString(record), key)
                block = block_of(value, block_by, users_per_block)
                return (*block, _split_of(record, test_fraction)), record

            counts = (records
                      | "KeyByBlock" >> beam.Map(keyed)
                      | "GroupByBlock" >> beam.GroupByKey()
                      | "Write" >> beam.ParDo(_WriteBlockSplit(output_uri)))
            _ = (counts | "Collect" >> beam.combiners.ToList()
                 | "Summary" >> beam.Map(lambda rows: _write_summary(output_uri, rows)))

        with tf.io.gfile.GFile(os.path.join(output_uri, "blocks.json")) as summary:
            rows = json.load(summary)
        counts_by_block: dict[str, dict[str, int]] = {}
        spans = {}
        for block_id, span, start, end, split, count in rows:
            counts_by_block.setdefault(block_id, {s: 0 for s in SPLITS})[split] = count
            spans[block_id] = (span, start, end)
        if not counts_by_block:
            raise ValueError(f"no records under {exec_properties.get('input_base') or 'the input Examples'}")

        known = {b.block_id for b in ledger.blocks()}
        existing = sorted(set(counts_by_block) & known)
        if existing:
            raise ValueError(f"ledger {ledger.context!r} already has block(s) {existing}: blocks "
                             "are immutable once registered (their budget may already be spent, so "
                             "new records would change what was granted), so late records for "
                             "them are refused. Ingest only files that arrived since the last run "
                             "(a new input directory), or run training without BlockExampleGen")

        # Register in key order, so "most recent" in the ledger follows the stream.
        outputs = []
        for block_id in sorted(counts_by_block, key=lambda b: spans[b][0]):
            span, start, end = spans[block_id]
            for split in SPLITS:
                tf.io.gfile.makedirs(os.path.join(output_uri, block_id, f"Split-{split}"))
            examples = type(template)()
            examples.uri = os.path.join(output_uri, block_id)
            examples.split_names = artifact_utils.encode_split_names(list(SPLITS))
            examples.span = span
            examples.set_string_custom_property("block_id", block_id)
            examples.set_string_custom_property("block_start", start)
            examples.set_string_custom_property("block_end", end)
            # Records per split, so readers (the adaptive driver) need not count them again.
            examples.set_string_custom_property("split_counts",
                                                json.dumps(counts_by_block[block_id]))
            ledger.add_block(block_id, float(exec_properties["block_epsilon"]),
                             float(exec_properties["block_delta"]), start, end, examples.uri)
            outputs.append(examples)
        output_dict["examples"][:] = outputs


def _write_summary(output_uri: str, rows) -> None:
    with tf.io.gfile.GFile(os.path.join(output_uri, "blocks.json"), "w") as summary:
        json.dump(sorted(rows), summary)

