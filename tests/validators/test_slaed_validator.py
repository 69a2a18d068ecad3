"""SLAedValidator on LocalDagRunner: AdaSSP model -> DP validation -> ModelBlessing, and TFX's
Pusher pushing only a blessed model."""
import os

import pytest
from tfx.components.pusher.component import Pusher
from tfx.orchestration import metadata, pipeline
from tfx.orchestration.local.local_dag_runner import LocalDagRunner
from tfx.proto import pusher_pb2
from tfx.types import artifact_utils

from sage_tfx.components.dp_trainer import DPTrainer
from sage_tfx.sage_access import BlockLedger, connect
from sage_tfx.validators.component import SLAedValidator

from support import TRIP_MODULE
from support.ingest import ingest_and_grant


@pytest.mark.slow
def test_validator_blesses_only_on_accept_and_pusher_follows(tmp_path):
    root = str(tmp_path)
    store_path = os.path.join(root, "metadata.sqlite")
    # The validators' noise cannot be seeded (OpenDP draws from the OS CSPRNG), so each gets
    # epsilon 1.6: its sum's Laplace scale (2 x 5000 / 1.6 = 6,250) is small against the sum of
    # about 800 losses near 1,100, and the outcomes below hold far beyond the validator's own
    # 2.5% failure probability (at epsilon 0.09 each they flipped to RETRY in about 1 run in 2).
    gen, grant = ingest_and_grant(root, store_path, trips_per_month=2000,
                                  block_epsilon=4.0, epsilon=4.0,
                                  split={"training": 0.2, "validation": 0.4, "check": 0.4})
    trainer = DPTrainer(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                        module_file=TRIP_MODULE, mode="adassp", feature_bound=5.0, label_bound=1000.0,
                        seed=1)
    # Durations are 100 s + 200 s a mile + jitter (variance 10 s^2); AdaSSP at the training
    # share (0.8) reaches an MSE of about 1,100 (naive: 53,000).
    components = [gen, grant, trainer]
    outcomes = {"loose": (4000.0, "validation"), "strict": (5.0, "check")}
    for name, (target, step) in outcomes.items():
        validator = SLAedValidator(model=trainer.outputs["model"],
                                   examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                                   module_file=TRIP_MODULE, metric="loss", target=target,
                                   confidence=0.95, loss_bound=5000.0,
                                   grant_step=step).with_id(f"validator_{name}")
        pusher = Pusher(model=trainer.outputs["model"],
                        model_blessing=validator.outputs["blessing"],
                        push_destination=pusher_pb2.PushDestination(
                            filesystem=pusher_pb2.PushDestination.Filesystem(
                                base_directory=os.path.join(root, "pushed", name)))
                        ).with_id(f"pusher_{name}")
        components += [validator, pusher]
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="validation", pipeline_root=os.path.join(root, "pipeline"),
        components=components,
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store_path)))

    store = connect(store_path)
    blessing_type = store.get_artifact_type("ModelBlessing")
    blessings = [artifact_utils.deserialize_artifact(blessing_type, a)
                 for a in store.get_artifacts_by_type("ModelBlessing")]
    by_target = {float(b.get_string_custom_property("target")): b for b in blessings}
    loose, strict = by_target[4000.0], by_target[5.0]
    assert loose.get_string_custom_property("outcome") == "ACCEPT"
    assert loose.get_int_custom_property("blessed") == 1
    assert os.path.exists(os.path.join(loose.uri, "BLESSED"))
    assert float(loose.get_string_custom_property("upper_bound")) <= 4000.0
    assert strict.get_string_custom_property("outcome") == "REJECT"
    assert strict.get_int_custom_property("blessed") == 0
    assert float(strict.get_string_custom_property("lower_bound")) > 5.0
    for blessing in (loose, strict):
        assert float(blessing.get_string_custom_property("epsilon_used")) == pytest.approx(4.0 * 0.4)
    # Pusher (TFX's own) pushed the accepted model only.
    assert os.listdir(os.path.join(root, "pushed", "loose"))
    assert not os.path.exists(os.path.join(root, "pushed", "strict"))
    # The validation spent nothing beyond the grant: the blocks were charged 4.0 once.
    assert [round(b.spent[0], 9) for b in BlockLedger(store_path).blocks()] == [0.0, 4.0, 4.0]


def test_bad_parameters_are_refused_when_the_pipeline_is_built():
    common = dict(model=None, examples=None, grant=None, module_file=TRIP_MODULE)
    with pytest.raises(ValueError, match="outside"):
        SLAedValidator(metric="accuracy", target=1.5, **common)
    with pytest.raises(ValueError, match="loss_bound"):
        SLAedValidator(metric="loss", target=0.5, loss_bound=0.0, **common)
    with pytest.raises(ValueError, match="confidence"):
        SLAedValidator(metric="loss", target=0.5, loss_bound=1.0, confidence=1.0, **common)
    with pytest.raises(ValueError, match="unknown metric"):
        SLAedValidator(metric="auc", target=0.5, **common)
