"""ContinualRelease in real TFX pipelines (LocalDagRunner, ML Metadata on SQLite): two successive
runs of one pipeline over a window of two monthly blocks, the state carried from the first run
to the second as an artifact (resolved as the latest), one grant for both runs; the pipeline
compiles for Kubeflow V2."""
import csv
import json
import os

import pandas as pd
import pyarrow.parquet as pq
import pytest

JAN, FEB = 1356998400, 1359676800  # 2013-01-01, 2013-02-01 UTC
COLUMNS = {"uid": "string", "key": "string", "time": "int"}
BLOCKS = ["s.2013-01", "s.2013-02"]


def test_construction_refuses_a_bad_query():
    from sage_tfx.components.continual_release import ContinualRelease
    from tfx.types import channel, standard_artifacts

    examples = channel.Channel(type=standard_artifacts.Examples)
    with pytest.raises(ValueError, match="unknown column"):
        ContinualRelease(examples=examples, ledger_store="x.sqlite", window_blocks=BLOCKS,
                         epsilon=1.0, delta=1e-6, micro_batches=4, columns=COLUMNS,
                         unit_column="user", key_column="key", time_column="time")
    with pytest.raises(ValueError, match="mechanism must be one of"):
        ContinualRelease(examples=examples, ledger_store="x.sqlite", window_blocks=BLOCKS,
                         epsilon=1.0, delta=1e-6, micro_batches=4, columns=COLUMNS,
                         unit_column="uid", key_column="key", time_column="time",
                         mechanism="wavelet")


def write_month(directory, first_second, other=None, users=200):
    """A month of key "busy" (each user once a week) and 200 other users' records of key
    `other` = (key, time): one each, arriving with this month's files."""
    os.makedirs(directory)
    with open(os.path.join(directory, "records.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(list(COLUMNS))
        for week in range(4):
            for user in range(users):
                writer.writerow([f"u{user}", "busy", first_second + week * 7 * 86400 + user])
        if other is not None:
            key, time = other
            writer.writerows([f"{key}{user}", key, time + user] for user in range(200))
    return str(directory)


def run(tmp_path, store, data, through, first, mechanism="auto"):
    from tfx.components import CsvExampleGen
    from tfx.orchestration import metadata, pipeline
    from tfx.orchestration.local.local_dag_runner import LocalDagRunner

    from sage_tfx.components.continual_release import ContinualRelease, previous_state

    records = CsvExampleGen(input_base=data)
    previous = [] if first else [previous_state()]  # the window's first run has no state
    release = ContinualRelease(
        examples=records.outputs["examples"],
        previous_state=previous[0].outputs["state"] if previous else None,
        ledger_store=store, window_blocks=BLOCKS, epsilon=4.0, delta=1e-5, micro_batches=4,
        columns=COLUMNS, unit_column="uid", key_column="key", time_column="time",
        contribution_limit=8, mechanism=mechanism, through=through)
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="continual", pipeline_root=str(tmp_path / "pipeline"),
        components=[records, *previous, release],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store)))


@pytest.mark.slow
def test_two_runs_carry_the_state_and_charge_once(tmp_path):
    from tfx.orchestration import metadata

    from sage_tfx.sage_access import BlockLedger

    store = str(tmp_path / "metadata.sqlite")
    BlockLedger.create(store)
    ledger = BlockLedger(store)
    # The window's blocks, registered by their public schedule before their records arrive.
    for block, start, end in (("s.2013-01", "2013-01-01", "2013-02-01"),
                              ("s.2013-02", "2013-02-01", "2013-03-01")):
        ledger.add_block(block, 10.0, 1e-4, f"{start}T00:00:00+00:00", f"{end}T00:00:00+00:00")

    # Early: February records that arrive with January's files wait in the state for their
    # trigger. Late: January records that arrive after January's triggers ran are dropped.
    # "arrived-early" is released after "busy" but sorts before it: releases are in key order,
    # not in the order keys first appeared (which a neighbouring stream can swap).
    run(tmp_path, store, write_month(tmp_path / "january", JAN,
                                     ("arrived-early", FEB + 3 * 86400)),
        through=FEB, first=True, mechanism="tree")
    [grant] = ledger.grant_records()
    run(tmp_path, store, write_month(tmp_path / "february", FEB, ("late", JAN + 5 * 86400)),
        through=None, first=False, mechanism="tree")
    assert [g["grant_id"] for g in ledger.grant_records()] == [grant["grant_id"]]

    with metadata.Metadata(metadata.sqlite_metadata_connection_config(store)) as m:
        states = m.store.get_artifacts_by_type("sage_tfx.ContinualReleaseState")
        statistics = m.store.get_artifacts_by_type("sage_tfx.DPStatistics")
    assert [s.custom_properties["committed_step"].int_value for s in states] == [2, 4]
    assert {s.custom_properties["grant_id"].string_value for s in states} == {
        grant["grant_id"]}
    first, second = statistics
    props = {k: v.string_value for k, v in second.custom_properties.items()}
    assert props["unit"] == "all rows of one uid within the blocks read"
    assert props["guarantee"].endswith("on blocks s.2013-01, s.2013-02")
    assert "binary trees with Honaker's estimator" in props["guarantee"]  # as asked
    assert float(props["epsilon"]) == 4.0 and props["grant_id"] == grant["grant_id"]
    assert json.loads(props["columns"]) == ["key", "value", "updated"]
    # The second run resumed: triggers 1-2 are the first run's files, bit for bit.
    for trigger in (1, 2):
        name = f"release-{trigger:06d}.csv"
        with open(os.path.join(first.uri, "triggers", name), "rb") as one, \
                open(os.path.join(second.uri, "triggers", name), "rb") as two:
            assert one.read() == two.read()
    # 200 users x 4 records a month, C = 8: all 1,600 records count. At (4, 1e-5), T = 4, C = 8
    # every micro-batch's 200 distinct users exceed the required count R(l) <= tau_l + 10 std
    # of Z(l) <= 62 + 105, so the key is released at every trigger with all records so far
    # (a miss: below 1e-20); the value noise's std is <= 30, so 200 is > 6 std (false failure
    # below 1e-8).
    final = pd.read_csv(os.path.join(second.uri, "release.csv")).set_index("key")
    assert abs(final.loc["busy", "value"] - 1600) < 200
    assert "arrived-early" in final.index and abs(final.loc["arrived-early", "value"] - 200) < 200
    assert "late" not in final.index
    assert list(final.index) == ["arrived-early", "busy"]
    parquet = pq.read_table(os.path.join(second.uri, "release.parquet")).to_pandas()
    assert list(parquet["key"]) == ["arrived-early", "busy"]
    # The state artifact is private: the waiting records and the state readable by the owner.
    assert os.stat(os.path.join(states[0].uri, "waiting.parquet")).st_mode & 0o777 == 0o600
    assert os.stat(os.path.join(states[0].uri, "state")).st_mode & 0o777 == 0o700


def test_the_pipeline_compiles_for_kubeflow_v2(tmp_path):
    from tfx.components import CsvExampleGen
    from tfx.orchestration import pipeline

    from sage_tfx.components.continual_release import ContinualRelease, previous_state
    from sage_tfx.pipelines.kubeflow import compile_kubeflow

    records = CsvExampleGen(input_base="gs://bucket/new-records")
    previous = previous_state()
    release = ContinualRelease(
        examples=records.outputs["examples"], previous_state=previous.outputs["state"],
        ledger_store="grpc://metadata:8080", window_blocks=BLOCKS, epsilon=4.0, delta=1e-5,
        micro_batches=4, columns=COLUMNS, unit_column="uid", key_column="key",
        time_column="time")
    job = compile_kubeflow(pipeline.Pipeline(
        pipeline_name="continual", pipeline_root="gs://bucket/root",
        components=[records, previous, release]), str(tmp_path / "job.json"), "image")
    text = json.dumps(job)
    assert "sage_tfx.ContinualReleaseState" in text and "sage_tfx.DPStatistics" in text
