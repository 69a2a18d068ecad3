"""The MatrixMechanism executor on a real SQLite ledger: the BlockLedger executor grants, the
component spends its share once and writes CSV, Parquet and the guarantee in MLMD properties."""
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from tfx.types import standard_artifacts

from sage_tfx.components.block_ledger import executor as ledger_executor
from sage_tfx.components.matrix_mechanism import WorkloadAnswers, executor
from sage_tfx.components.privacy_grant import GrantError, PrivacyGrant
from sage_tfx.sage_access import BlockLedger
from support.trip_blocks import TRIP_SPEC, write_block

SPEC = json.dumps(TRIP_SPEC)


@pytest.fixture
def granted(store_path, tmp_path):
    ledger = BlockLedger.create(store_path, min_request_epsilon=0.05)
    for block_id in ("2024-01", "2024-02"):
        data = str(tmp_path / block_id)
        write_block(data)
        ledger.add_block(block_id, 2.0, 1e-6, data_uri=data)
    examples, grant = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant.uri = str(tmp_path / "examples"), str(tmp_path / "grant")
    ledger_executor.Executor().Do({}, {"examples": [examples], "grant": [grant]}, {
        "ledger_store": store_path, "ledger_context": "default", "epsilon": 1.0,
        "delta": 1e-7, "window": 2, "split": json.dumps({"statistics": 1})})
    return examples, grant


def _run(granted, tmp_path, name="answers"):
    answers = WorkloadAnswers()
    answers.uri = str(tmp_path / name)
    examples, grant = granted
    executor.Executor().Do({"examples": [examples], "grant": [grant]}, {"answers": [answers]},
                           {"workload_spec": SPEC, "grant_step": "statistics",
                            "strategy_cache": str(tmp_path / "strategies")})
    return answers


def test_answers_are_written_with_their_errors_and_guarantee(granted, tmp_path):
    answers = _run(granted, tmp_path)
    table = pq.read_table(os.path.join(answers.uri, "answers.parquet")).to_pydict()
    assert len(table["query"]) == 6 + 6
    assert os.path.exists(os.path.join(answers.uri, "answers.csv"))
    query_rmse = json.loads(answers.get_string_custom_property("query_rmse"))
    assert np.allclose(query_rmse, table["expected_rmse"])
    assert answers.get_float_custom_property("epsilon") == pytest.approx(1.0)
    assert "adding or removing one record" in answers.get_string_custom_property("guarantee")
    assert np.sqrt(np.mean(np.square(query_rmse))) == pytest.approx(
        answers.get_float_custom_property("expected_rmse"))


def test_the_strategy_is_kept_for_the_next_run_under_the_pipeline_root(granted, tmp_path):
    _run(granted, tmp_path)
    # The candidates that took a solve are kept (Eigen-Design, the convex optimum: selection.py).
    assert {p.suffix for p in (tmp_path / "strategies").iterdir()} == {".npz"}
    assert executor.pipeline_strategy_cache("/runs/root/MatrixMechanism/answers/7/") == \
        "/runs/root/strategies"


def test_the_share_is_spent_once(granted, tmp_path):
    _run(granted, tmp_path)
    with pytest.raises(GrantError):
        _run(granted, tmp_path, "again")
    assert not os.path.exists(tmp_path / "again" / "answers.csv")


@pytest.mark.slow
def test_the_component_runs_in_a_tfx_pipeline_after_a_grant(tmp_path):
    """BlockExampleGen -> BlockLedger -> MatrixMechanism on LocalDagRunner and real MLMD."""
    from tfx.orchestration import metadata, pipeline
    from tfx.orchestration.local.local_dag_runner import LocalDagRunner
    from tfx.types import artifact_utils

    from sage_tfx.components import MatrixMechanism
    from sage_tfx.sage_access import connect
    from support.ingest import ingest_and_grant

    root = str(tmp_path)
    store_path = os.path.join(root, "metadata.sqlite")
    gen, grant = ingest_and_grant(root, store_path, split={"statistics": 1})
    spec = json.dumps({"attributes": [
        {"name": "seconds", "feature": "trip_seconds", "bins": [0, 300, 600, 900, 1200]},
        {"name": "miles", "feature": "trip_miles", "bins": [0, 1, 2, 3, 5]}],
        "queries": [{"kind": "range_marginals", "way": 2}]})
    answers = MatrixMechanism(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                              workload_spec=spec)
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="statistics", pipeline_root=os.path.join(root, "pipeline"),
        components=[gen, grant, answers],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store_path)))
    store = connect(store_path)
    [answer] = [artifact_utils.deserialize_artifact(store.get_artifact_type(
        WorkloadAnswers.TYPE_NAME), a) for a in store.get_artifacts_by_type(
        WorkloadAnswers.TYPE_NAME)]
    table = pq.read_table(os.path.join(answer.uri, "answers.parquet")).to_pydict()
    assert len(table["query"]) == 10 * 10 == answer.get_int_custom_property("queries")
    assert answer.get_float_custom_property("epsilon") == pytest.approx(0.4)
    assert "GaussianDpEvent" in answer.get_string_custom_property("event")
