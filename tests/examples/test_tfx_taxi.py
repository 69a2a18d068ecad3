"""TFX's own taxi template made private (issue 44 part 6; examples/tfx_taxi, docs/tfx-pipeline.md):
the module converts by a diff of at most 40 lines, the template's preprocessing_fn runs under
DPTransform with the template's schema, and (slow) the converted DAG keeps the template's
stages, pushes a model, records every grant released, and its DP model's held-out AUC is at
least 0.9 of the same model fitted without DP."""
import importlib.util
import os
import re

import pytest

from sage_tfx.components.block_ledger import preflight
from sage_tfx.components.dp_transform.analyzers import DPTransformError
from sage_tfx.components.dp_transform.executor import load_module, plan_transform
from sage_tfx.examples.tfx_taxi import pipeline, template
from sage_tfx.sage_access.errors import BadRequest

from support import REPO_ROOT
from support.seeded_noise import seeded_measurement

MAX_CHANGED_LINES = 40  # the acceptance
# The template's calls, each a DP analyzer now (the module is TFX's, only its import changed).
TEMPLATE_CALLS = [
    "scale_to_z_score(trip_miles)", "scale_to_z_score(fare)", "scale_to_z_score(trip_seconds)",
    "compute_and_apply_vocabulary(payment_type)", "compute_and_apply_vocabulary(company)",
    "bucketize(pickup_latitude)", "bucketize(pickup_longitude)", "bucketize(dropoff_latitude)",
    "bucketize(dropoff_longitude)"]


def test_the_module_converts_by_a_diff_of_at_most_40_lines_applied_to_the_installed_template():
    with open(template.DIFF) as handle:
        diff = handle.read()
    assert template.changed_lines(diff) <= MAX_CHANGED_LINES
    with open(os.path.join(template.template_dir(), template.MODULE_NAME)) as handle:
        original = handle.read()
    converted = template.converted_source()
    assert "import tensorflow_transform as tft\n" in original
    assert "import tensorflow_transform as tft\n" not in converted
    assert "from sage_tfx.components.dp_transform import tft\n" in converted
    # Everything else is TFX's: the template's preprocessing_fn, _fill_in_missing and model.
    for function in ("def preprocessing_fn(inputs):", "def _fill_in_missing(x):",
                     "def _build_keras_model(", "def run_fn(fn_args: FnArgs):"):
        assert original.split(function)[1].split("\ndef ")[0] == \
            converted.split(function)[1].split("\ndef ")[0]
    # A hunk that no longer matches the installed file is refused, not applied elsewhere.
    with pytest.raises(ValueError, match="differs from the diff's hunk"):
        template.apply_diff(original.replace("import tensorflow_transform as tft",
                                             "import tensorflow_transform as tf_transform"),
                            diff)


def test_the_templates_preprocessing_fn_plans_dp_analyzers_on_the_templates_schema():
    """DPTransform reads the raw features from the user's schema as TFX's Transform does (the
    template's module has no feature_spec): each feature without a shape as one value per
    record, which `_fill_in_missing` passes through. Every analyzer is the DP one, an equal
    split of the step, each call named as the user wrote it."""
    preprocessing_fn, spec = load_module(pipeline.MODULE, template.schema_file())
    assert spec["company"].shape == [] and spec["fare"].dtype.name == "float32"
    plan = plan_transform(preprocessing_fn, spec, 0.9, 1e-7)
    assert [call for call, _ in plan.shares] == TEMPLATE_CALLS
    assert all(share == pytest.approx(1 / 9) for _, share in plan.shares)
    # The vocabularies spend the step's delta; nothing else does.
    assert plan.additional_delta == pytest.approx(1e-7)


def test_without_a_schema_file_the_templates_module_is_refused_before_the_charge():
    """A schema inferred from DP statistics exists only after the charge, and the template's
    module has no feature_spec(): the BlockLedger's preflight refuses, nothing charged."""
    check = preflight.Check(component="DPTransform", module_file=pipeline.MODULE,
                            purpose="transform", transform_step="transform")
    with pytest.raises(BadRequest, match=r"nothing was charged.*lacks \['feature_spec'\].*"
                                         r"schema file"):
        preflight.run([check], 1.0, 1e-6, {"transform": 1.0})
    with pytest.raises(DPTransformError, match="does not read as a tensorflow_metadata Schema"):
        load_module(pipeline.MODULE, template.DIFF)


def test_dp_transform_hands_its_schema_file_to_the_preflight():
    from sage_tfx.components import BlockLedger, DPSchemaGen, DPTransform

    grant = BlockLedger(ledger_store="unused.sqlite", epsilon=1.0, delta=1e-6, window=1,
                        split={"transform": 1.0})
    schema = DPSchemaGen(schema_file=template.schema_file())
    DPTransform(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                schema=schema.outputs["schema"], module_file=pipeline.MODULE)
    [check] = preflight.parse(grant.exec_properties[preflight.PROPERTY])
    assert (check.component, check.schema_file) == ("DPTransform", template.schema_file())


def _template_stages() -> list[str]:
    """The component list of TFX's installed taxi_pipeline_native_keras.py, by class."""
    with open(os.path.join(template.template_dir(), "taxi_pipeline_native_keras.py")) as handle:
        source = handle.read()
    variables = re.search(r"components=\[(.*?)\]", source, re.S)[1].split(",")
    classes = dict(re.findall(r"^  (\w+) = (?:resolver\.)?(\w+)\(", source, re.M))
    return [classes[name.strip()] for name in variables if name.strip()]


# The template's stages and their DP stand-ins (docs/tfx-pipeline.md); ExampleValidator stays
# TFX's own where TFDV is installed (it reads only DP statistics), absent here.
STAND_INS = {"CsvExampleGen": ["BlockExampleGen", "BlockLedger"],
             "StatisticsGen": ["DPStatisticsGen"], "SchemaGen": ["DPSchemaGen"],
             "ExampleValidator": [], "Transform": ["DPTransform"],
             "Trainer": ["ObliviousSampleGen", "DPTrainer"],
             "Resolver": ["latest_blessed_model_resolver"], "Evaluator": ["SLAedValidator"],
             "Pusher": ["Pusher"]}

SEED = 1
EPOCHS = 2  # the benchmark's default is 4 (docs/tfx-pipeline.md): the fast version


def _benchmark():
    # The benchmarks are scripts beside the package (not a package): loaded by path.
    spec = importlib.util.spec_from_file_location(
        "tfx_taxi_benchmark", os.path.join(REPO_ROOT, "benchmarks", "tfx_taxi.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """One run of the converted DAG on LocalDagRunner (benchmarks/tfx_taxi.run_pipeline) for
    every assertion below: seeded sampling and DP-SGD noise (a ledger for tests), the other
    mechanisms' noise seeded as the `seeded_noise` fixture seeds it, so the run repeats."""
    from sage_tfx.mechanisms import additive

    workdir = str(tmp_path_factory.mktemp("tfx-taxi"))
    benchmark = _benchmark()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(additive, "_measurement", seeded_measurement())
        result = benchmark.run_pipeline(workdir, EPOCHS, SEED)
    return benchmark, workdir, result


@pytest.mark.slow
def test_the_dag_keeps_the_templates_stages_each_by_its_dp_stand_in(local_run):
    _, _, result = local_run
    expected = [stand_in for stage in _template_stages() for stand_in in STAND_INS[stage]]
    assert sorted(result["stages"]) == sorted(expected)  # TFX orders them topologically


@pytest.mark.slow
def test_the_run_pushes_a_model_and_records_every_grant_released(local_run):
    _, workdir, result = local_run
    assert result["pushed"] is not None
    [grant] = result["grants"]
    assert grant["blocks"] == pipeline.WINDOW and grant["epsilon"] <= 4.0
    assert grant["outcome"] == "released"
    assert grant["steps"] == {step: "released" for step in pipeline.SPLIT}
    assert result["max_epsilon_per_block"] <= 4.0


@pytest.mark.slow
def test_the_dp_models_held_out_auc_is_at_least_0_9_of_the_model_fitted_without_dp(local_run):
    """The fast version of benchmarks/tfx_taxi.py's measurement: 2 epochs, seeded. Measured
    by the benchmark with seed 1 and 2 epochs: DP AUC 0.938, plain Keras 0.898 (ratio 1.04;
    unseeded at 4 epochs 0.9x-1.0x: docs/tfx-pipeline.md). The assertion is the acceptance,
    0.9: a tolerance of 0.14 below the measured ratio for other CPUs' last bits and TF's
    thread order, which move such a ratio by far less."""
    benchmark, workdir, result = local_run
    aucs = benchmark.held_out_aucs(os.path.join(workdir, "metadata.sqlite"), result["pushed"],
                                   EPOCHS, SEED)
    assert aucs["plain_auc"] > 0.85  # the model learns the task without DP
    assert aucs["ratio"] >= 0.9, aucs


def test_the_benchmark_reads_records_for_its_aucs_only_on_a_ledger_for_tests(tmp_path):
    """The held-out AUCs read the block records without DP: on a user's ledger (not created for
    tests) the benchmark refuses before it reads anything."""
    from sage_tfx.sage_access import BlockLedger
    from sage_tfx.sage_access.errors import BadRequest

    store = str(tmp_path / "metadata.sqlite")
    BlockLedger.create(store)
    with pytest.raises(BadRequest, match="ledger for tests"):
        _benchmark().held_out_aucs(store, str(tmp_path / "no-model"), EPOCHS, SEED)


@pytest.mark.slow
def test_the_pushed_model_serves_raw_records_missing_features_as_training_read_them(local_run):
    """TFX's serving_default over raw tf.Examples: a record without features the model reads
    (fare, distance, duration, company, hour) is served as the same record holding their public
    defaults (0 and ""), which is how training read it (record_rule); the features do move the
    prediction, so the comparison can fail. The transform_features signature (TFMA's) is there
    too."""
    import tensorflow as tf

    _, _, result = local_run
    model = tf.saved_model.load(result["pushed"])
    assert {"serving_default", "transform_features"} <= set(model.signatures)

    def record(**values):
        example = tf.train.Example()
        example.features.feature["payment_type"].bytes_list.value.append(b"Credit Card")
        for name, value in values.items():
            feature = example.features.feature[name]
            {bytes: feature.bytes_list, float: feature.float_list, int: feature.int64_list}[
                type(value)].value.append(value)
        return example.SerializeToString()

    serve = model.signatures["serving_default"]

    def predict(serialized):
        return next(iter(serve(examples=tf.constant([serialized])).values())).numpy().tolist()

    missing = predict(record())
    assert missing == predict(record(fare=0.0, trip_miles=0.0, trip_seconds=0, company=b"",
                                     trip_start_hour=0))
    assert missing != predict(record(fare=40.0, trip_miles=12.0, trip_seconds=1800,
                                     company=b"Taxi Affiliation Services", trip_start_hour=18))


@pytest.mark.slow
def test_the_dag_compiles_for_kubeflow_each_stage_a_task(tmp_path):
    """The same DAG as a Kubeflow V2 job (benchmarks/tfx_taxi.py --kubeflow runs it with
    `sage-tfx kubeflow run-local`): a task per stage, the Resolver as TFX compiles it (two
    resolver tasks), the module a module path the tasks import."""
    from sage_tfx.pipelines.kubeflow import compile_kubeflow

    job = compile_kubeflow(
        pipeline.create_pipeline, str(tmp_path / "job.json"), "local",
        pipeline_name=pipeline.PIPELINE_NAME, pipeline_root=str(tmp_path / "root"),
        data_root=template.data_root(), module_file=pipeline.MODULE,
        serving_model_dir=str(tmp_path / "serving"), ledger_store="grpc://127.0.0.1:8080",
        schema_file=template.schema_file())
    tasks = job["pipelineSpec"]["root"]["dag"]["tasks"]
    resolvers = {"latest_blessed_model_resolver-model-blessing-resolver",
                 "latest_blessed_model_resolver-model-resolver"}
    stages = {stand_in for stand_ins in STAND_INS.values() for stand_in in stand_ins}
    assert set(tasks) == (stages - {"latest_blessed_model_resolver"}) | resolvers
    assert tasks["SLAedValidator"]["inputs"]["artifacts"]["baseline_model"][
        "taskOutputArtifact"]["producerTask"] == "latest_blessed_model_resolver-model-resolver"
