"""The README's plain-Pipeline example (examples/first_pipeline.py) runs on LocalDagRunner, and
re-running the same DAG on the same files fails with an error that says why and how to fix it."""
import os
import sys

import pytest
from tfx.orchestration.local.local_dag_runner import LocalDagRunner

from sage_tfx.examples.first_pipeline import create_pipeline
from sage_tfx.sage_access import BlockLedger, connect

sys.path.insert(0, os.path.dirname(__file__))
from test_pipeline import write_csv  # noqa: E402


@pytest.mark.slow
def test_first_pipeline_runs_and_a_rerun_explains_immutable_blocks(tmp_path):
    root, data = str(tmp_path / "run"), str(tmp_path / "data")
    write_csv(data, trips_per_month=40)
    store = str(tmp_path / "metadata.sqlite")
    BlockLedger.create(store, min_request_epsilon=0.05)  # the ledger comes first
    LocalDagRunner().run(create_pipeline(root, data, ledger_store=store, metadata_path=store,
                                         epochs=1, sample_size=8, seed=1))

    ledger = BlockLedger(store)
    assert [round(b.spent[0], 9) for b in ledger.blocks()] == [0.0, 1.0, 1.0]
    [grant] = ledger.grant_records()
    assert grant["pipeline"] == "first" and grant["blocks"] == ["2024-03", "2024-02"]
    mlmd = connect(store)
    [blessing] = mlmd.get_artifacts_by_type("ModelBlessing")
    outcome = blessing.custom_properties["outcome"].string_value
    assert outcome in ("ACCEPT", "REJECT", "RETRY")
    pushed = os.path.join(root, "serving")
    assert os.path.isdir(pushed) == (outcome == "ACCEPT")

    with pytest.raises(Exception, match="immutable once registered") as failure:
        LocalDagRunner().run(create_pipeline(root, data, ledger_store=store,
                                             metadata_path=store, seed=1))
    assert "new input directory" in str(failure.value)
    assert len(BlockLedger(store).grant_records()) == 1  # the failed run charged nothing


def test_a_date_string_block_key_asks_for_unix_seconds():
    import tensorflow as tf

    from sage_tfx.components.block_example_gen.executor import _key_value

    example = tf.train.Example()
    example.features.feature["trip_start_timestamp"].bytes_list.value.append(b"2024-01-05")
    with pytest.raises(ValueError, match="must be Unix seconds") as failure:
        _key_value(example, "trip_start_timestamp")
    assert "2024-01-05" not in str(failure.value)  # a record's value never reaches a log
    example = tf.train.Example()
    example.features.feature["trip_start_timestamp"].int64_list.value.append(1704067200)
    assert _key_value(example, "trip_start_timestamp") == 1704067200
