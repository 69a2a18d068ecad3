"""The DAG guard (issue 44 part 1): records from the ledger reach only components that spend a
grant. TFX's standard StatisticsGen, Transform, Trainer, SchemaGen and ExampleValidator cannot
be imported without TFDV, so they are stand-ins here: the standard spec and class name, with an
executor that fails the test if it ever runs."""
import json
import os

import pytest
from tfx.dsl.component.experimental.annotations import InputArtifact, OutputDict
from tfx.dsl.component.experimental.decorators import component
from tfx.dsl.components.base import base_component, base_executor, executor_spec
from tfx.dsl.components.common import resolver
from tfx.dsl.input_resolution.strategies.latest_artifact_strategy import LatestArtifactStrategy
from tfx.orchestration import metadata, pipeline
from tfx.orchestration.local.local_dag_runner import LocalDagRunner
from tfx.types import channel, standard_artifacts, standard_component_specs as specs

from sage_tfx.components import (DPTransform, ObliviousSampleGen, PrivateExamples, declare_dp,
                                 declare_public)
from sage_tfx.components.dag_guard import DECLARED_DP, DECLARED_PUBLIC, PrivateRecordsRefused
from sage_tfx.pipelines.kubeflow import compile_command
from sage_tfx.pipelines.local import run_local
from sage_tfx.sage_access import BlockLedger, connect

from support.ingest import ingest_and_grant
from support.pipeline_consumer import GrantChecker


class _MustNotRun(base_executor.BaseExecutor):
    def Do(self, input_dict, output_dict, exec_properties):
        raise AssertionError("a refused component ran")


def _stand_in(name, spec_class):
    """A component with TFX's standard spec and class name; its outputs and required
    parameters are filled as the standard component fills them."""
    def __init__(self, **inputs):
        outputs = {key: channel.Channel(type=parameter.type)
                   for key, parameter in spec_class.OUTPUTS.items()}
        required = {key: {} for key, parameter in spec_class.PARAMETERS.items()
                    if not parameter.optional}  # train_args/eval_args: empty protos
        base_component.BaseComponent.__init__(
            self, spec=spec_class(**inputs, **outputs, **required))
    return type(name, (base_component.BaseComponent,), {
        "SPEC_CLASS": spec_class, "__init__": __init__,
        "EXECUTOR_SPEC": executor_spec.ExecutorClassSpec(_MustNotRun)})


StatisticsGen = _stand_in("StatisticsGen", specs.StatisticsGenSpec)
Transform = _stand_in("Transform", specs.TransformSpec)
Trainer = _stand_in("Trainer", specs.TrainerSpec)
SchemaGen = _stand_in("SchemaGen", specs.SchemaGenSpec)
ExampleValidator = _stand_in("ExampleValidator", specs.ExampleValidatorSpec)


@component
def PlainCounter(examples: InputArtifact[standard_artifacts.Examples]) -> OutputDict(n=int):
    raise AssertionError("a refused component ran")


@component
def PrivateCounter(examples: InputArtifact[PrivateExamples]) -> OutputDict(n=int):
    raise AssertionError("a refused component ran")


def _sources(tmp_path):
    """The private channels a pipeline has: BlockExampleGen's and BlockLedger's Examples,
    DPTransform's transformed Examples, ObliviousSampleGen's samples."""
    store = str(tmp_path / "metadata.sqlite")
    gen, grant = ingest_and_grant(str(tmp_path), store)
    transform = DPTransform(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                            module_file="sage_tfx.examples.trip_model")
    sampler = ObliviousSampleGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                                 scheme="swo", sample_size=4, public_size=16)
    return store, {"BlockExampleGen": gen.outputs["examples"],
                   "BlockLedger": grant.outputs["examples"],
                   "DPTransform": transform.outputs["transformed_examples"],
                   "ObliviousSampleGen": sampler.outputs["samples"]}


CONSUMERS = {  # name: (build on a private channel, the replacement its refusal names)
    "StatisticsGen": (lambda examples: StatisticsGen(examples=examples), "DPStatisticsGen"),
    "Transform": (lambda examples: Transform(examples=examples), "DPTransform"),
    "Trainer": (lambda examples: Trainer(examples=examples), "DPTrainer"),
    "Evaluator": (lambda examples: _evaluator(examples), "SLAedValidator"),
    # ExampleValidator and SchemaGen read statistics: the StatisticsGen before them is refused.
    "ExampleValidator": (lambda examples: ExampleValidator(
        statistics=StatisticsGen(examples=examples).outputs["statistics"],
        schema=channel.Channel(type=standard_artifacts.Schema)), "run on DP statistics"),
    "SchemaGen": (lambda examples: SchemaGen(
        statistics=StatisticsGen(examples=examples).outputs["statistics"]),
        "run on DP statistics"),
    "@component": (lambda examples: PlainCounter(examples=examples), "declare_dp"),
}


def _evaluator(examples):
    from tfx.components.evaluator.component import Evaluator

    return Evaluator(examples=examples, model=channel.Channel(type=standard_artifacts.Model))


@pytest.mark.parametrize("consumer", sorted(CONSUMERS))
def test_standard_consumers_are_refused_when_built_naming_the_replacement(tmp_path, consumer):
    store, sources = _sources(tmp_path)
    build, replacement = CONSUMERS[consumer]
    for source, examples in sources.items():
        with pytest.raises(TypeError) as refused:
            build(examples)
        message = str(refused.value)
        assert "sage_tfx.PrivateExamples (private records from the sage-tfx ledger" in message
        assert replacement in message, source
    assert BlockLedger(store).grant_records() == []


def test_a_component_that_takes_private_examples_is_refused_when_the_pipeline_is_built(tmp_path):
    store, sources = _sources(tmp_path)
    gen, grant = sources["BlockExampleGen"].producer_component, \
        sources["BlockLedger"].producer_component
    counter = PrivateCounter(examples=grant.outputs["examples"])
    with pytest.raises(PrivateRecordsRefused) as refused:
        pipeline.Pipeline(pipeline_name="leak", pipeline_root=str(tmp_path / "root"),
                          components=[gen, grant, counter])
    assert ("PrivateCounter (PrivateCounter) reads private records on its input 'examples' "
            "(from BlockLedger.examples)") in str(refused.value)
    assert "declare_dp" in str(refused.value)
    # A component forced to take PrivateExamples keeps its standard spec: named by it.
    trainer_spec = type("TrainerSpec", (specs.TrainerSpec,), {"INPUTS": {
        **specs.TrainerSpec.INPUTS, "examples": specs.ChannelParameter(type=PrivateExamples)}})
    trainer = _stand_in("MyTrainer", trainer_spec)(examples=grant.outputs["examples"])
    with pytest.raises(PrivateRecordsRefused, match="MyTrainer .*use DPTrainer instead"):
        pipeline.Pipeline(pipeline_name="leak", pipeline_root=str(tmp_path / "root"),
                          components=[gen, grant, trainer])
    assert BlockLedger(store).grant_records() == []


def _through_a_resolver(tmp_path):
    """BlockExampleGen -> BlockLedger, and a component reading the latest granted Examples
    through a Resolver: no direct edge from a sage-tfx producer, so only check_pipeline sees
    it."""
    store = str(tmp_path / "metadata.sqlite")
    gen, grant = ingest_and_grant(str(tmp_path), store)
    latest = resolver.Resolver(strategy_class=LatestArtifactStrategy,
                               examples=channel.Channel(type=PrivateExamples)).with_id("latest")
    counter = PrivateCounter(examples=latest.outputs["examples"])
    return store, pipeline.Pipeline(
        pipeline_name="leak", pipeline_root=str(tmp_path / "root"),
        components=[gen, grant, latest, counter],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store))


def test_run_local_refuses_before_anything_runs(tmp_path):
    store, leaking = _through_a_resolver(tmp_path)
    with pytest.raises(PrivateRecordsRefused) as refused:
        run_local(leaking)
    message = str(refused.value)
    assert "pipeline 'leak': PrivateCounter (PrivateCounter) reads private records on its " \
           "input 'examples'" in message
    assert "Nothing ran and nothing was charged" in message
    assert BlockLedger(store).grant_records() == []
    # Nothing ran, not even BlockExampleGen: the one execution is the ledger's creation.
    assert [e.type for e in connect(store).get_executions()] == ["sage_tfx.LedgerUpdate"]


def test_sage_tfx_compile_refuses_and_writes_nothing(tmp_path, capsys):
    _, leaking = _through_a_resolver(tmp_path)
    out = str(tmp_path / "job.json")
    assert compile_command(leaking, out, "image", str(tmp_path / "root")) == 2
    assert "PrivateCounter (PrivateCounter) reads private records" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_declared_data_public_reaches_standard_components_and_is_recorded(tmp_path):
    store = str(tmp_path / "metadata.sqlite")
    gen, _ = ingest_and_grant(str(tmp_path), store)
    with pytest.raises(ValueError, match="reason"):
        declare_public(gen.outputs["examples"], reason=" ")
    declare_public(gen.outputs["examples"], reason="the synthetic trips are public")
    statistics = StatisticsGen(examples=gen.outputs["examples"])
    pipeline.Pipeline(pipeline_name="public", pipeline_root=str(tmp_path / "root"),
                      components=[gen, statistics])
    assert json.loads(gen.exec_properties[DECLARED_PUBLIC]) == {
        "examples": "the synthetic trips are public"}


def test_a_component_declared_dp_is_let_through_and_recorded(tmp_path):
    store, sources = _sources(tmp_path)
    with pytest.raises(ValueError, match="guarantee"):
        declare_dp(PrivateCounter(examples=sources["BlockLedger"]), guarantee="")
    counter = declare_dp(PrivateCounter(examples=sources["BlockLedger"]),
                         guarantee="publishes a count with Laplace noise paid by its grant")
    gen, grant = (sources[name].producer_component for name in ("BlockExampleGen", "BlockLedger"))
    pipeline.Pipeline(pipeline_name="declared", pipeline_root=str(tmp_path / "root"),
                      components=[gen, grant, counter])
    assert counter.exec_properties[DECLARED_DP] == \
        "publishes a count with Laplace noise paid by its grant"


@pytest.mark.slow
def test_a_cached_rerun_charges_nothing_and_says_so(tmp_path):
    """A declared-DP consumer runs and its declaration is in ML Metadata; the same pipeline run
    again with TFX's cache on is served from the cache: no new grant, and one line says so."""
    store = str(tmp_path / "metadata.sqlite")
    gen, grant = ingest_and_grant(str(tmp_path), store, split={"training": 1.0})
    checker = GrantChecker(grant=grant.outputs["grant"], examples=grant.outputs["examples"])

    def cached_pipeline():
        return pipeline.Pipeline(
            pipeline_name="cached", pipeline_root=str(tmp_path / "root"),
            components=[gen, grant, checker], enable_cache=True,
            metadata_connection_config=metadata.sqlite_metadata_connection_config(store))

    reports = []
    run_local(cached_pipeline(), report=reports.append)
    [charged] = [g["grant_id"] for g in BlockLedger(store).grant_records()]
    spent = [tuple(b.spent) for b in BlockLedger(store).blocks()]
    [execution] = [e for e in connect(store).get_executions() if "GrantChecker" in e.type]
    assert execution.custom_properties[DECLARED_DP].string_value == \
        "publishes only the id of its grant, never a record"
    assert reports == []

    run_local(cached_pipeline(), report=reports.append)
    assert [g["grant_id"] for g in BlockLedger(store).grant_records()] == [charged]
    assert [tuple(b.spent) for b in BlockLedger(store).blocks()] == spent
    assert reports == [
        "served from TFX's cache, nothing run and nothing charged: BlockExampleGen, "
        f"BlockLedger, GrantChecker; grant {charged} was charged once, by the run "
        "that made it"]
    # The same through TFX's own runner: the cache serves, nothing is charged.
    LocalDagRunner().run(cached_pipeline())
    assert [g["grant_id"] for g in BlockLedger(store).grant_records()] == [charged]


@pytest.mark.slow
def test_the_compiled_job_records_a_declared_dp_component(tmp_path):
    from sage_tfx.pipelines.kubeflow import compile_kubeflow

    store = str(tmp_path / "metadata.sqlite")
    gen, grant = ingest_and_grant(str(tmp_path), store)
    checker = GrantChecker(grant=grant.outputs["grant"], examples=grant.outputs["examples"])
    job = compile_kubeflow(pipeline.Pipeline(pipeline_name="declared",
                                             pipeline_root=str(tmp_path / "root"),
                                             components=[gen, grant, checker]),
                           str(tmp_path / "job.json"), "image")
    [task] = [t for name, t in job["pipelineSpec"]["root"]["dag"]["tasks"].items()
              if "GrantChecker" in name]
    assert task["inputs"]["parameters"][DECLARED_DP]["runtimeValue"]["constant"] == \
        "publishes only the id of its grant, never a record"
