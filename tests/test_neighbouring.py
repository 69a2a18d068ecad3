"""Issue 16 §1: ingest two datasets that differ by one record; every non-DP value the platform
stores (ML Metadata, blocks.json, the run's outputs) or logs is identical (tests/support/neighbouring.py
says exactly what is compared)."""
import csv
import os
import shutil

import pytest
from tfx.orchestration import metadata, pipeline
from tfx.orchestration.local.local_dag_runner import LocalDagRunner

from sage_tfx.components.block_example_gen import BlockExampleGen, month_schedule
from sage_tfx.components.block_ledger import BlockLedger as BlockLedgerComponent
from sage_tfx.sage_access import BlockLedger

from support.neighbouring import PlatformLog, differences, fingerprint

# The stream's public schedule: four months, the last of which has no trip at all.
SCHEDULE = month_schedule("2024-01", "2024-04")
TRIPS = [(f"2024-0{month}-{day:02d}T{hour:02d}:00:00+00:00", 300 + 17 * day + hour, 1 + day / 10)
         for month in (1, 2, 3) for day in range(1, 29, 3) for hour in (7, 19)]


def _write_trips(directory, trips):
    import datetime as dt
    os.makedirs(directory)
    with open(os.path.join(directory, "trips.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trip_start_timestamp", "trip_seconds", "trip_miles"])
        for moment, seconds, miles in trips:
            writer.writerow([int(dt.datetime.fromisoformat(moment).timestamp()), seconds, miles])


def _ingest_and_grant(root, trips):
    """BlockExampleGen -> BlockLedger on LocalDagRunner, reading the trips from root/../input;
    returns the run's fingerprint."""
    data = os.path.join(os.path.dirname(root), "input")
    for directory in (root, data):
        shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(root)
    store = os.path.join(root, "metadata.sqlite")
    _write_trips(data, trips)
    BlockLedger.create(store, min_request_epsilon=0.05)
    gen = BlockExampleGen(input_base=data, block_key="trip_start_timestamp",
                          block_by="month", schedule_start=SCHEDULE[0], schedule_end=SCHEDULE[1],
                          ledger_store=store, block_epsilon=1.0, block_delta=1e-6)
    grant = BlockLedgerComponent(ledger_store=store, new_blocks=gen.outputs["examples"],
                                 window=2, epsilon=0.4, delta=1e-7,
                                 split={"training": 0.6, "validation": 0.4})
    with PlatformLog() as log:
        LocalDagRunner().run(pipeline.Pipeline(
            pipeline_name="neighbours", pipeline_root=os.path.join(root, "pipeline"),
            components=[gen, grant],
            metadata_connection_config=metadata.sqlite_metadata_connection_config(store)))
    return fingerprint(store, root, log.lines)


@pytest.mark.parametrize("removed", [0, len(TRIPS) - 1])
def test_ingestion_and_grant_store_nothing_that_depends_on_one_record(tmp_path, removed):
    root = str(tmp_path / "run")  # the same path for both runs
    with_record = _ingest_and_grant(root, TRIPS)
    blocks = [b.block_id for b in BlockLedger(os.path.join(root, "metadata.sqlite")).blocks()]
    without_record = _ingest_and_grant(root, TRIPS[:removed] + TRIPS[removed + 1:])
    assert blocks == ["2024-01", "2024-02", "2024-03", "2024-04"]  # the empty month is a block
    found = differences(with_record, without_record)
    assert found == [], "\n".join(found)
    # The comparison sees what it must: ML Metadata's records, blocks.json, the grant's log.
    assert any(a[1] == "sage_tfx.Block" for a in with_record["artifacts"])
    assert any(path.endswith("blocks.json") for path in with_record["files"])
    assert any("charged" in line for line in with_record["logs"])


def _a_training_trip(root, month):
    """(timestamp, seconds) of a trip that BlockExampleGen put in `month`'s train split."""
    import glob

    import tensorflow as tf
    [path] = glob.glob(os.path.join(root, "runs", "BlockExampleGen", "examples", "*", month,
                                    "Split-train", "*"))
    record = next(iter(tf.data.TFRecordDataset([path], compression_type="GZIP")))
    feature = tf.train.Example.FromString(record.numpy()).features.feature
    return (feature["trip_start_timestamp"].int64_list.value[0],
            feature["trip_seconds"].int64_list.value[0])


def _taxi_iteration(root, months, drop_trip, mode):
    """One whole taxi iteration (ingestion included) on `months` of the taxi sample, with the
    trip (timestamp, seconds) `drop_trip` removed (None: all trips)."""
    from sage_tfx.examples.taxi.pipeline import (BLOCK_DELTA, BLOCK_EPSILON, TEST_FRACTION,
                                                 adassp_spec, dp_sgd_spec)
    from sage_tfx.examples.taxi.stream import COLUMNS, TaxiStream
    from sage_tfx.pipelines.adaptive import build_iteration

    data = os.path.join(os.path.dirname(root), "input")
    for directory in (root, data):
        shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(root)
    stream = TaxiStream.load()
    if drop_trip is not None:
        trips = stream.trips_by_month[stream.months[0]]
        [index] = [i for i, trip in enumerate(trips) if (trip[0], trip[3]) == drop_trip]
        del trips[index]
    names = stream.release(months, data)
    store = os.path.join(root, "metadata.sqlite")
    BlockLedger.create(store, min_request_epsilon=0.05)
    start, end = month_schedule(names[0], names[-1])
    ingest = BlockExampleGen(input_base=data, block_key="trip_start_timestamp", block_by="month",
                             schedule_start=start, schedule_end=end, ledger_store=store,
                             block_epsilon=BLOCK_EPSILON, block_delta=BLOCK_DELTA,
                             test_fraction=TEST_FRACTION, columns=COLUMNS)
    spec = (adassp_spec if mode == "adassp" else dp_sgd_spec)(seed=7)
    with PlatformLog() as log:
        LocalDagRunner().run(build_iteration(
            spec, "neighbours", root, store, window=months, epsilon=1.0, ingest=ingest,
            metadata_config=metadata.sqlite_metadata_connection_config(store)))
    return fingerprint(store, root, log.lines)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["adassp", "dp_sgd"])
def test_a_whole_iteration_stores_nothing_that_depends_on_one_record(tmp_path, monkeypatch,
                                                                     mode):
    """Everything a taxi iteration stores or logs, except DP releases (neighbouring.py).

    DP-SGD's sampler releases a DP count n_hat of its records, and the descriptor, the steps
    and the calibrated noise are functions of n_hat: DP releases, but stored everywhere. The
    test couples the two runs the way the privacy proof does: the count's noise absorbs the
    one-record difference, so both runs release the same n_hat (here a fixed value), and then
    nothing else the platform stores or logs may differ."""
    from sage_tfx.components.oblivious_sample_gen import executor as sample_gen_executor

    monkeypatch.setattr(sample_gen_executor, "dp_count", lambda n, epsilon: 700)
    root = str(tmp_path / "run")
    months = 2 if mode == "adassp" else 3
    first = _taxi_iteration(root, months, None, mode)
    from sage_tfx.examples.taxi.stream import TaxiStream
    second = _taxi_iteration(root, months, _a_training_trip(root, TaxiStream.load().months[0]),
                             mode)
    found = differences(first, second)
    assert found == [], "\n".join(found)
