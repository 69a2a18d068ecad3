"""The BlockLedger component refuses, before charging: blocks that hold no data, and a grant
whose consumers (DPTrainer, SLAedValidator) would fail after the charge."""
import functools
import json
import subprocess
import sys

import pytest
from tfx.types import standard_artifacts

from sage_tfx.components.block_ledger import executor
from sage_tfx.components.privacy_grant import PrivacyGrant
from sage_tfx.sage_access import BlockLedger
from sage_tfx.sage_access.errors import BadRequest, BudgetExhausted

from support import TRIP_MODULE
from support.calls import recorded_calls


@pytest.mark.parametrize("selector, refusal", [
    ({"block_ids": '["with-data", "no-data"]'}, "no-data.*nothing was charged"),
    # A window takes only blocks holding Examples: one is too few for it.
    ({"window": 2}, "only 1 live block.*of examples.*the window needs 2")],
    ids=["explicit blocks", "window"])
def test_blocks_without_data_are_refused_and_nothing_is_charged(store_path, tmp_path, selector,
                                                                refusal):
    """The ledger checks the blocks the grant takes, in its transaction (require_data)."""
    ledger = BlockLedger.create(store_path, min_request_epsilon=0.05)
    ledger.add_block("with-data", 1.0, 1e-6, data_uri=str(tmp_path / "with-data"))
    ledger.add_block("no-data", 1.0, 1e-6)
    examples, grant = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant.uri = str(tmp_path / "out-examples"), str(tmp_path / "out-grant")
    properties = {"ledger_store": store_path, "ledger_context": "default", "epsilon": 0.3,
                  "delta": 0.0, "split": '{"all": 1.0}', **selector}
    with pytest.raises((BadRequest, BudgetExhausted), match=refusal):
        executor.Executor().Do({}, {"examples": [examples], "grant": [grant]}, properties)
    assert [b.spent[0] for b in BlockLedger(store_path).blocks()] == [0.0, 0.0]


# Issue 29 item 9: what the components a grant pays for would refuse after the charge is
# checked before it (block_ledger/preflight.py).

def _training_dag(module_file, max_noise_multiplier=None, **sampling):
    from sage_tfx.components import (BlockLedger as BlockLedgerComponent, DPTrainer,
                                      ObliviousSampleGen, SLAedValidator)
    grant = BlockLedgerComponent(ledger_store="ledger.sqlite", epsilon=1.0, delta=1e-7, window=2,
                                 split={"sampling_count": 0.05, "training": 0.8,
                                        "validation": 0.15})
    sampler = ObliviousSampleGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                                 scheme="poisson", epochs=2, **sampling)
    trainer = DPTrainer(examples=sampler.outputs["samples"], grant=grant.outputs["grant"],
                        module_file=module_file, l2_norm_clip=1.0, learning_rate=0.05,
                        max_noise_multiplier=max_noise_multiplier)
    SLAedValidator(model=trainer.outputs["model"], examples=grant.outputs["examples"],
                   grant=grant.outputs["grant"], module_file=module_file, metric="loss",
                   target=1.0, loss_bound=2.0)
    return grant


def test_the_consumers_of_a_grant_give_it_their_checks():
    from sage_tfx.components.block_ledger import preflight

    grant = _training_dag(TRIP_MODULE, gamma=0.1)
    trainer, validator = preflight.parse(grant.exec_properties[preflight.PROPERTY])
    assert (trainer.component, trainer.module_file, trainer.legacy_keras) == (
        "DPTrainer", TRIP_MODULE, True)
    # model_inputs and loss() are optional (the model's named Inputs, its compiled loss).
    assert set(trainer.module_needs) == {"build_model", "feature_spec"}
    assert trainer.sampling == {"scheme": "poisson", "gamma": 0.1, "epochs": 2}
    assert (validator.component, validator.module_needs, validator.trainer) == (
        "SLAedValidator", ["loss", "feature_spec"], None)  # no transform graph: raw features


def _bad_module(tmp_path, text):
    path = tmp_path / "module.py"
    path.write_text(text)
    return str(path)


def _trip_module_with(tmp_path, source: str) -> str:
    """The trip module's features and loss, with ``source`` (a build_model) of its own."""
    return _bad_module(tmp_path, "import importlib.util, tensorflow as tf\n"
                                 f"spec = importlib.util.spec_from_file_location('trip', "
                                 f"{TRIP_MODULE!r})\n"
                                 "trip = importlib.util.module_from_spec(spec)\n"
                                 "spec.loader.exec_module(trip)\n"
                                 "LABEL_KEY, feature_spec = trip.LABEL_KEY, trip.feature_spec\n"
                                 "model_inputs, loss = trip.model_inputs, trip.loss\n" + source)


@pytest.mark.parametrize("case", ["missing file", "lacks build_model", "raises on import",
                                  "calibration", "keras 3", "batch normalization",
                                  "batch statistics", "statistics no stand-in changes",
                                  "model fails its stand-in", "no compiler",
                                  "mixing model", "mixing loss", "stateful loss",
                                  "scalar loss", "float64 model", "variable made in the step"])
def test_a_consumer_that_would_fail_after_the_charge_is_refused_before_it(
        store_path, tmp_path, monkeypatch, case):
    from sage_tfx.components.block_ledger import preflight
    from sage_tfx.components.util import legacy_keras

    module, limit, message = TRIP_MODULE, None, None
    if case == "missing file":
        module, message = str(tmp_path / "absent.py"), "absent.py' does not exist"
    elif case == "lacks build_model":
        module = _bad_module(tmp_path, "LABEL_KEY = 'y'\ndef feature_spec(): return {}\n"
                                       "def model_inputs(f): return f\n")
        message = r"DPTrainer: module file .* lacks \['build_model'\]"
    elif case == "raises on import":
        module = _bad_module(tmp_path, "import not_installed_anywhere\n")
        message = "does not import: ModuleNotFoundError"
    elif case == "batch normalization":  # DP-SGD cannot clip it: refused from the model alone
        module = _trip_module_with(tmp_path, "def build_model():\n"
                                             "    return tf.keras.Sequential(["
                                             "tf.keras.Input((1,)), "
                                             "tf.keras.layers.BatchNormalization(), "
                                             "tf.keras.layers.Dense(1)])\n")
        message = "DPTrainer: layer .* \\(BatchNormalization\\) normalises each example"
    elif case == "batch statistics":  # a custom layer keeping a running mean of its batches
        module = _trip_module_with(tmp_path, "class Mean(tf.keras.layers.Layer):\n"
                                             "    def build(self, shape):\n"
                                             "        self.mean = self.add_weight("
                                             "'mean', shape[-1:], initializer='zeros', "
                                             "trainable=False)\n"
                                             "    def call(self, x, training=None):\n"
                                             "        if training:\n"
                                             "            self.mean.assign(tf.reduce_mean(x, 0))\n"
                                             "        return x\n"
                                             "def build_model():\n"
                                             "    return tf.keras.Sequential(["
                                             "tf.keras.Input((1,)), "
                                             "Mean(), tf.keras.layers.Dense(1)])\n")
        message = "DPTrainer: a training step changes the model's non-trainable variable"
    elif case == "statistics no stand-in changes":  # read from the graph, not from values
        module = _trip_module_with(tmp_path, "class Largest(tf.keras.layers.Layer):\n"
                                             "    def build(self, shape):\n"
                                             "        self.largest = self.add_weight("
                                             "'largest', (), initializer='zeros', "
                                             "trainable=False)\n"
                                             "    def call(self, x, training=None):\n"
                                             "        return tf.cond(tf.reduce_max(x) > 1e6, "
                                             "lambda: x + 0 * self.largest.assign("
                                             "tf.reduce_max(x)), lambda: x)\n"
                                             "def build_model():\n"
                                             "    return tf.keras.Sequential(["
                                             "tf.keras.Input((1,)), "
                                             "Largest(), tf.keras.layers.Dense(1)])\n")
        message = "DPTrainer: a training step changes the model's non-trainable variable"
    elif case == "model fails its stand-in":  # the model's own error, not its module's import
        module = _trip_module_with(tmp_path, "def build_model():\n"
                                             "    return tf.keras.Sequential(["
                                             "tf.keras.Input((3,)), "  # model_inputs give 1
                                             "tf.keras.layers.Dense(1)])\n")
        message = ("DPTrainer: the module's code fails on a public stand-in batch .* "
                   "ValueError: .*incompatible")
    elif case in ("mixing model", "mixing loss", "stateful loss", "scalar loss",
                  "float64 model", "variable made in the step"):  # issue 45
        model = {"mixing model": "tf.keras.layers.Lambda("
                                 "lambda x: x - tf.reduce_mean(x, axis=0)), ",
                 "variable made in the step": "tf.keras.layers.Lambda(lambda x: x + "
                                              "tf.raw_ops.ReadVariableOp(resource="
                                              "tf.raw_ops.VarHandleOp(dtype=tf.float32, "
                                              "shape=[], shared_name='carried'), "
                                              "dtype=tf.float32)), "}.get(case, "")
        dtype = ", dtype='float64'" if case == "float64 model" else ""
        losses = {
            "mixing loss": "    def call(self, y, p):\n"
                           "        return tf.reduce_sum(tf.square(p - y - "
                           "tf.reduce_mean(p, axis=0)), -1)\n",
            "stateful loss": "    def call(self, y, p):\n"
                             "        self.seen.assign(tf.reduce_mean(y))\n"
                             "        return tf.reduce_sum(tf.square(p - y), -1)\n",
            "scalar loss": "    def __call__(self, y, p, sample_weight=None):\n"
                           "        return tf.reduce_mean(tf.square(p - y))\n"}
        module = _trip_module_with(tmp_path, (
            "SEEN = tf.Variable(0.0, name='seen')\n"
            "class Loss(tf.keras.losses.Loss):\n"
            "    seen = SEEN\n" + losses[case] + "def loss():\n    return Loss()\n"
            if case in losses else "") + (
            "def build_model():\n"
            f"    return tf.keras.Sequential([tf.keras.Input((1,){dtype}), {model}"
            f"tf.keras.layers.Dense(1{dtype})])\n"))
        message = {"mixing model": "the model: an example's output depends on other examples",
                   "mixing loss": "the loss: an example's loss depends on other examples",
                   "stateful loss": r"a training step changes variable\(s\) seen:0",
                   "scalar loss": "the loss must give one value per example",
                   "float64 model": "DP-SGD trains float32 variables",
                   "variable made in the step": r"ops holding state of their own \(VarHandleOp"
                   }[case]
        message = "DPTrainer: .*" + message
    elif case == "no compiler":  # DP-SGD's kernels compile on first use: none cached here
        from sage_tfx.components.dp_trainer import step_ops
        monkeypatch.setenv("CXX", "no-such-compiler")
        monkeypatch.setattr(step_ops, "_cache_directories", lambda: [tmp_path / "kernels"])
        monkeypatch.setattr(step_ops, "_loaded", functools.cache(step_ops._loaded.__wrapped__))
        message = "DPTrainer: DP-SGD's step kernels .* 'no-such-compiler' was not found"
    elif case == "calibration":  # 20 Poisson steps at gamma 0.1 on a share of 0.8, sigma <= 2
        limit, message = 2.0, "cannot pay for 20 DP-SGD step"
    else:
        monkeypatch.setattr(legacy_keras, "legacy_keras_in_effect", lambda: False)
        message = "DPTrainer: DP-SGD needs Keras 2.*Import sage_tfx before tfx"
    grant = _training_dag(module, max_noise_multiplier=limit, gamma=0.1)
    ledger = BlockLedger.create(store_path, min_request_epsilon=0.05)
    for block in ("b1", "b2"):
        ledger.add_block(block, 2.0, 1e-6, data_uri=str(tmp_path / block))
    examples, grant_artifact = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant_artifact.uri = str(tmp_path / "out-examples"), str(tmp_path / "out-grant")
    properties = {**grant.exec_properties, "ledger_store": store_path}
    with pytest.raises(BadRequest, match="refused before the charge") as refused:
        executor.Executor().Do({}, {"examples": [examples], "grant": [grant_artifact]},
                               properties)
    assert refused.match(message)
    assert [b.spent[0] for b in BlockLedger(store_path).blocks()] == [0.0, 0.0]
    assert not BlockLedger(store_path).grant_records()
    if case == "calibration":  # the same check as the privacy-adaptive driver's
        with pytest.raises(ValueError, match=message):
            preflight.run(preflight.parse(properties[preflight.PROPERTY]), 1.0, 1e-7,
                          {"sampling_count": 0.05, "training": 0.8, "validation": 0.15})


def test_a_consumers_fixed_seed_is_refused_before_the_charge(store_path, tmp_path):
    """Issue 45, item 5: DPTrainer's and ObliviousSampleGen's `seed` (tests only) reaches the
    BlockLedger that grants them, which refuses to charge a ledger not created for tests."""
    from sage_tfx.components.block_ledger.component import FIXED_SEEDS

    from sage_tfx.components import DPTrainer

    grant = _training_dag(TRIP_MODULE, gamma=0.1, seed=3)
    DPTrainer(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
              module_file=TRIP_MODULE, mode="adassp", grant_step="training", feature_bound=1.0,
              label_bound=1.0, seed=4)
    assert json.loads(grant.exec_properties[FIXED_SEEDS]) == ["ObliviousSampleGen seed 3",
                                                              "DPTrainer seed 4"]
    ledger = BlockLedger.create(store_path, min_request_epsilon=0.05)
    for block in ("b1", "b2"):
        ledger.add_block(block, 2.0, 1e-6, data_uri=str(tmp_path / block))
    examples, grant_artifact = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant_artifact.uri = str(tmp_path / "out-examples"), str(tmp_path / "out-grant")
    with pytest.raises(BadRequest, match="ObliviousSampleGen seed 3, DPTrainer seed 4 fix.*not created for tests"):
        executor.Executor().Do({}, {"examples": [examples], "grant": [grant_artifact]},
                               {**grant.exec_properties, "ledger_store": store_path})
    assert [b.spent[0] for b in BlockLedger(store_path).blocks()] == [0, 0]
    assert not BlockLedger(store_path).grant_records()


def test_keras_2_is_in_effect_only_as_tensorflow_decided(monkeypatch):
    """Before TensorFlow is imported the variable decides; after, what tf.keras is. A process
    that used tf.keras before sage_tfx set the variable has Keras 3 for good."""
    from sage_tfx.components.util import legacy_keras

    assert legacy_keras.legacy_keras_in_effect()  # conftest imports sage_tfx first
    monkeypatch.delitem(sys.modules, "tensorflow")
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "0")
    assert not legacy_keras.legacy_keras_in_effect()
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    assert legacy_keras.legacy_keras_in_effect()
    keras_3_first = ("import os; os.environ.pop('TF_USE_LEGACY_KERAS', None); "
                     "import tensorflow as tf; tf.keras.layers; import sage_tfx; "
                     "from sage_tfx.components.util.legacy_keras import legacy_keras_in_effect; "
                     "print(legacy_keras_in_effect())")
    completed = subprocess.run([sys.executable, "-c", keras_3_first], capture_output=True,
                               text=True, timeout=120)
    assert completed.stdout.strip() == "False", completed.stderr[-2000:]


def test_a_transform_that_uses_a_non_dp_analyzer_is_refused_before_the_charge(tmp_path):
    """DPTransform registers its audit (traced without data) with the BlockLedger: a
    preprocessing_fn calling tft.mean is refused before anything is charged, not after."""
    from sage_tfx.components import BlockLedger as BlockLedgerComponent, DPTransform
    from sage_tfx.components.block_ledger import preflight

    module = _bad_module(tmp_path, (
        "import tensorflow as tf\nimport tensorflow_transform as tft\n"
        "def feature_spec(): return {'x': tf.io.FixedLenFeature([], tf.float32)}\n"
        "def preprocessing_fn(inputs): return {'x': inputs['x'] - tft.mean(inputs['x'])}\n"))
    ledger_component = BlockLedgerComponent(ledger_store="ledger.sqlite", epsilon=1.0,
                                            delta=1e-7, window=1,
                                            split={"transform": 0.5, "training": 0.5})
    grant = ledger_component.outputs["grant"]
    DPTransform(examples=ledger_component.outputs["examples"], grant=grant, module_file=module)
    [check] = preflight.parse(grant.producer_component.exec_properties[preflight.PROPERTY])
    assert (check.component, check.transform_step) == ("DPTransform", "transform")
    with pytest.raises(BadRequest, match="refused before the charge.*DPTransform"):
        preflight.run([check], 1.0, 1e-7, {"transform": "0.5", "training": "0.5"})


@pytest.mark.parametrize("case", [
    "string default", pytest.param("fails on records", marks=pytest.mark.slow)])
def test_a_transform_that_would_fail_on_its_records_is_refused_before_the_charge(tmp_path,
                                                                                  case):
    """Issue 45: a string FixedLenFeature with a default_value failed in TFT's schema after the
    charge; a preprocessing_fn failing on the records did too. The preflight loads the spec
    into TFT's schema and runs one whole preprocessing pass on public stand-in records of the
    feature spec (stand_in_pass): refused, naming the cause, with nothing charged."""
    from sage_tfx.components.block_ledger import preflight

    spec, body = {
        "string default": ("tf.io.FixedLenFeature([], tf.string, default_value='none')",
                           "inputs['s']"),
        "fails on records": ("tf.io.FixedLenFeature([], tf.string)",
                             "tf.strings.to_number(inputs['s'])")}[case]
    module = _bad_module(tmp_path, (
        "import tensorflow as tf\n"
        f"def feature_spec(): return {{'s': {spec}, "
        "'x': tf.io.FixedLenFeature([], tf.float32)}\n"
        f"def preprocessing_fn(inputs): return {{'x': inputs['x'], 's': {body}}}\n"))
    check = preflight.Check(component="DPTransform", module_file=module, purpose="transform",
                            transform_step="transform")
    message = {"string default": "no TensorFlow Transform schema: feature \"s\" had "
                                 "default_value none",
               "fails on records": "fails on public stand-in records .* "
                                   "InvalidArgumentError: StringToNumberOp"}[case]
    with pytest.raises(BadRequest, match="refused before the charge.*DPTransform: .*" + message):
        preflight.run([check], 1.0, 1e-7, {"transform": "0.5", "training": "0.5"})


def test_a_stand_in_check_that_passed_is_made_once_per_process_and_module(tmp_path,
                                                                          monkeypatch):
    """DP-SGD's stand-in check costs seconds and reads no record: one that passed is not made
    again in the process for the same module bytes (util/stand_in_cache.py). A module file
    that changed is checked afresh, and a refused one is refused every time."""
    from sage_tfx.components.block_ledger import preflight
    from sage_tfx.components.dp_trainer import stand_in
    from sage_tfx.components.util import stand_in_cache

    monkeypatch.setattr(stand_in_cache, "_passed", set())
    checked = recorded_calls(monkeypatch, stand_in, "check_module")
    module = _trip_module_with(tmp_path, "build_model = trip.build_model\n")
    [trainer, _] = preflight.parse(_training_dag(module, gamma=0.1).exec_properties[
        preflight.PROPERTY])
    split = {"sampling_count": 0.05, "training": 0.8, "validation": 0.15}
    for _ in range(2):
        preflight.run([trainer], 1.0, 1e-7, split)
    assert len(checked) == 1
    _trip_module_with(tmp_path, "def build_model():\n"  # the same file, now mixing examples
                                "    return tf.keras.Sequential([tf.keras.Input((1,)), "
                                "tf.keras.layers.Lambda(lambda x: x - tf.reduce_mean(x, 0)), "
                                "tf.keras.layers.Dense(1)])\n")
    for _ in range(2):
        with pytest.raises(BadRequest, match="the model: an example's output depends on other"):
            preflight.run([trainer], 1.0, 1e-7, split)
    assert len(checked) == 3


@pytest.mark.slow  # two Beam runs on stand-in records
def test_a_transform_stand_in_pass_that_passed_is_made_once_per_process_module_and_plan(
        tmp_path, monkeypatch):
    """DPTransform's stand-in pass (a whole Beam run) reads the module and its plan, no record:
    one that passed is not made again in the process for the same module bytes and plan
    (util/stand_in_cache.py); another transform budget is another plan, checked afresh."""
    from sage_tfx.components.block_ledger import preflight
    from sage_tfx.components.dp_transform import executor as transform_executor
    from sage_tfx.components.util import stand_in_cache

    monkeypatch.setattr(stand_in_cache, "_passed", set())
    passes = recorded_calls(monkeypatch, transform_executor, "stand_in_pass")
    module = _bad_module(tmp_path, (
        "import tensorflow as tf\n"
        "from sage_tfx.components.dp_transform import tft\n"
        "CLAMP_BOUNDS = {'x': (0.0, 10.0)}\n"
        "def feature_spec(): return {'x': tf.io.FixedLenFeature([], tf.float32)}\n"
        "def preprocessing_fn(inputs): return {'x': tft.scale_to_z_score(inputs['x'])}\n"))
    check = preflight.Check(component="DPTransform", module_file=module, purpose="transform",
                            transform_step="transform")
    for epsilon in (1.0, 1.0, 2.0):
        preflight.run([check], epsilon, 1e-7, {"transform": "0.5", "training": "0.5"})
    assert [plan.epsilon for _, _, plan in passes] == [0.5, 1.0]


def _ram_examples(uri: str) -> None:
    """A block's Examples (one file per split) on TF's in-memory filesystem."""
    import tensorflow as tf

    for split in ("train", "eval"):
        tf.io.gfile.makedirs(f"{uri}/Split-{split}")
        with tf.io.gfile.GFile(f"{uri}/Split-{split}/data.gz", "w") as handle:
            handle.write(f"{uri} {split}")


def test_a_kubeflow_task_reads_a_remote_pipeline_root_and_names_its_run(store_path):
    """As on a cluster: the blocks' Examples and the task's outputs live on a filesystem only
    TF's gfile opens (gs:// there; ram:// here, which os.* cannot open either), and TFX's Kubeflow
    V2 entrypoint gives the executor no run: it is read from where Kubeflow's launcher put the
    outputs, <root>/<pipeline>/<run id>/<task>/<output>."""
    import tensorflow as tf

    ledger = BlockLedger.create(store_path, min_request_epsilon=0.05)
    for block in ("m1", "m2"):
        _ram_examples(f"ram://blocks/{block}")
        ledger.add_block(block, 2.0, 1e-6, data_uri=f"ram://blocks/{block}", data_format="examples")
    run_root = "ram://root/sage-taxi/run-7"
    examples, grant = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant.uri = f"{run_root}/BlockLedger/examples", f"{run_root}/BlockLedger/grant"
    properties = {"ledger_store": store_path, "ledger_context": "default", "epsilon": 0.3,
                  "delta": 0.0, "split": '{"all": 1.0}', "window": 2,
                  "pipeline_name": "sage-taxi"}
    executor.Executor().Do({}, {"examples": [examples], "grant": [grant]}, properties)
    assert sorted(tf.io.gfile.listdir(f"{examples.uri}/Split-train")) == [
        "m1-data.gz", "m2-data.gz"]
    with tf.io.gfile.GFile(f"{examples.uri}/Split-eval/m2-data.gz") as handle:
        assert handle.read() == "ram://blocks/m2 eval"
    [record] = BlockLedger(store_path).grant_records()
    # Handed on, not failed: the steps it pays for record their own outcomes.
    assert record["outcome"] == "incomplete"
    assert record["run_id"] == "run-7"
    request = json.loads(record["request"])
    assert (request["run"], request["component"]) == ("run-7", "BlockLedger")
    assert BlockLedger(store_path).grant_run(record["grant_id"])["runs"] == [
        {"type": "sage_tfx.PipelineRun", "name": "run-7"}]
