"""The suite's components inside an ordinary TFX DAG: TFX's CsvExampleGen feeds BlockExampleGen,
and TFX's Pusher follows the SLAedValidator. Runs on LocalDagRunner; the artifact types fit."""
import os

import pytest
from tfx.components.example_gen.csv_example_gen.component import CsvExampleGen
from tfx.orchestration import metadata
from tfx.orchestration.local.local_dag_runner import LocalDagRunner

from sage_tfx.components.block_example_gen import BlockExampleGen, month_schedule
from sage_tfx.examples.taxi.pipeline import adassp_spec
from sage_tfx.examples.taxi.stream import TaxiStream
from sage_tfx.pipelines.adaptive import build_iteration
from sage_tfx.sage_access import BlockLedger, connect


@pytest.mark.slow
def test_csv_example_gen_feeds_blocks_and_pusher_follows_the_validator(tmp_path):
    months = TaxiStream.load().release(6, str(tmp_path / "csv"))
    store = str(tmp_path / "metadata.sqlite")
    BlockLedger.create(store, min_request_epsilon=0.05, for_tests=True)
    csv_gen = CsvExampleGen(input_base=str(tmp_path / "csv"))
    blocks = BlockExampleGen(input_examples=csv_gen.outputs["examples"],
                             block_key="trip_start_timestamp", ledger_store=store,
                             schedule_start=month_schedule(months[0], months[-1])[0],
                             schedule_end=month_schedule(months[0], months[-1])[1],
                             block_epsilon=2.0, block_delta=1e-6)
    iteration = build_iteration(adassp_spec(seed=5), "mixed", str(tmp_path), store, window=6,
                                epsilon=1.0, ingest=blocks,
                                metadata_config=metadata.sqlite_metadata_connection_config(store))
    iteration.components.insert(0, csv_gen)
    LocalDagRunner().run(iteration)

    # CsvExampleGen's records became one block per month, all granted and charged once.
    assert [b.block_id for b in BlockLedger(store).blocks()] == months
    assert all(b.spent[0] == pytest.approx(1.0) for b in BlockLedger(store).blocks())
    mlmd = connect(store)
    executions = {e.type.rsplit(".", 1)[-1]: e for e in mlmd.get_executions()}
    for name in ("CsvExampleGen", "BlockExampleGen", "BlockLedger", "DPTransform", "DPTrainer",
                 "SLAedValidator", "Pusher"):
        assert executions[name].last_known_state == executions[name].COMPLETE, name
    [blessing] = mlmd.get_artifacts_by_type("ModelBlessing")
    [pushed] = mlmd.get_artifacts_by_type("PushedModel")
    blessed = blessing.custom_properties["blessed"].int_value
    assert pushed.custom_properties["pushed"].int_value == blessed
    assert [a.type for a in mlmd.get_artifacts_by_type("TransformGraph")] == ["TransformGraph"]
