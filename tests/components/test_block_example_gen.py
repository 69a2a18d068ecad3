"""BlockExampleGen's reading of CSV rows: the bytes it stores (and hashes for the train/test
split) depend on the row only, not on the process that read it."""
import json
import os
import re
import subprocess
import sys

import pytest

# The last line says whether reading rows loaded Beam or TFX (csv_rows: TensorFlow alone, which
# keeps each of these processes to TensorFlow's import).
READ = ("import sys; from sage_tfx.components.block_example_gen.csv_rows import csv_records; "
        "sys.stdout.write(''.join(r.hex() + '\\n' for r in csv_records(sys.argv[1]))); "
        "print('beam or tfx loaded:', bool({'apache_beam', 'tfx'} & set(sys.modules)))")


@pytest.mark.slow  # four processes importing TensorFlow
def test_a_row_is_serialized_to_the_same_bytes_in_every_process(tmp_path):
    path = tmp_path / "trips.csv"
    columns = [f"c{index}" for index in range(12)]   # enough map entries for order to vary
    rows = [",".join(str(row * 13 + index) for index in range(12)) for row in range(20)]
    path.write_text(",".join(columns) + "\n" + "\n".join(rows) + "\n")
    # The package under test, wherever it is imported from here (PYTHONPATH, if set).
    where = {key: os.environ[key] for key in ("PYTHONPATH",) if key in os.environ}
    outputs = {subprocess.run([sys.executable, "-c", READ, str(path)], check=True,
                              capture_output=True, text=True,
                              env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin",
                                   **where}).stdout
               for seed in range(4)}
    assert len(outputs) == 1
    *rows, loaded = next(iter(outputs)).splitlines()
    assert len(rows) == 20 and loaded == "beam or tfx loaded: False"


def _ingest(tmp_path, store_path, files, columns=None):
    """BlockExampleGen's executor on `files` ({name: CSV text}) under a fresh ledger."""
    from tfx.types import standard_artifacts

    from sage_tfx.components.block_example_gen import executor
    from sage_tfx.sage_access import BlockLedger

    data = tmp_path / "data"
    data.mkdir()
    for name, text in files.items():
        (data / name).write_bytes(text.encode("utf-8", "surrogateescape"))  # \udcff: byte 0xff
    BlockLedger.create(store_path)
    examples = standard_artifacts.Examples()
    examples.uri = str(tmp_path / "out")
    properties = {"input_base": str(data), "input_format": "csv", "block_key": "uid",
                  "block_by": "users", "users_per_block": 10, "schedule_start": 0,
                  "schedule_end": 20, "test_fraction": 0.2, "block_epsilon": 1.0,
                  "block_delta": 1e-6, "ledger_store": store_path, "ledger_context": "default",
                  "columns": None if columns is None else json.dumps(columns)}
    executor.Executor().Do({}, {"examples": [examples]}, properties)
    return BlockLedger(store_path)


@pytest.mark.parametrize("files, columns, said", [
    ({"a.csv": "uid,fare\n1,3.5\n"}, ["uid", "fare", "miles"], "missing column(s) 'miles'"),
    ({"a.csv": "uid,fare,miles,tip\n1,3.5,2,0\n"}, ["uid", "fare", "miles"],
     "undeclared column(s) at position(s) 4"),
    # no declaration: every file must have the first one's header
    ({"a.csv": "uid,fare,miles\n1,3.5,2\n", "b.csv": "uid,fare\n2,4.0\n"}, None,
     "CSV file b.csv: its header does not match the header of a.csv (2 against 3 columns; "
     "differing at position(s) 3)"),
    ({"a.csv": "id,fare\n1,3.5\n"}, None, "the block key 'uid' is not in the header of a.csv"),
    # a file without a header line: its first record must not appear in the message
    ({"a.csv": "uid,fare\n1,3.5\n", "b.csv": "77,41.25\n2,4.0\n"}, None,
     "differing at position(s) 1, 2"),
    ({"a.csv": "77,41.25\n2,4.0\n"}, ["uid", "fare"],
     "missing column(s) 'uid', 'fare'; undeclared column(s) at position(s) 1, 2"),
    # a first line that is not UTF-8: no decoding error naming the byte
    ({"a.csv": "uid,fare\n1,3.5\n", "b.csv": "77,41.25\udcff\n2,4.0\n"}, None,
     "differing at position(s) 1, 2"),
], ids=["missing", "extra", "undeclared", "no key", "headerless", "headerless declared",
        "not utf-8"])
def test_a_csv_that_does_not_match_the_schema_is_refused_before_anything_is_registered(
        tmp_path, store_path, files, columns, said):
    """A pipeline CSV missing a whole column used to be ingested (the feature absent from every
    record) and then trained and charged on without a word."""
    from sage_tfx.sage_access import BlockLedger
    from sage_tfx.sage_access.errors import BadRequest

    with pytest.raises(BadRequest, match=re.escape(said)) as refused:
        _ingest(tmp_path, store_path, files, columns)
    assert "77" not in str(refused.value) and "41.25" not in str(refused.value)
    assert BlockLedger(store_path).blocks() == []


def test_files_that_match_the_declared_columns_in_any_order_are_ingested(tmp_path, store_path):
    ledger = _ingest(tmp_path, store_path, {"a.csv": "fare,uid\n3.5,1\n",
                                            "b.csv": "uid,fare\n12,4.0\n"}, ["uid", "fare"])
    assert len(ledger.blocks()) == 2  # the schedule's two blocks of 10 user ids
    # Undeclared types: every column is text, the block key too (read as a number to place it).
    assert sum(map(len, _written(tmp_path).values())) == 2
    assert _kinds(_written(tmp_path)) == {"uid": {"bytes_list"}, "fare": {"bytes_list"}}


def test_the_component_refuses_columns_without_the_block_key():
    from sage_tfx.components import BlockExampleGen

    with pytest.raises(ValueError, match="the block key 'uid' among them"):
        BlockExampleGen(input_base="/data", block_key="uid", block_by="users",
                        users_per_block=10, schedule_start=0, schedule_end=20,
                        ledger_store="/tmp/x.sqlite", block_epsilon=1.0, block_delta=1e-6,
                        columns=["fare"])


@pytest.mark.parametrize("columns, said", [
    ({"uid": "int", "fare": "double"}, "each type must be one of int, float, string"),
    ({"uid": "float", "fare": "float"}, "the block key 'uid' must be typed int or string"),
])
def test_the_component_refuses_an_unknown_type_or_a_float_block_key(columns, said):
    from sage_tfx.components import BlockExampleGen

    with pytest.raises(ValueError, match=re.escape(said)):
        BlockExampleGen(input_base="/data", block_key="uid", block_by="users",
                        users_per_block=10, schedule_start=0, schedule_end=20,
                        ledger_store="/tmp/x.sqlite", block_epsilon=1.0, block_delta=1e-6,
                        columns=columns)


def test_an_ingestion_that_failed_registers_nothing_and_can_be_run_again(tmp_path, store_path,
                                                                         monkeypatch):
    """The run's blocks are registered together, as its last step: a run that fails after
    writing its data (here: its blocks.json summary cannot be written) leaves no block half
    registered, and running it again registers them all."""
    import tensorflow as tf
    from tfx.types import standard_artifacts

    from sage_tfx.components.block_example_gen import executor, month_schedule
    from sage_tfx.sage_access import BlockLedger

    from support.ingest import MONTHS, write_csv

    write_csv(str(tmp_path / "data"))
    BlockLedger.create(store_path, min_request_epsilon=0.05)
    start, end = month_schedule(MONTHS[0], MONTHS[-1])
    properties = {"block_by": "month", "test_fraction": 0.5, "input_format": "csv",
                  "block_key": "trip_start_timestamp", "ledger_store": store_path,
                  "ledger_context": "default", "schedule_start": start, "schedule_end": end,
                  "input_base": str(tmp_path / "data"), "block_epsilon": 1.0,
                  "block_delta": 1e-6}

    def ingest(attempt: str) -> list:
        examples = standard_artifacts.Examples()
        examples.uri = str(tmp_path / attempt)
        outputs = {"examples": [examples]}
        executor.Executor().Do({}, outputs, properties)
        return outputs["examples"]

    real_gfile = tf.io.gfile.GFile

    def failing_summary(path, *args, **kwargs):
        if str(path).endswith("blocks.json"):
            raise OSError("the pipeline root is full")
        return real_gfile(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(tf.io.gfile, "GFile", failing_summary)
        with pytest.raises(OSError, match="pipeline root is full"):
            ingest("first-attempt")
    assert BlockLedger(store_path).blocks() == []
    retried = ingest("retry")
    blocks = BlockLedger(store_path).blocks()
    assert [block.block_id for block in blocks] == MONTHS
    assert [block.data_uri for block in blocks] == [str(tmp_path / "retry" / month)
                                                   for month in MONTHS]
    assert {block.data_format for block in blocks} == {"examples"}
    assert [artifact.uri for artifact in retried] == [block.data_uri for block in blocks]


def _written(tmp_path) -> dict:
    """{block/split: [serialized tf.Example, in file order]} of what the executor wrote."""
    import glob

    import tensorflow as tf

    out = str(tmp_path / "out")
    return {os.path.relpath(path, out): [bytes(record.numpy()) for record in
                                         tf.data.TFRecordDataset([path], compression_type="GZIP")]
            for path in sorted(glob.glob(os.path.join(out, "*", "Split-*", "*")))}


def _kinds(written: dict) -> dict:
    """{feature: the set of its value types over every record}."""
    import tensorflow as tf

    kinds = {}
    for records in written.values():
        for record in records:
            for name, feature in tf.train.Example.FromString(record).features.feature.items():
                kinds.setdefault(name, set()).add(feature.WhichOneof("kind"))
    return kinds


TRIPS = "uid,fare,note\n1,3.5,a\n2,7.25,b\n11,12.5,c\n12,not a fare,d\n13,,e\n"
TYPED = {"uid": "int", "fare": "float", "note": "string"}


def test_a_column_has_its_declared_type_in_every_record(tmp_path, store_path):
    """Issue 45: each CSV cell was typed by itself, so a float column's "0" became an int64
    feature in that one record, and TFX's StatisticsGen failed on the Examples ("expected
    float_list, found int64_list"). The declared type is every record's: here the decoder
    StatisticsGen runs first (tfx_bsl's) reads every record into one batch."""
    from tfx_bsl.coders.example_coder import ExamplesToRecordBatchDecoder

    _ingest(tmp_path, store_path, {"a.csv": TRIPS + "3,0,f\n"}, TYPED)
    written = _written(tmp_path)
    assert _kinds(written) == {"uid": {"int64_list"}, "fare": {"float_list"},
                               "note": {"bytes_list"}}
    batch = ExamplesToRecordBatchDecoder().DecodeBatch(
        [record for records in written.values() for record in records])
    assert batch.num_rows == 6
    assert sorted(v for v in batch.column("fare").to_pylist() if v) == [[0.0], [3.5], [7.25],
                                                                          [12.5]]


@pytest.mark.parametrize("types", [None, TYPED], ids=["undeclared", "declared"])
@pytest.mark.parametrize("extra", ["3,0,f\n", '3,"0,f\n', "3,7.5\udcff,f\n"],
                         ids=["zero", "unclosed quote", "not utf-8"])
def test_one_record_changes_no_other_record_nor_a_column_type(tmp_path, types, extra):
    """The same file with and without one line, as BlockExampleGen's CSV reader turns it into
    records: the same records but for that line's own (a line with an unclosed quote drops
    itself alone: Python's csv reader took the rest of the file into that record; a byte that
    is not UTF-8 failed the whole ingestion), and every column keeps its feature type (an
    undeclared column is text, whatever its cells hold)."""
    from sage_tfx.components.block_example_gen.csv_rows import csv_records

    from support.neighbouring import one_more

    lines = TRIPS.splitlines(keepends=True)
    (tmp_path / "with.csv").write_bytes(
        "".join(lines[:3] + [extra] + lines[3:]).encode("utf-8", "surrogateescape"))
    (tmp_path / "without.csv").write_text(TRIPS)
    arguments = (types,) if types else ()  # undeclared: the call main had
    with_line = list(csv_records(str(tmp_path / "with.csv"), *arguments))
    without_line = list(csv_records(str(tmp_path / "without.csv"), *arguments))
    assert one_more(with_line, without_line) and len(without_line) == 5
    assert _kinds({"": with_line}) == _kinds({"": without_line})
