"""MatrixMechanism component: Examples + PrivacyGrant + a workload spec -> noisy answers."""
from __future__ import annotations

from typing import Optional

from tfx.dsl.components.base import base_component, executor_spec
from tfx.types import artifact, channel, component_spec

from sage_tfx.components.dag_guard import PrivateExamples
from sage_tfx.components.matrix_mechanism import executor
from sage_tfx.components.privacy_grant import PrivacyGrant
from sage_tfx.dp_statistics.matrix.spec import parse_spec


class WorkloadAnswers(artifact.Artifact):
    """answers.csv and answers.parquet (query, answer, expected_rmse) at the artifact's uri.
    Custom properties only (Kubeflow V2): epsilon, delta, expected_rmse, queries, strategy,
    guarantee (text), event (text), query_rmse (JSON list, in query order)."""

    TYPE_NAME = "sage_tfx.WorkloadAnswers"


class MatrixMechanismSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "workload_spec": component_spec.ExecutionParameter(type=str),
        "grant_step": component_spec.ExecutionParameter(type=str),
        "strategy_cache": component_spec.ExecutionParameter(type=str, optional=True),
    }
    INPUTS = {
        "examples": component_spec.ChannelParameter(type=PrivateExamples),
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
    }
    OUTPUTS = {"answers": component_spec.ChannelParameter(type=WorkloadAnswers)}


class MatrixMechanism(base_component.BaseComponent):
    """Answers every query of `workload_spec` (JSON, sage_tfx.dp_statistics.matrix.spec) from
    the granted `examples` (both splits), spending the grant's `grant_step` share (epsilon,
    delta) on one Gaussian release of the Eigen-Design strategy's answers. The strategy is
    read from, or saved to, `strategy_cache` (default: `strategies` under the pipeline root),
    so later runs of the pipeline skip its selection (dp_statistics/matrix/cache.py)."""

    SPEC_CLASS = MatrixMechanismSpec
    SPENDS_GRANT = True  # may read private records (dag_guard)
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.Executor)

    def __init__(self, examples: channel.Channel, grant: channel.Channel, workload_spec: str,
                 grant_step: str = "statistics", strategy_cache: Optional[str] = None):
        parse_spec(workload_spec)  # a bad spec fails when the pipeline is built
        super().__init__(spec=MatrixMechanismSpec(
            workload_spec=workload_spec, grant_step=grant_step, strategy_cache=strategy_cache,
            examples=examples, grant=grant,
            answers=channel.Channel(type=WorkloadAnswers)))
