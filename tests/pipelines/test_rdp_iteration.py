"""Issue 17 §1: the taxi AdaSSP iteration runs on an `rdp` ledger, which charges the RDP curve
of the events its grant recorded (before, an rdp ledger refused every pipeline: both trainers
need delta > 0)."""
import json
import os

import pytest
from tfx.orchestration import metadata
from tfx.orchestration.local.local_dag_runner import LocalDagRunner

from sage_tfx.components.dp_trainer import adassp
from sage_tfx.examples.taxi.pipeline import TaxiSource, adassp_spec
from sage_tfx.pipelines.adaptive import build_iteration
from sage_tfx.sage_access import BlockLedger, connect
from sage_tfx.sage_access.accounting import event_from_json, rdp_curve_of
from sage_tfx.sage_access.records import GRANT_TYPE


@pytest.mark.slow
def test_taxi_adassp_iteration_on_an_rdp_ledger(tmp_path):
    store = str(tmp_path / "metadata.sqlite")
    BlockLedger.create(store, accounting="rdp", min_request_epsilon=0.05, for_tests=True)
    TaxiSource(store, str(tmp_path)).ingest(12)
    LocalDagRunner().run(build_iteration(
        adassp_spec(seed=3), "taxi-rdp", str(tmp_path), store, window=12, epsilon=0.5,
        metadata_config=metadata.sqlite_metadata_connection_config(store)))

    mlmd = connect(store)
    [grant] = mlmd.get_executions_by_type(GRANT_TYPE)
    events = {step: event_from_json(event) for step, event in
              json.loads(grant.custom_properties["events"].string_value).items()}
    assert sorted(events) == ["training", "transform", "validation"]
    # The trainer ran the recorded event: its noise multiplier is the one the ledger charged.
    [model] = mlmd.get_artifacts_by_type("Model")
    sigma = float(model.custom_properties["noise_multiplier"].string_value)
    assert events["training"] == adassp.dp_event(sigma)
    ledger = BlockLedger(store)
    charged = rdp_curve_of(list(events.values()), ledger.orders)
    blocks = ledger.blocks()
    assert len(blocks) == 12
    for block in blocks:
        assert list(block.spent) == pytest.approx(list(charged), rel=1e-12)
        assert ledger.accounting.guarantee(block.spent, 2.0, 1e-6) == (2.0, 1e-6)
    assert ledger.audit().problems == []
    [blessing] = mlmd.get_artifacts_by_type("ModelBlessing")
    assert blessing.custom_properties["outcome"].string_value in ("ACCEPT", "RETRY", "REJECT")
    executions = {e.type.rsplit(".", 1)[-1]: e for e in mlmd.get_executions()}
    for name in ("BlockLedger", "DPTransform", "DPTrainer", "SLAedValidator", "Pusher"):
        assert executions[name].last_known_state == executions[name].COMPLETE, name
    # Every share was consumed exactly once.
    uses = mlmd.get_artifacts_by_type("sage_tfx.ShareUse")
    assert sorted(u.custom_properties["step"].string_value for u in uses) == [
        "training", "transform", "validation"]
