"""DPTuner: private selection over DP-SGD trials (components/dp_tuner)."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import dp_event

from sage_tfx.components.block_ledger import preflight
from sage_tfx.components.dp_tuner import search_space, tuning
from sage_tfx.components.privacy_grant import step_events
from sage_tfx.components.util.user_module import UserModule
from sage_tfx.sage_access.accounting import rdp_curve_of, AccountingMode
from sage_tfx.sage_access.errors import BadRequest

from support import TUNER_MODULE

# Every trial: 2 epochs x 20 Poisson steps (gamma 0.05); a small share keeps the test fast.
PARAMETERS = tuning.SearchParameters.of({"gamma": 0.05, "epochs": 2, "trials_mean": 3.0})
GOOD, BAD = {"learning_rate": 2.0, "l2_norm_clip": 1.0}, {"learning_rate": 1e-4, "l2_norm_clip": 1.0}


def _problem(n=1500, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2)).astype(np.float32)
    labels = (x.sum(axis=1) > 0).astype(np.float32).reshape(-1, 1)
    return tf.constant(x), tf.constant(labels)


def _module():
    return UserModule.load(TUNER_MODULE, "DPTuner", ("build_model",))


def _recorded_trials(monkeypatch):
    """The candidates the selection tries (test instrumentation only: nothing in the component
    records them)."""
    tried = []
    real = tuning.private_selection

    def recording(candidates, run_trial, trial_event, law, rng=None):
        def run(index):
            tried.append(index)
            return run_trial(index)
        return real(candidates, run, trial_event, law, rng)

    monkeypatch.setattr(tuning, "private_selection", recording)
    return tried


def test_the_search_picks_the_clearly_better_setting(monkeypatch):
    """Seed 3 of the selection's generator draws K = 3 trials trying both candidates (asserted).
    Scored by the loss (cross-entropy clipped at 1): the good learning rate reaches ~0.125 on
    the held-out share, the bad one stays near the zero model's ln 2 (0.67-0.69 measured). Not
    by accuracy: a sigmoid's accuracy depends only on the weights' direction, which a tiny
    learning rate learns as well (both candidates then score ~1 and the noise picks). The DP
    score's noise (Laplace count and sum, ~450 held-out records) is ~0.01: a false failure needs
    noise of 0.25, probability below 1e-12."""
    tried = _recorded_trials(monkeypatch)
    inputs, labels = _problem()
    parameters = tuning.SearchParameters.of({"gamma": 0.05, "epochs": 2, "trials_mean": 3.0,
                                             "metric": "loss", "loss_bound": 1.0})
    plan = tuning.plan_search(parameters, 8.0, 1e-6)
    best, event = tuning.search(_module(), inputs, labels, [BAD, GOOD], plan, seed=3)
    assert set(tried) == {0, 1}
    assert best.settings == GOOD
    assert 0.0 <= best.score < 0.3
    assert event == plan.event


def test_the_number_of_trials_does_not_depend_on_the_data(monkeypatch):
    """K and the candidates come from the generator before any trial, and no record stops the
    loop: on neighbouring datasets (one record removed) the same seed runs the same trials."""
    tried = _recorded_trials(monkeypatch)
    parameters = tuning.SearchParameters.of({"gamma": 0.25, "epochs": 1, "trials_mean": 1.5})
    plan = tuning.plan_search(parameters, 4.0, 1e-6)
    runs = []
    for n in (200, 199):
        inputs, labels = _problem(n)
        tried.clear()
        tuning.search(_module(), inputs, labels, [BAD, GOOD], plan, seed=11)
        runs.append(list(tried))
    assert runs[0] == runs[1] and len(runs[0]) >= 1


def test_the_plan_spends_the_share_and_its_event_is_repeat_and_select():
    plan = tuning.plan_search(PARAMETERS, 2.0, 1e-6)
    assert 0.98 * 2.0 <= plan.epsilon <= 2.0
    count, selection = plan.event.events
    assert isinstance(selection, dp_event.RepeatAndSelectDpEvent)
    assert selection.event == plan.trial_event and selection.shape == 1.0
    assert selection.mean == pytest.approx(3.0)
    # Less noise would overspend: the calibration is the smallest noise that fits.
    cheaper = tuning._events(PARAMETERS, PARAMETERS.law, plan.count_epsilon, plan.score_epsilon,
                             plan.noise_multiplier * 0.98)[1]
    assert tuning._accounted(cheaper, 1e-6) > 2.0
    with pytest.raises(BadRequest, match="cannot pay"):
        tuning.plan_search(PARAMETERS, 1e-3, 1e-9)


def test_the_charge_is_the_events_the_grant_records():
    """The grant's step records the plan's event (privacy_grant.planned_event for the
    'dp_tuning' mechanism DPTuner.step_mechanism() names), and an rdp ledger charges its curve:
    the charge is the event's, not one trial's."""
    from sage_tfx.sage_access import BlockLedger
    from sage_tfx.sage_access.ledger import BlockIds

    split = {"tuning": 1.0}
    events = step_events({"tuning": PARAMETERS.as_mechanism()}, split, 2.0, 1e-6,
                         AccountingMode.RDP)
    plan = tuning.plan_search(PARAMETERS, 2.0, 1e-6)
    assert events["tuning"] == plan.event
    ledger = BlockLedger.create(":memory:", accounting="rdp", min_request_epsilon=0.01)
    ledger.add_block("b0", 10.0, 1e-5, start="2024-01-01")
    ledger.request(BlockIds(["b0"]), epsilon=2.0, delta=1e-6, split=split, events=events)
    charged = np.asarray(ledger.block("b0").spent)
    assert np.allclose(charged, rdp_curve_of([plan.event], ledger.orders))
    assert np.all(charged > rdp_curve_of([plan.trial_event], ledger.orders))  # not one trial's


def _check(tuner_fn, module_file=TUNER_MODULE, **given):
    return preflight.Check(
        component="DPTuner", module_file=module_file, purpose="dp_sgd",
        module_needs=("build_model", "feature_spec"), legacy_keras=True,
        trainer={"mode": "dp_sgd", "model_fn": None, "grant_step": "tuning",
                 "transform_graph": False},
        tuning={"tuner_fn": tuner_fn, "custom_config": {}, "learning_rate": None,
                "l2_norm_clip": 1.0, "grant_step": "tuning", "gamma": 0.05, "epochs": 2,
                "trials_mean": 3.0, **given})


@pytest.mark.parametrize("tuner_fn, module_file, cause", [
    ("empty_tuner_fn", TUNER_MODULE, "no candidate setting"),
    ("unknown_name_tuner_fn", TUNER_MODULE, r"unknown hyperparameter name\(s\) \['dropout'\]"),
    ("no_such_fn", TUNER_MODULE, "defines no function 'no_such_fn'"),
    ("tuner_fn", "/nonexistent/module.py", "does not exist"),
])
def test_refusals_come_before_the_charge(tuner_fn, module_file, cause):
    """What the BlockLedger runs before it charges (preflight.run, the DPTuner's Check): a bad
    module, an empty space or an unknown name is refused there, nothing charged."""
    split = {"tuning": 0.5, "training": 0.5}
    events = step_events({"tuning": PARAMETERS.as_mechanism()}, split, 4.0, 1e-6, "basic")
    with pytest.raises(BadRequest, match=f"refused before the charge.*{cause}"):
        preflight.run([_check(tuner_fn, module_file)], 4.0, 1e-6, split, events)


def test_the_check_before_the_charge_passes_a_good_space_on_a_grant_recording_the_search():
    split = {"tuning": 0.5, "training": 0.5}
    events = step_events({"tuning": PARAMETERS.as_mechanism()}, split, 4.0, 1e-6, "basic")
    preflight.run([_check("tuner_fn")], 4.0, 1e-6, split, events)
    with pytest.raises(BadRequest, match="step_mechanism"):
        preflight.run([_check("tuner_fn")], 4.0, 1e-6, split, {})


def test_spaces_and_the_released_file(tmp_path):
    grid = search_space.candidates_from({"learning_rate": [0.1, 1.0], "l2_norm_clip": [0.5]})
    assert grid == [{"learning_rate": 0.1, "l2_norm_clip": 0.5},
                    {"learning_rate": 1.0, "l2_norm_clip": 0.5}]

    class Choice:  # KerasTuner's, as its get_config() describes it (keras-tuner not installed)
        def __init__(self, name, values):
            self.config = {"name": name, "values": values}

        def get_config(self):
            return self.config

    class Float(Choice):
        pass

    def tuner_result(*space):
        oracle = type("Oracle", (), {"hyperparameters": type("HP", (), {"space": space})})
        return type("TunerFnResult", (), {"tuner": type("Tuner", (), {"oracle": oracle}),
                                          "fit_kwargs": {}})
    assert search_space.candidates_from(tuner_result(Choice("learning_rate", [0.5, 1]))) == \
        [{"learning_rate": 0.5}, {"learning_rate": 1.0}]
    with pytest.raises(BadRequest, match="no finite set"):
        search_space.candidates_from(tuner_result(Float("learning_rate", None)))
    # The released file: TFX's name and KerasTuner's config, the best values only.
    search_space.write_best_hyperparameters(str(tmp_path), grid, grid[1])
    assert os.listdir(tmp_path) == ["best_hyperparameters.txt"]
    config = json.loads((tmp_path / "best_hyperparameters.txt").read_text())
    assert config["values"] == grid[1]
    assert [entry["config"]["name"] for entry in config["space"]] == ["learning_rate",
                                                                      "l2_norm_clip"]
    assert search_space.read_best_hyperparameters(str(tmp_path)) == grid[1]


@pytest.mark.slow
def test_the_pipeline_tunes_then_trains_with_the_best_setting(tmp_path):
    """BlockLedger -> DPTuner -> (ObliviousSampleGen ->) DPTrainer(hyperparameters=...) on
    LocalDagRunner: the grant records and charges the search's event for its tuning step, the
    released artifact holds TFX's best_hyperparameters.txt with one candidate's values and DP
    facts only, and DPTrainer trains with that candidate's learning rate."""
    from tfx.orchestration import metadata, pipeline
    from tfx.orchestration.local.local_dag_runner import LocalDagRunner
    from tfx.types import artifact_utils, standard_artifacts

    from sage_tfx.components.dp_trainer import DPTrainer
    from sage_tfx.components.dp_tuner import DPTuner
    from sage_tfx.components.oblivious_sample_gen import ObliviousSampleGen
    from sage_tfx.sage_access import BlockLedger, connect

    from support import TRIP_MODULE
    from support.ingest import ingest_and_grant

    root = str(tmp_path)
    store_path = os.path.join(root, "metadata.sqlite")
    gen, grant = ingest_and_grant(root, store_path, block_epsilon=4.0, epsilon=4.0, delta=1e-6,
                                  split={"tuning": 0.5, "training": 0.5})
    search = {"gamma": 0.1, "epochs": 1, "trials_mean": 2.0, "metric": "loss",
              "loss_bound": 1e6}
    tuner = DPTuner(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                    module_file=TRIP_MODULE, l2_norm_clip=1.0, seed=5, **search)
    sampler = ObliviousSampleGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                                 scheme="swo", sample_size=8, epochs=1, seed=3, public_size=48)
    trainer = DPTrainer(examples=sampler.outputs["samples"], grant=grant.outputs["grant"],
                        module_file=TRIP_MODULE,
                        hyperparameters=tuner.outputs["best_hyperparameters"], seed=4)
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="tuning", pipeline_root=os.path.join(root, "pipeline"),
        components=[gen, grant, tuner, sampler, trainer],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store_path)))

    store = connect(store_path)
    [best] = [artifact_utils.deserialize_artifact(
        store.get_artifact_type("HyperParameters"), a)
        for a in store.get_artifacts_by_type("HyperParameters")]
    assert os.listdir(best.uri) == ["best_hyperparameters.txt"]
    values = search_space.read_best_hyperparameters(best.uri)
    assert values in ({"learning_rate": 1e-4, "l2_norm_clip": 1.0},
                      {"learning_rate": 0.05, "l2_norm_clip": 1.0})
    assert set(best.mlmd_artifact.custom_properties) - {"tfx_version", "is_external"} == {
        "dp_score", "metric", "dp_epsilon", "dp_delta", "noise_multiplier", "trials_mean",
        "trials_shape"}
    plan = tuning.plan_search(tuning.SearchParameters.of(search), 2.0, 5e-7)
    ledger = BlockLedger(store_path)
    [grant_artifact] = store.get_artifacts_by_type("sage_tfx.PrivacyGrant")
    record = ledger.find_grant(grant_artifact.custom_properties["grant_id"].string_value)
    assert ledger.grant_event(record, "tuning") == plan.event
    [model] = store.get_artifacts_by_type(standard_artifacts.Model.TYPE_NAME)
    assert float(model.custom_properties["learning_rate"].string_value) == \
        values["learning_rate"]


def _seed_with_trials(law, wanted):
    """A seed of the selection's generator (search's `seed`) whose K is `wanted`."""
    from sage_tfx.randomness import secret_rng
    return next(seed for seed in range(1000) if law.draw(secret_rng(seed)) == wanted)


def _k1_and_k7_searches(n=50):
    """The plan of a small search (E[K] = 4 on an (8, 1e-6) share), the seeds of its searches
    with K = 1 and K = 7, and a problem of n records."""
    parameters = tuning.SearchParameters.of({"gamma": 0.25, "epochs": 1, "trials_mean": 4.0})
    seeds = [_seed_with_trials(parameters.law, k) for k in (1, 7)]
    return tuning.plan_search(parameters, 8.0, 1e-6), seeds, _problem(n)


def test_a_search_builds_its_model_and_traces_dp_sgds_step_once_whatever_its_trials(
        monkeypatch):
    """A trial only resets the weights and feeds its settings (learning rate, clip norm, noise)
    to the machinery built for the search: with K = 7 trials as with K = 1, build_model runs
    once, make_dp_step once, and DP-SGD's per-example clipping (clipping.OnePass: its Python
    code runs only while a step or a stand-in check is traced, never in a compiled call) as
    often. On main every trial built a model and traced a step: 7 of each, 21 OnePass traces
    against 3."""
    import dataclasses

    from sage_tfx.components.dp_trainer import clipping, dp_sgd

    counts = {}

    def counting(name, real):
        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)
        return counted

    monkeypatch.setattr(dp_sgd, "make_dp_step", counting("make_dp_step", dp_sgd.make_dp_step))
    monkeypatch.setattr(clipping, "OnePass", counting("OnePass", clipping.OnePass))
    module = _module()
    module = dataclasses.replace(module, build_model=counting("build_model", module.build_model))
    plan, seeds, (inputs, labels) = _k1_and_k7_searches()
    per_search = []
    for seed in seeds:
        counts.clear()
        tuning.search(module, inputs, labels, [BAD, GOOD], plan, seed=seed)
        per_search.append(dict(counts))
    assert per_search[0]["build_model"] == per_search[0]["make_dp_step"] == 1
    assert per_search[1] == per_search[0]


def test_the_search_leaves_no_count_of_its_trials_in_the_process(monkeypatch):
    """TensorFlow's retracing detector (its warning quotes counts of calls per function) and
    Keras's layer-name counters (the next model's layer names, in its SavedModel) would tell K
    to the next component in the process: a K = 1 and a K = 7 search (same data) tell the
    detector the same calls and advance the name counters alike. Private state of the pinned
    TensorFlow and tf_keras, read by this test only. (Earlier, a K = 7 search left 7 more
    "dense" names and 7 traces of the step, then restored these internals afterwards.)"""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function
    from tf_keras.src import backend

    manager = polymorphic_function._FrequentTracingDetectorManager
    told = []

    def telling(traced, real):
        def told_one(self, key, *args):
            told.append((key, traced))
            return real(self, key, *args)
        return told_one

    monkeypatch.setattr(manager, "called_with_tracing",
                        telling(True, manager.called_with_tracing))
    monkeypatch.setattr(manager, "called_without_tracing",
                        telling(False, manager.called_without_tracing))

    def name_counters():
        return {(id(graph), name): count
                for graph, uids in backend.PER_GRAPH_OBJECT_NAME_UIDS.items()
                for name, count in uids.items()}

    plan, seeds, (inputs, labels) = _k1_and_k7_searches()
    left = []
    for seed in seeds:
        told.clear()
        before, observed = name_counters(), len(backend.OBSERVED_NAMES)
        tuning.search(_module(), inputs, labels, [BAD, GOOD], plan, seed=seed)
        after = name_counters()
        left.append((list(told), {key: after[key] - before.get(key, 0) for key in after},
                     len(backend.OBSERVED_NAMES) - observed))
    assert left[0] == left[1]


def test_the_searchs_log_does_not_depend_on_the_number_of_trials(caplog, capfd):
    """K is secret: a search with K = 1 and one with K = 7 (same data) leave the same records
    in Python's logging (the root's and TensorFlow's logger), on stdout and on stderr. On main
    TensorFlow's retracing detector logged the NoiseBuffer's per-trial traces once K >= 5."""
    import logging

    plan, seeds, (inputs, labels) = _k1_and_k7_searches(n=100)
    tuning.search(_module(), inputs, labels, [BAD, GOOD], plan, seed=seeds[0])  # first traces
    tf_records = []
    handler = logging.Handler()
    handler.emit = tf_records.append
    tf.get_logger().addHandler(handler)
    logs = []
    try:
        for seed in seeds:
            capfd.readouterr()
            caplog.clear()
            tf_records.clear()
            with caplog.at_level(logging.DEBUG):
                tuning.search(_module(), inputs, labels, [BAD, GOOD], plan, seed=seed)
            out, err = capfd.readouterr()
            logs.append(([(r.name, r.levelno, r.getMessage()) for r in caplog.records],
                         [(r.levelno, r.getMessage()) for r in tf_records], out, err))
    finally:
        tf.get_logger().removeHandler(handler)
    assert logs[0] == logs[1]
    # Silenced for the search only: stdout, stderr and logging are back afterwards.
    print("after")
    os.write(2, b"after\n")
    logging.getLogger("tensorflow").warning("after")
    assert capfd.readouterr() == ("after\n", "after\n") and caplog.messages[-1] == "after"


def test_an_empty_or_one_record_split_releases_like_any_other():
    """After the charge nothing may fail on the data: with no record (n = 0: an empty training
    part and an empty held-out share) and with one, the search releases a candidate and a DP
    score in range (on main n = 0 raised ValueError in the per-example metric, for either
    metric; the loss's path also clips)."""
    parameters = tuning.SearchParameters.of(
        {"gamma": 0.25, "epochs": 1, "trials_mean": 1.5, "metric": "loss", "loss_bound": 2.0})
    plan = tuning.plan_search(parameters, 4.0, 1e-6)
    for n in (0, 1):
        inputs, labels = _problem(n)
        best, event = tuning.search(_module(), inputs, labels, [BAD, GOOD], plan, seed=5)
        assert best.settings in (BAD, GOOD) and event == plan.event
        assert 0.0 <= best.score <= parameters.value_range


def test_a_trial_draws_each_steps_poisson_weights_as_the_step_runs(monkeypatch):
    """Memory must not grow with steps x n (main materialised a float64 steps x n array of
    uniforms per trial: 8 GB at gamma 0.01, 5 epochs, 2M rows): every weight array a step reads
    holds n values and is drawn when that step runs. tracemalloc bounds the search's peak
    Python allocation: 500 steps x 20,000 rows drawn at once take 80 MB of uniforms (main),
    one step's 160 KB; the bound 30 MB leaves room for everything else."""
    import tracemalloc

    from sage_tfx.components.dp_trainer import dp_sgd

    parameters = tuning.SearchParameters.of(
        {"gamma": 0.002, "epochs": 1, "trials_mean": 1.5, "max_noise_multiplier": 100.0})
    plan = tuning.plan_search(parameters, 8.0, 1e-6)
    n = 20_000
    inputs, labels = _problem(n)
    shapes = []

    class Step:  # DP-SGD's steps are not what this test measures: record what each reads
        def __call__(self, rows, weights):
            shapes.append(tuple(weights.shape))
            return tf.constant(0.0), tf.constant(0.0)

        def materialise(self):
            pass

    class CountingTraining:
        def __init__(self, model, loss, features, labels):
            pass

        def train(self, step_plan, config, seed=None):
            return dp_sgd.run_steps(Step(), step_plan)

    monkeypatch.setattr(dp_sgd, "RepeatedTraining", CountingTraining)
    tracemalloc.start()
    try:
        tuning.search(_module(), inputs, labels, [BAD, GOOD], plan, seed=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert shapes and set(shapes) == {(n,)} and len(shapes) % parameters.steps == 0
    assert peak < 30e6, peak


def _write_examples(uri, inputs, labels):
    """The problem's records as BlockExampleGen's train split (GZIP TFRecords of tf.Example)."""
    os.makedirs(os.path.join(uri, "Split-train"))
    with tf.io.TFRecordWriter(os.path.join(uri, "Split-train", "data.gz"),
                              options="GZIP") as writer:
        for (x1, x2), (label,) in zip(inputs.numpy(), labels.numpy()):
            writer.write(tf.train.Example(features=tf.train.Features(feature={
                "x1": tf.train.Feature(float_list=tf.train.FloatList(value=[x1])),
                "x2": tf.train.Feature(float_list=tf.train.FloatList(value=[x2])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
            })).SerializeToString())


@pytest.mark.slow
def test_the_executors_search_leaves_the_same_process_state_whatever_its_trials(
        tmp_path, caplog, capfd):
    """The executor's search (search_process.run_search, what Executor.Do runs) with K = 1 and
    K = 7 trials: TensorFlow's process-wide uid counter (every eager op advances it; a SavedModel
    written later in the process numbers its functions from it, so DPTrainer's saved_model.pb
    under LocalDagRunner would depend on K) moves by the same amount in this process, and this
    process's log, stdout and stderr are the same. Run in this process (the executor before
    search_process), the counter moved 980 for K = 1 (run first, with the first traces) and
    1530 for K = 7."""
    import logging

    from tensorflow.python.framework import ops

    from sage_tfx.components.dp_tuner import search_process

    plan, seeds, (inputs, labels) = _k1_and_k7_searches()
    examples = str(tmp_path / "examples")
    _write_examples(examples, inputs, labels)
    given = {"tuner_fn": "tuner_fn", "custom_config": {}, "l2_norm_clip": 1.0}
    left = []
    for seed in seeds:
        capfd.readouterr()
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            before = ops.uid()
            best = search_process.run_search(search_process.SearchTask(
                TUNER_MODULE, given, examples, None, plan, seed))
            moved = ops.uid() - before
        assert best.settings in ({"learning_rate": 1e-4, "l2_norm_clip": 1.0},
                                 {"learning_rate": 2.0, "l2_norm_clip": 1.0})
        left.append((moved, [(r.name, r.levelno, r.getMessage()) for r in caplog.records],
                     capfd.readouterr()))
    assert left[0] == left[1]


@pytest.mark.slow
def test_a_failed_search_process_is_a_clear_error(tmp_path):
    """The search's process raising (here: Examples without a train split) reaches the
    executor as SearchFailed naming the cause; nothing is returned."""
    from sage_tfx.components.dp_tuner import search_process

    plan = tuning.plan_search(PARAMETERS, 2.0, 1e-6)
    with pytest.raises(search_process.SearchFailed, match="ValueError: .*no 'train' split"):
        search_process.run_search(search_process.SearchTask(
            TUNER_MODULE, {"tuner_fn": "tuner_fn", "custom_config": {}, "l2_norm_clip": 1.0},
            str(tmp_path), None, plan, 1))
