"""sage-tfx's Beam executors in a compiled Kubeflow job's task: TFX's Kubeflow V2 entrypoint
hands them its own program path as a Beam argument, which must not make every task build and
stage an sdist of TFX (components/util/beam_executor.py)."""
import sys

import pytest
from tfx.dsl.components.base import base_beam_executor
from tfx.orchestration.kubeflow.v2.container import kubeflow_v2_run_executor
from tfx.utils import dependency_utils

from sage_tfx.components.block_example_gen import executor as block_example_gen
from sage_tfx.components.dp_aggregate import executor as dp_aggregate
from sage_tfx.components.dp_transform import executor as dp_transform

EXECUTORS = [block_example_gen.Executor, dp_transform.Executor, dp_aggregate.Executor]


@pytest.fixture
def sdists(monkeypatch):
    """The sdists of TFX that TFX's dependency inference builds (recorded, not built)."""
    built = []
    monkeypatch.setattr(dependency_utils, "build_ephemeral_package",
                        lambda: built.append("tfx_ephemeral.tar.gz") or built[-1])
    return built


def _entrypoint_beam_arguments(monkeypatch, *given):
    """The Beam arguments the entrypoint hands an executor, from its own argv as a task runs it
    (`python -m tfx.orchestration.kubeflow.v2.container.kubeflow_v2_run_executor ...`)."""
    argv = [kubeflow_v2_run_executor.__file__, "--executor_class_path", "x.Executor",
            "--json_serialized_invocation_args", "{}", *given]
    monkeypatch.setattr(sys, "argv", argv)
    _, beam_arguments = kubeflow_v2_run_executor._parse_flags(argv)
    return beam_arguments


@pytest.mark.parametrize("executor_class", EXECUTORS)
def test_a_kubeflow_task_builds_no_sdist_of_tfx(monkeypatch, sdists, executor_class):
    beam_arguments = _entrypoint_beam_arguments(monkeypatch)
    assert beam_arguments == [kubeflow_v2_run_executor.__file__]  # TFX's entrypoint, as it is
    executor_class(base_beam_executor.BaseBeamExecutor.Context(beam_pipeline_args=beam_arguments))
    assert sdists == []


@pytest.mark.parametrize("executor_class", EXECUTORS)
def test_beam_arguments_the_job_gives_are_kept_and_handled_by_tfx(monkeypatch, sdists,
                                                                  executor_class):
    beam_arguments = _entrypoint_beam_arguments(monkeypatch, "--direct_num_workers=2")
    executor = executor_class(
        base_beam_executor.BaseBeamExecutor.Context(beam_pipeline_args=beam_arguments))
    assert "--direct_num_workers=2" in executor._beam_pipeline_args
    assert kubeflow_v2_run_executor.__file__ not in executor._beam_pipeline_args
    assert sdists == ["tfx_ephemeral.tar.gz"]  # naming no dependency flag: TFX's inference
