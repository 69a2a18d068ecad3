"""Issue 29: each statistics component in a real TFX pipeline (LocalDagRunner, ML Metadata on
SQLite, Beam's DirectRunner) on two inputs that differ by one unit gives identical everything
a reader can see except the DP values: ML Metadata (the artifacts' custom properties, the
ledger's blocks, grants with their split, blocks, outcome and front door, share uses, pins,
denials), every file under the run's directory (the releases' file sets, headers, Parquet
schemas and guarantee metadata, their public columns, the guarantee sidecars), and the
platform's console lines. tests/support/neighbouring.py says what is compared; the DP values
masked here are the releases' noisy cells (and, for the continual release, its rows: which
keys pass its DP threshold).

The extra unit is ordinary, or its records hold bad values (outside the public groups and
bins, NaN, infinite, huge or unreadable): the record rule maps each record alone, so neither
may change anything but the DP values."""
import csv
import datetime as dt
import hashlib
import os
import re
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from sage_tfx.dp_statistics.matrix.strategy import _cached_eigen_design
from support.neighbouring import (PlatformLog, differences, fingerprint, masked_table,
                                  normalize)

pytestmark = pytest.mark.slow


def _write_csv(directory, header, rows):
    os.makedirs(directory)
    with open(os.path.join(directory, "records.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return directory


def _run(root, components, store):
    """Run `components` as one pipeline under root/pipeline; the platform's log lines."""
    from tfx.orchestration import metadata, pipeline
    from tfx.orchestration.local.local_dag_runner import LocalDagRunner

    with PlatformLog() as log:
        LocalDagRunner().run(pipeline.Pipeline(
            pipeline_name="neighbours", pipeline_root=os.path.join(root, "pipeline"),
            components=components,
            metadata_connection_config=metadata.sqlite_metadata_connection_config(store)))
    return log.lines


# --- DPAggregate: BlockExampleGen (blocks of 15 users) -> BlockLedger -> DPAggregate ---------
AGGREGATE_COLUMNS = {"uid": "int", "area": "int", "fare": "float", "ts": "int"}
AGGREGATE_QUERY = (
    "SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1, public_groups = (1, 2)) "
    "area, ANON_COUNT(*) AS trips, ANON_AVG(fare, 0, 40) AS mean_fare FROM trips "
    "WHERE fare > 0 GROUP BY area")
AGGREGATE_ROWS = [[i % 29, 1 + i % 2, 5 + i % 9, 1388534400 + 3600 * i] for i in range(120)]
AGGREGATE_EXTRA = {  # unit 29, in the second block of users [15, 30)
    "ordinary": [[29, 2, 12, 1388534400], [29, 2, 30, 1388538000]],
    "bad values": [[29, 7, "NaN", 1388534400], [29, 1, "1e308", 0], [29, "north", "-inf", ""],
                   [29, 2, "twelve", 1388534400]],
}


def _dp_aggregate(data, store):
    from sage_tfx.components import BlockExampleGen, BlockLedger
    from sage_tfx.components.dp_aggregate import DPAggregate

    gen = BlockExampleGen(input_base=data, block_key="uid", block_by="users", users_per_block=15,
                          schedule_start=0, schedule_end=30, ledger_store=store,
                          block_epsilon=2.0, block_delta=1e-5)
    grant = BlockLedger(ledger_store=store, new_blocks=gen.outputs["examples"], window=2,
                        epsilon=1.0, delta=1e-6, split=DPAggregate.split(
                            AGGREGATE_QUERY, "uid", AGGREGATE_COLUMNS, 1.0, 1e-6))
    aggregate = DPAggregate(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                            query=AGGREGATE_QUERY, unit_column="uid", columns=AGGREGATE_COLUMNS)
    return [gen, grant, aggregate]


# --- MatrixMechanism: BlockExampleGen (months) -> BlockLedger -> MatrixMechanism -------------
MATRIX_HEADER = ["trip_start_timestamp", "trip_seconds", "trip_miles"]
MATRIX_SPEC = (
    '{"attributes": [{"name": "seconds", "feature": "trip_seconds", "bins": [0, 300, 600, 900]},'
    ' {"name": "miles", "feature": "trip_miles", "bins": [0, 1, 2, 5]}],'
    ' "queries": [{"kind": "range_marginals", "way": 2}]}')
MARCH = int(dt.datetime(2024, 3, 10, tzinfo=dt.timezone.utc).timestamp())  # a granted month
MATRIX_EXTRA = {  # one record is one unit (blocks cut by time, Examples)
    "ordinary": [[MARCH, 420, 1.5]],
    "bad values": [[MARCH, "1e308", "NaN"]],
}


def _matrix_rows():
    from support.ingest import MONTHS

    rows = []
    for month in MONTHS:
        first = int(dt.datetime.fromisoformat(f"{month}-01T00:00:00+00:00").timestamp())
        rows += [[first + 3600 * (1 + 7 * trip), 100 + 23 * trip, 0.5 + trip / 10]
                 for trip in range(30)]
    return rows


def _monthly_statistics_grant(data, store):
    """BlockExampleGen's monthly blocks and a grant of two of them, all to 'statistics'."""
    from sage_tfx.components import BlockExampleGen, BlockLedger
    from sage_tfx.components.block_example_gen import month_schedule
    from support.ingest import MONTHS

    start, end = month_schedule(MONTHS[0], MONTHS[-1])
    gen = BlockExampleGen(input_base=data, block_key="trip_start_timestamp", block_by="month",
                          ledger_store=store, block_epsilon=1.0, schedule_start=start,
                          schedule_end=end, block_delta=1e-6)
    grant = BlockLedger(ledger_store=store, new_blocks=gen.outputs["examples"], window=2,
                        epsilon=0.4, delta=1e-7, split={"statistics": 1})
    return gen, grant


def _matrix_mechanism(data, store):
    from sage_tfx.components import MatrixMechanism

    gen, grant = _monthly_statistics_grant(data, store)
    answers = MatrixMechanism(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                              workload_spec=MATRIX_SPEC)
    return [gen, grant, answers]


# --- ContinualRelease: CsvExampleGen -> ContinualRelease (charges the window's grant) ---------
JAN, FEB = 1356998400, 1359676800  # 2013-01-01, 2013-02-01 UTC
WEEK = 7 * 86400
CONTINUAL_COLUMNS = {"uid": "string", "key": "string", "time": "int"}
# Records in the first half of January only: micro-batches 2-4 of 4 are empty.
CONTINUAL_ROWS = [[f"u{user}", "busy" if user % 3 else "calm", JAN + day * 86400 + user]
                  for day in range(7) for user in range(60)]
CONTINUAL_EXTRA = {  # records in otherwise empty micro-batches, under a key no one else has
    "ordinary": [["intruder", "secret", JAN + 3 * WEEK], ["intruder", "busy", FEB + 2 * WEEK]],
    # "soon": CsvExampleGen then reads every record's time as text (the record rule reads
    # each one's number back).
    "bad values": [["intruder", "", JAN + 3 * WEEK], ["intruder", "busy", 2 ** 62],
                   ["intruder", "secret\x00", FEB + 2 * WEEK], ["intruder", "busy", "soon"]],
}


def _continual_release(data, store, through=None):
    from tfx.components import CsvExampleGen

    from sage_tfx.components.continual_release import ContinualRelease
    from sage_tfx.sage_access import BlockLedger

    ledger = BlockLedger(store)
    for block, start, end in (("s.2013-01", "2013-01-01", "2013-02-01"),
                              ("s.2013-02", "2013-02-01", "2013-03-01")):
        ledger.add_block(block, 10.0, 1e-4, f"{start}T00:00:00+00:00", f"{end}T00:00:00+00:00")
    records = CsvExampleGen(input_base=data)
    release = ContinualRelease(
        examples=records.outputs["examples"], ledger_store=store,
        window_blocks=["s.2013-01", "s.2013-02"], epsilon=4.0, delta=1e-5, micro_batches=4,
        columns=CONTINUAL_COLUMNS, unit_column="uid", key_column="key", time_column="time",
        contribution_limit=4, through=through)
    return [records, release]


# --- DPStatisticsGen: BlockExampleGen (months) -> BlockLedger -> DPStatisticsGen ------------
STATISTICS_HEADER = ["trip_start_timestamp", "fare", "company"]
STATISTICS_EXTRA = {  # one record is one unit (blocks cut by time)
    "ordinary": [[MARCH, 12.5, "Secret Cab"]],
    "bad values": [[MARCH, "NaN", ""]],  # a fare that is not finite, no company: missing
}


def _statistics_rows():
    return [[time, seconds / 100, ["Flash Cab", "Blue Cab"][trip % 2]]
            for trip, (time, seconds, _) in enumerate(_matrix_rows())]


def _dp_statistics_gen(data, store):
    from sage_tfx.components import DPStatisticsGen

    gen, grant = _monthly_statistics_grant(data, store)
    statistics = DPStatisticsGen(examples=grant.outputs["examples"],
                                 grant=grant.outputs["grant"],
                                 columns={"fare": "float", "company": "string"},
                                 bounds={"fare": (0, 10)})
    return [gen, grant, statistics]


def _masked_statistics(path):
    """A DPStatisticsGen release (FeatureStats.pb): its public structure (datasets, features,
    types, the histograms' kinds and sizes); every number, and which string values partition
    selection released, are DP."""
    from tensorflow_metadata.proto.v0 import statistics_pb2

    with open(path, "rb") as handle:
        released = statistics_pb2.DatasetFeatureStatisticsList.FromString(handle.read())
    return [(dataset.name, [(list(f.path.step), f.type, f.WhichOneof("stats"),
                             [(h.type, len(h.buckets)) for h in f.num_stats.histograms])
                            for f in dataset.features]) for dataset in released.datasets]


# component: (CSV header, base rows, extra units, pipeline builder, released files (a path
# pattern), their public columns: None when the rows themselves are DP)
COMPONENTS = {
    "DPAggregate": (list(AGGREGATE_COLUMNS), AGGREGATE_ROWS, AGGREGATE_EXTRA, _dp_aggregate,
                    r"/release\.(csv|parquet)$", {"area"}),
    "MatrixMechanism": (MATRIX_HEADER, _matrix_rows(), MATRIX_EXTRA, _matrix_mechanism,
                        r"/answers\.(csv|parquet)$", {"query", "expected_rmse"}),
    "ContinualRelease": (list(CONTINUAL_COLUMNS), CONTINUAL_ROWS, CONTINUAL_EXTRA,
                         _continual_release, r"/release(-\d+)?\.(csv|parquet)$", None),
    "DPStatisticsGen": (STATISTICS_HEADER, _statistics_rows(), STATISTICS_EXTRA,
                        _dp_statistics_gen, r"/FeatureStats\.pb$", None),
    # A live stream's run through January's triggers: the extra unit's February record waits
    # in the state (waiting.parquet) for the next run.
    "ContinualRelease through January": (
        list(CONTINUAL_COLUMNS), CONTINUAL_ROWS, CONTINUAL_EXTRA,
        lambda data, store: _continual_release(data, store, through=FEB),
        r"/release(-\d+)?\.(csv|parquet)$", None),
}


# ContinualRelease's state artifact: the operator's private state (noise key, exact counts,
# waiting records; owner-only files) for the next run, inside the platform like the records.
PRIVATE_STATE = re.compile(r"/ContinualRelease/state/\d+/(state/|waiting\.parquet$)")
# TFX's CsvExampleGen (the continual release's documented input) stores its input files' size
# and modification times in ML Metadata ("total_bytes:...,xor_checksum:..."): the input's byte
# count depends on the data. TFX's component, not the platform's: masked here, known.
TFX_INPUT_FINGERPRINT = "custom_properties.input_fingerprint"


def _masked_release(path, root, public_columns):
    """A released CSV or Parquet file: its header (Parquet: its schema, with pandas' column
    types and the guarantee in its metadata) and its public cells."""
    if path.endswith(".csv"):
        with open(path, newline="") as handle:
            header, *rows = csv.reader(handle)
        return masked_table(header, rows, public_columns)
    table = pq.read_table(path)
    metadata = {key.decode(): normalize(value.decode(), root)
                for key, value in table.schema.metadata.items()}
    return [str(table.schema.remove_metadata()), metadata,
            *masked_table(table.column_names, [list(row.values()) for row in table.to_pylist()],
                          public_columns)]


def _strategy(path):
    """A cached matrix strategy (chosen from the public workload before any record is read):
    its arrays, but for how long choosing it took (wall time, different in every run)."""
    with np.load(path, allow_pickle=False) as stored:
        return {name: hashlib.sha256(stored[name].tobytes()).hexdigest()
                for name in stored.files if name != "selection_seconds"}


def run_component(root, component, rows):
    """A fresh ledger and one pipeline run of `component` on `rows`; its fingerprint with the
    DP values masked (the input CSV lies outside the compared directory)."""
    from sage_tfx.sage_access import BlockLedger

    header, _, _, build, released, public_columns = COMPONENTS[component]
    for directory in (root, root + "-input"):
        shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(root)
    store = os.path.join(root, "metadata.sqlite")
    BlockLedger.create(store, min_request_epsilon=0.05)
    data = _write_csv(root + "-input", header, rows)
    # Each run as in a fresh process: the strategy is not remembered from the previous run
    # (then only the first would write its strategy file).
    _cached_eigen_design.cache_clear()
    lines = _run(root, build(data, store), store)
    found = fingerprint(store, root, lines)
    real_paths = {normalize(os.path.join(directory, name), root): os.path.join(directory, name)
                  for directory, _, names in os.walk(root) for name in names}
    for path in found["files"]:
        if path.endswith("/FeatureStats.pb"):
            found["files"][path] = _masked_statistics(real_paths[path])
        elif re.search(released, path):
            found["files"][path] = _masked_release(real_paths[path], root, public_columns)
        elif PRIVATE_STATE.search(path):
            found["files"][path] = "<private state>"
        elif path.endswith(".npz"):
            found["files"][path] = _strategy(real_paths[path])
    for section in ("artifacts", "executions"):
        for properties in (entry[-1] for entry in found[section]):
            if TFX_INPUT_FINGERPRINT in properties:
                properties[TFX_INPUT_FINGERPRINT] = "<TFX's record of the input files>"
    return found


@pytest.mark.parametrize("extra", ["ordinary", "bad values"])
@pytest.mark.parametrize("component", list(COMPONENTS))
def test_one_unit_more_changes_nothing_but_the_dp_values(tmp_path, component, extra):
    _, rows, extra_units, _, released, _ = COMPONENTS[component]
    root = str(tmp_path / "run")  # the same path for both runs
    first = run_component(root, component, rows)
    second = run_component(root, component, extra_units[extra] + rows)
    found = differences(first, second)
    assert found == [], "\n".join(found)
    # The comparison sees what it must: the releases, the grant's outcome, the console line.
    releases = [path for path in first["files"] if re.search(released, path)]
    if component == "DPStatisticsGen":  # TFDV's format: one FeatureStats.pb per split
        assert len(releases) == 2 and all(isinstance(first["files"][path], list)
                                          for path in releases), sorted(first["files"])
    else:
        assert any(path.endswith(".csv") for path in releases), sorted(first["files"])
        assert any(path.endswith(".parquet") for path in releases)
        assert any(path.endswith(".csv.guarantee.json") for path in first["files"])
    outcomes = [a[-1] for a in first["artifacts"] if a[1] == "sage_tfx.ReleaseOutcome"]
    # A window's outcome is recorded once its last trigger is released.
    assert outcomes == [] if "through" in component else "released" in outcomes[0].values()
    if component.startswith("ContinualRelease"):  # written whether or not a record waits
        assert any(path.endswith("/waiting.parquet") for path in first["files"])
    assert any(line.startswith(f"{component.split()[0]}: ") for line in first["logs"]), \
        first["logs"]
