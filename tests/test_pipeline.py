"""BlockExampleGen -> BlockLedger -> a consumer on LocalDagRunner, with the ledger in the
pipeline's own ML Metadata store so the charge is linked to the run."""
import csv
import datetime as dt
import json
import os
import sys

import pytest
import tensorflow as tf
from tfx.orchestration import metadata, pipeline
from tfx.orchestration.local.local_dag_runner import LocalDagRunner

from sage_tfx.components.block_example_gen import BlockExampleGen, month_schedule
from sage_tfx.components.block_ledger import BlockLedger as BlockLedgerComponent
from sage_tfx.components.privacy_grant import GrantError, PrivacyGrant, require_grant
from sage_tfx.sage_access import BlockLedger, connect
from sage_tfx.sage_access.records import GRANT_TYPE

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_consumer import GrantChecker  # noqa: E402

MONTHS = ["2024-01", "2024-02", "2024-03"]


def write_csv(directory, trips_per_month=40):
    os.makedirs(directory)
    with open(os.path.join(directory, "trips.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trip_start_timestamp", "trip_seconds", "trip_miles"])
        for month in MONTHS:
            first = dt.datetime.fromisoformat(f"{month}-01T00:00:00+00:00")
            for trip in range(trips_per_month):
                moment = first + dt.timedelta(minutes=(7 * 60 * 40 // trips_per_month) * trip + 60)
                # Duration grows with distance (200 s a mile) plus up to 10 s of jitter.
                miles = 0.5 + (trip % 40) / 10
                writer.writerow([int(moment.timestamp()), 100 + int(200 * miles) + trip * 7 % 11,
                                 miles])


def ingest_and_grant(root: str, store_path: str, trips_per_month: int = 40,
                     block_epsilon: float = 1.0, **grant_options):
    """The first two steps of every sage pipeline on three monthly blocks: BlockExampleGen
    registers the blocks, BlockLedger grants (0.4, 1e-7) on the two most recent unless
    grant_options say otherwise."""
    write_csv(os.path.join(root, "data"), trips_per_month)
    BlockLedger.create(store_path, min_request_epsilon=0.05)
    gen = BlockExampleGen(input_base=os.path.join(root, "data"), block_key="trip_start_timestamp",
                          block_by="month", ledger_store=store_path, block_epsilon=block_epsilon,
                          schedule_start=month_schedule(MONTHS[0], MONTHS[-1])[0],
                          schedule_end=month_schedule(MONTHS[0], MONTHS[-1])[1],
                          block_delta=1e-6)
    options = {"window": 2, "epsilon": 0.4, "delta": 1e-7, **grant_options}
    grant = BlockLedgerComponent(ledger_store=store_path, new_blocks=gen.outputs["examples"],
                                 **options)
    return gen, grant


@pytest.mark.slow
def test_block_pipeline_links_the_charge_to_the_run(tmp_path):
    root = str(tmp_path)
    store_path = os.path.join(root, "metadata.sqlite")
    gen, grant = ingest_and_grant(root, store_path,
                                  split={"training": 0.75, "validation": 0.25})
    checker = GrantChecker(grant=grant.outputs["grant"], examples=grant.outputs["examples"])
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="blocks", pipeline_root=os.path.join(root, "pipeline"),
        components=[gen, grant, checker],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store_path)))

    ledger = BlockLedger(store_path)
    blocks = ledger.blocks()
    assert [b.block_id for b in blocks] == MONTHS
    assert [round(b.spent[0], 9) for b in blocks] == [0.0, 0.4, 0.4]

    store = connect(store_path)
    [grant_execution] = store.get_executions_by_type(GRANT_TYPE)
    grant_id = grant_execution.custom_properties["grant_id"].string_value
    assert json.loads(grant_execution.custom_properties["blocks"].string_value) == ["2024-03", "2024-02"]
    # Lineage: the charge sits in this pipeline run's context, next to the TFX executions.
    run_contexts = [c for c in store.get_contexts_by_execution(grant_execution.id)
                    if c.type == "pipeline_run"]
    assert len(run_contexts) == 1
    run_executions = store.get_executions_by_context(run_contexts[0].id)
    assert any(e.id == grant_execution.id for e in run_executions)
    assert len([e for e in run_executions if e.type != GRANT_TYPE]) >= 3

    [grant_artifact] = store.get_artifacts_by_type(PrivacyGrant.TYPE_NAME)
    assert grant_artifact.custom_properties["grant_id"].string_value == grant_id
    checker_runs = [e for e in run_executions if "GrantChecker" in e.type]
    assert len(checker_runs) == 1  # it ran require_grant on the granted Examples, and passed
    assert checker_runs[0].last_known_state == checker_runs[0].COMPLETE

    # Each block's Examples hold only that block's months; the granted Examples hold both.
    from tfx.types import artifact_utils
    examples = [artifact_utils.deserialize_artifact(store.get_artifact_type("Examples"), a)
                for a in store.get_artifacts_by_type("Examples")]
    granted = [e for e in examples if e.get_string_custom_property("sage_grant_id") == grant_id]
    per_block = [e for e in examples if e.get_string_custom_property("block_id")]
    assert sorted(e.get_string_custom_property("block_id") for e in per_block) == MONTHS
    for block_examples in per_block:  # every record written, and no count stored anywhere
        written = 0
        for split in ("train", "test"):
            files = tf.io.gfile.glob(os.path.join(block_examples.uri, f"Split-{split}", "*"))
            written += sum(1 for _ in tf.data.TFRecordDataset(files, compression_type="GZIP"))
        assert written == 40
        names = set(block_examples.mlmd_artifact.custom_properties)
        assert {"block_id", "block_start", "block_end"} <= names
        assert not [name for name in names if "count" in name]
    assert len(granted) == 1
    assert sorted(os.listdir(os.path.join(granted[0].uri, "Split-train"))) == [
        "2024-02-data_tfrecord-00000-of-00001.gz", "2024-03-data_tfrecord-00000-of-00001.gz"]

    # A DP component refuses Examples without a grant, and a grant the ledger did not issue.
    grant_obj = artifact_utils.deserialize_artifact(
        store.get_artifact_type(PrivacyGrant.TYPE_NAME), grant_artifact)
    with pytest.raises(GrantError, match="without a grant"):
        require_grant([grant_obj], [per_block[0]])
    grant_obj.set_string_custom_property("epsilon", "4.0")
    with pytest.raises(GrantError, match="does not match the ledger"):
        require_grant([grant_obj], granted)
