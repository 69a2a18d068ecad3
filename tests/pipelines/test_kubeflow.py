"""`sage-tfx compile --kubeflow`: a Kubeflow V2 PipelineJob with every component, the custom
PrivacyGrant type accepted, and the ledger pointed at Kubeflow's ML Metadata over gRPC."""
import json
import os
import re

import pytest

from sage_tfx.cli import main
from sage_tfx.examples.taxi.pipeline import INITIAL_EPSILON, MIN_WINDOW
from sage_tfx.pipelines.kubeflow import KUBEFLOW_LEDGER_STORE

from support import REPO_ROOT

COMPONENTS = {"BlockExampleGen", "BlockLedger", "DPTransform", "DPTrainer", "SLAedValidator",
              "Pusher"}


REQUIRED = ["--image", "example.com/sage-tfx:0.1.0", "--pipeline-root", "gs://bucket/sage"]
TAXI = [*REQUIRED, "--data-root", "gs://bucket/taxi/new-months"]
FIRST_PIPELINE = os.path.join(REPO_ROOT, "examples", "first_pipeline.py")


@pytest.fixture
def compile_with(capsys):
    """`sage-tfx compile --kubeflow ARGS` -> (exit code, stdout, stderr), run in this process
    as tests/pipelines/test_kubeflow_job.py compiles: TFX is imported once per test process, not
    once per compile (each compile in its own process spent about 8 s of CPU importing TFX);
    argparse's refusals exit 2 as the console script does."""
    def run(*args):
        capsys.readouterr()
        try:
            code = main(["compile", "--kubeflow", *args])
        except SystemExit as exit:
            code = exit.code
        out, err = capsys.readouterr()
        return code, out, err
    return run


@pytest.fixture
def compile_job(tmp_path, compile_with):
    """Compile (REQUIRED and the taxi example's --data-root unless `options` says otherwise)
    and return the job."""
    def run(*extra, options=TAXI):
        out = tmp_path / "taxi.json"
        code, stdout, stderr = compile_with("--out", str(out), *options, *extra)
        assert code == 0, stderr[-3000:]
        assert "wrote" in stdout
        return json.loads(out.read_text())
    return run


@pytest.mark.slow
def test_compiles_the_taxi_pipeline(compile_job):
    job = compile_job()
    spec = job["pipelineSpec"]
    assert set(spec["components"]) == COMPONENTS
    assert set(spec["root"]["dag"]["tasks"]) == COMPONENTS
    executors = spec["deploymentSpec"]["executors"]
    assert all(e["container"]["image"] == "example.com/sage-tfx:0.1.0" for e in executors.values())
    # The custom artifact type compiles (custom properties only, a valid TYPE_NAME).
    grant_outputs = spec["components"]["BlockLedger"]["outputDefinitions"]["artifacts"]["grant"]
    assert grant_outputs["artifactType"]["instanceSchema"].startswith("title: sage_tfx.PrivacyGrant")
    # The grant depends on ingestion; training on the grant and the transform.
    tasks = spec["root"]["dag"]["tasks"]
    assert "BlockExampleGen" in tasks["BlockLedger"]["dependentTasks"]
    assert {"BlockLedger", "DPTransform"} <= set(tasks["DPTrainer"]["dependentTasks"])
    ledger_parameters = json.dumps(tasks["BlockLedger"]["inputs"]["parameters"])
    assert KUBEFLOW_LEDGER_STORE in ledger_parameters


@pytest.mark.slow
def test_dp_sgd_mode_adds_the_sampler(compile_job):
    job = compile_job("--mode", "dp_sgd")
    assert set(job["pipelineSpec"]["components"]) == COMPONENTS | {"ObliviousSampleGen"}
    # Without --window/--epsilon, the grant is DP-SGD's first iteration, as the demo runs it.
    grant = job["pipelineSpec"]["root"]["dag"]["tasks"]["BlockLedger"]["inputs"]["parameters"]
    constant = {name: value["runtimeValue"]["constant"] for name, value in grant.items()}
    assert constant["window"] == MIN_WINDOW["dp_sgd"]
    assert constant["epsilon"] == INITIAL_EPSILON["dp_sgd"]
    # Pipeline spec 2.1, the only form of constants Kubeflow Pipelines 2's driver resolves.
    assert job["pipelineSpec"]["schemaVersion"] == "2.1.0"
    # TFX's Kubeflow V2 entrypoint publishes one artifact per output: one for the whole run.
    ingest = job["pipelineSpec"]["root"]["dag"]["tasks"]["BlockExampleGen"]["inputs"]
    assert ingest["parameters"]["per_block_artifacts"]["runtimeValue"]["constant"] == 0


def test_a_tuned_dp_sgd_job_carries_dptuners_best_hyperparameters_into_dptrainer(
        tmp_path, compile_job, compile_with):
    """`--tuning-share`: DPTuner (its own task and executor) spends the grant's tuning step,
    whose event the BlockLedger records (the search's dp_tuning mechanism), and DPTrainer takes
    DPTuner's best_hyperparameters (TFX's HyperParameters) as its hyperparameters input, whose
    learning rate and clip norm override DPTrainer's own at run time (as TFX's Trainer)."""
    job = compile_job("--mode", "dp_sgd", "--epsilon", "2", "--tuning-share", "0.5")
    spec = job["pipelineSpec"]
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == COMPONENTS | {"ObliviousSampleGen", "DPTuner"}
    tuner, trainer = tasks["DPTuner"], tasks["DPTrainer"]
    assert {"BlockLedger", "DPTransform"} <= set(tuner["dependentTasks"])
    assert "DPTuner" in trainer["dependentTasks"]
    assert trainer["inputs"]["artifacts"]["hyperparameters"] == {"taskOutputArtifact": {
        "producerTask": "DPTuner", "outputArtifactKey": "best_hyperparameters"}}
    assert tuner["inputs"]["artifacts"]["grant"]["taskOutputArtifact"]["producerTask"] == \
        "BlockLedger"
    hyperparameters = "title: tfx.HyperParameters\n"
    assert spec["components"]["DPTuner"]["outputDefinitions"]["artifacts"][
        "best_hyperparameters"]["artifactType"]["instanceSchema"].startswith(hyperparameters)
    assert spec["components"]["DPTrainer"]["inputDefinitions"]["artifacts"][
        "hyperparameters"]["artifactType"]["instanceSchema"].startswith(hyperparameters)
    executor = spec["deploymentSpec"]["executors"][spec["components"]["DPTuner"][
        "executorLabel"]]["container"]["args"]
    assert executor[executor.index("--executor_class_path") + 1] == \
        "sage_tfx.components.dp_tuner.executor.Executor"
    constant = {name: value["runtimeValue"]["constant"]
                for name, value in tuner["inputs"]["parameters"].items()}
    assert constant["module_file"] == "sage_tfx.examples.taxi.taxi_module"
    assert constant["grant_step"] == "tuning" and constant["metric"] == "loss"
    grant = {name: value["runtimeValue"]["constant"]
             for name, value in tasks["BlockLedger"]["inputs"]["parameters"].items()}
    split = json.loads(grant["split"])
    assert (split["tuning"], split["training"]) == ("0.225", "0.225")  # half of 0.45 each
    assert json.loads(grant["step_mechanisms"])["tuning"]["mechanism"] == "dp_tuning"
    # What the job could not run is refused before anything is written.
    out = tmp_path / "refused.json"
    for options, message in ((("--mode", "adassp", "--tuning-share", "0.5"), "tunes DP-SGD"),
                             (("--mode", "dp_sgd", "--tuning-share", "1.5"),
                              r"tuning_share must lie in \[0, 1\)")):
        code, _, stderr = compile_with("--out", str(out), *TAXI, *options)
        assert code == 2 and re.search(message, stderr), stderr[-3000:]
        assert not out.exists()


@pytest.mark.slow
def test_a_grant_that_cannot_run_is_refused_at_compile_time(tmp_path, compile_with):
    out = tmp_path / "taxi.json"
    for option, message in (("--window", "window must be a positive number of blocks, got 0"),
                            ("--epsilon", "epsilon must be a positive number, got 0.0")):
        code, _, stderr = compile_with("--out", str(out), *TAXI, option, "0")
        assert code == 2, stderr[-3000:]
        assert message in stderr
        assert not out.exists()


@pytest.mark.slow
def test_compiles_a_user_pipeline_module(compile_job):
    """--pipeline-module: the plain-Pipeline example of docs/pipelines.md compiles as it is."""
    job = compile_job("--pipeline-module", FIRST_PIPELINE + ":training_pipeline",
                   options=REQUIRED)
    assert set(job["pipelineSpec"]["root"]["dag"]["tasks"]) == {
        "BlockLedger", "ObliviousSampleGen", "DPTrainer", "SLAedValidator", "Pusher"}
    assert job["runtimeConfig"]["gcsOutputDirectory"] == "gs://bucket/sage"


def test_no_silent_placeholders_and_no_directories_created(tmp_path, compile_with):
    out = str(tmp_path / "job.json")
    for missing in ("--image", "--pipeline-root"):
        args = list(TAXI)
        del args[args.index(missing):args.index(missing) + 2]
        code, _, stderr = compile_with("--out", out, *args)
        assert code == 2 and missing in stderr
    code, _, stderr = compile_with("--out", out, *REQUIRED)
    assert code == 2 and "--data-root" in stderr
    for store in (str(tmp_path / "ledger.sqlite"), "grpc://no-port"):  # pods reach it over gRPC
        code, _, stderr = compile_with("--out", out, *TAXI, "--ledger-store", store)
        assert code == 2, stderr
        assert "--ledger-store" in stderr or "grpc://HOST:PORT" in stderr
    nested = tmp_path / "absent" / "dir" / "job.json"
    code, _, stderr = compile_with("--out", str(nested), *TAXI)
    assert code == 2 and "does not exist" in stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_the_taxi_job_ingests_the_months_it_is_given(compile_job):
    """Blocks are immutable, so a job compiled for the whole sample can run once: each later
    run is compiled for the new months it ingests."""
    from sage_tfx.components.block_example_gen import month_schedule

    job = compile_job("--first-month", "2017-01", "--last-month", "2017-03")
    ingest = json.dumps(job["pipelineSpec"]["root"]["dag"]["tasks"]["BlockExampleGen"]["inputs"])
    start, end = month_schedule("2017-01", "2017-03")
    assert str(start) in ingest and str(end) in ingest


@pytest.mark.slow
def test_compiles_a_pipeline_object_or_a_dotted_module_function(tmp_path):
    """Product code compiles any pipeline: a tfx Pipeline object, or `package.module:function`
    (called with the given arguments); a name that is not there is refused by name."""
    from sage_tfx.pipelines.kubeflow import compile_kubeflow, resolve_pipeline

    source = "sage_tfx.examples.first_pipeline:training_pipeline"
    built = resolve_pipeline(source, pipeline_root="gs://bucket/first")
    job = compile_kubeflow(built, str(tmp_path / "first.json"), "example.com/sage-tfx:0.1.0")
    assert "ObliviousSampleGen" in job["pipelineSpec"]["root"]["dag"]["tasks"]
    with pytest.raises(ValueError, match="defines no function create_pipelin"):
        resolve_pipeline("sage_tfx.examples.first_pipeline:create_pipelin")
    with pytest.raises(ValueError, match="returned str, not a tfx Pipeline"):
        resolve_pipeline(lambda pipeline_root: pipeline_root, pipeline_root="gs://bucket/first")


def _strings(value):
    """Every string in a JSON value, and in the JSON documents some strings hold."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, str):
        yield value
        try:
            inner = json.loads(value)
        except ValueError:
            return
        if isinstance(inner, (dict, list)):
            yield from _strings(inner)


@pytest.mark.slow
def test_the_compiled_job_names_no_file_of_the_compiling_machine(tmp_path, compile_with,
                                                                compile_job):
    """Issue 29 item 11: the cluster's containers have the image, not this machine's files; a
    job naming the repository's module file would fail in DPTrainer after the grant."""
    job = compile_job()
    local = [s for s in _strings(job) if s.startswith((REPO_ROOT, str(tmp_path)))]
    assert local == []
    trainer = job["pipelineSpec"]["root"]["dag"]["tasks"]["DPTrainer"]["inputs"]["parameters"]
    assert trainer["module_file"]["runtimeValue"]["constant"] == \
        "sage_tfx.examples.taxi.taxi_module"
    # A path of this machine given to the CLI is refused before anything is written.
    from sage_tfx.examples.taxi.pipeline import MODULE_FILE
    out = tmp_path / "refused.json"
    code, _, stderr = compile_with("--out", str(out), *TAXI, "--module-file", MODULE_FILE)
    assert code == 2 and "is a path on this machine" in stderr
    assert not out.exists()


def test_a_module_file_of_this_machine_is_refused_naming_the_fix():
    from sage_tfx.examples.first_pipeline import MODEL_MODULE, create_pipeline
    from sage_tfx.pipelines.kubeflow import IMAGE_ROOT, check_module_files

    local = create_pipeline("gs://bucket/first", ingest=False, module_file=MODEL_MODULE)
    with pytest.raises(ValueError, match=r"DPTrainer's module_file '.*trip_model.py' is a path "
                                         r"on this machine.*Pass a path inside the image "
                                         r"\(under /opt/sage-tfx/.*or a module path"):
        check_module_files(local)
    for relative in ("examples/trip_model.py", "trip_model.py"):  # the container's cwd decides
        with pytest.raises(ValueError, match="is a path on this machine"):
            check_module_files(create_pipeline("gs://b/f", ingest=False, module_file=relative))
    with pytest.raises(ValueError, match="is a path on this machine"):
        check_module_files(create_pipeline("gs://b/f", ingest=False,
                                           module_file=f"{IMAGE_ROOT}/../home/me/model.py"))
    for portable in (f"{IMAGE_ROOT}/examples/trip_model.py", "sage_tfx.examples.trip_model",
                     "my_company.models.trips"):
        check_module_files(create_pipeline("gs://b/f", ingest=False, module_file=portable))


def test_custom_artifact_types_import_from_their_type_names():
    """TFX's Kubeflow V2 entrypoint imports each artifact's class from its type's title."""
    from tfx.types import artifact
    from tfx.utils import import_utils

    import sage_tfx.components as components

    for name in components.__all__:  # imports every component's module
        getattr(components, name)

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    ours = {cls for cls in subclasses(artifact.Artifact)
            if (getattr(cls, "TYPE_NAME", None) or "").startswith("sage_tfx.")}
    assert len(ours) >= 4
    for cls in ours:
        assert import_utils.import_class_by_path(cls.TYPE_NAME) is cls


@pytest.mark.slow
def test_a_compiled_seed_reaches_the_grant_which_refuses_it_on_a_ledger_not_for_tests(
        compile_job):
    """`compile --seed` (tests only; issue 45, item 5): the job's BlockLedger task carries the
    seeded components, and its executor refuses them before the charge unless the ledger was
    created for tests (tests/components/test_block_ledger.py runs that executor)."""
    job = compile_job("--mode", "dp_sgd", "--seed", "6")
    grant = job["pipelineSpec"]["root"]["dag"]["tasks"]["BlockLedger"]["inputs"]["parameters"]
    seeded = json.loads(grant["fixed_seeds"]["runtimeValue"]["constant"])
    assert sorted(seeded) == ["DPTrainer seed 6", "ObliviousSampleGen seed 6"]
    unseeded = compile_job("--mode", "dp_sgd")
    assert "fixed_seeds" not in unseeded["pipelineSpec"]["root"]["dag"]["tasks"]["BlockLedger"][
        "inputs"]["parameters"]
