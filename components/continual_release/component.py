"""ContinualRelease: the DP-SQLP streaming operator over newly ingested records, one TFX run at a
time, its state carried between runs as an artifact."""
from __future__ import annotations

import json
from typing import Mapping, Optional, Sequence

from tfx.dsl.components.base import base_component, executor_spec
from tfx.dsl.components.common import resolver
from tfx.dsl.input_resolution.strategies.latest_artifact_strategy import LatestArtifactStrategy
from tfx.types import artifact, channel, component_spec

from sage_tfx.components.continual_release import executor
from sage_tfx.components.dag_guard import PrivateExamples, PrivateType, ProducesPrivateRecords
from sage_tfx.components.dp_aggregate.component import DPStatistics
from sage_tfx.components.privacy_grant import PrivacyGrant


class ContinualReleaseState(artifact.Artifact, metaclass=PrivateType):
    """The operator's private state for one window after a run: under its uri, the window's
    directory (stream.json with the window's public parameters and grant id, the operator's
    state, every release so far, the records that arrived before their micro-batch's trigger).
    Custom properties only (Kubeflow V2): grant_id, window_blocks (JSON), committed_step,
    micro_batches. Private: it holds raw counts and the noise key; only the DPStatistics
    releases leave the operator."""

    TYPE_NAME = "sage_tfx.ContinualReleaseState"


def previous_state() -> resolver.Resolver:
    """The Resolver node whose `outputs["state"]` feeds ContinualRelease's `previous_state` on
    every run of a window but its first (which has no state yet: build that run without it).
    TFX's LatestArtifactStrategy: the pipeline's newest ContinualReleaseState; the Kubeflow V2
    compiler accepts it (and no custom strategy)."""
    return resolver.Resolver(strategy_class=LatestArtifactStrategy,
                             state=channel.Channel(type=ContinualReleaseState)
                             ).with_id("continual_release_previous_state")


class ContinualReleaseSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "ledger_store": component_spec.ExecutionParameter(type=str),
        "ledger_context": component_spec.ExecutionParameter(type=str),
        "window_blocks": component_spec.ExecutionParameter(type=str),  # JSON list
        "epsilon": component_spec.ExecutionParameter(type=float),
        "delta": component_spec.ExecutionParameter(type=float),
        "micro_batches": component_spec.ExecutionParameter(type=int),
        "columns": component_spec.ExecutionParameter(type=str),  # JSON {name: type}
        "unit_column": component_spec.ExecutionParameter(type=str),
        "key_column": component_spec.ExecutionParameter(type=str),
        "time_column": component_spec.ExecutionParameter(type=str),
        "value_column": component_spec.ExecutionParameter(type=str, optional=True),
        "value_bound": component_spec.ExecutionParameter(type=float),
        "contribution_limit": component_spec.ExecutionParameter(type=int),
        "mechanism": component_spec.ExecutionParameter(type=str, optional=True),
        "through": component_spec.ExecutionParameter(type=int, optional=True),
        "pipeline_name": component_spec.ExecutionParameter(type=str, optional=True),
    }
    INPUTS = {
        "examples": component_spec.ChannelParameter(type=PrivateExamples),
        "previous_state": component_spec.ChannelParameter(type=ContinualReleaseState,
                                                          optional=True),
    }
    OUTPUTS = {
        "state": component_spec.ChannelParameter(type=ContinualReleaseState),
        "statistics": component_spec.ChannelParameter(type=DPStatistics),
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
    }


class ContinualRelease(ProducesPrivateRecords, base_component.BaseComponent):
    """Runs the window's micro-batches whose trigger time is at most `through` (Unix seconds;
    default: the window's end) on the records that have arrived: `examples` (this run's newly
    ingested records, all splits, mapped to `columns` by the record rule) and those a previous
    run kept for a later trigger (`previous_state`: `previous_state().outputs["state"]`, the
    last run's `state`; omitted on the window's first run).

    The window is the ledger blocks `window_blocks` (registered by their public event-time
    schedule, e.g. `sage-tfx ledger add-block ID --start --end`, before their records arrive).
    The first run charges ONE grant of (epsilon, delta) on them (its event: the operator's
    trees; see docs/streaming.md) before anything is released and emits it as `grant`; later
    runs find the grant id in `previous_state` and charge nothing. `mechanism`: the running
    sums' noise, "tree", "factorization" (the BLT square root) or "auto" (the smaller expected
    error for the window's micro-batches), named in every release. Outputs: `statistics`
    (DPStatistics: the latest trigger's histogram, every trigger of this run under
    triggers/) and `state` for the next run.
    """

    SPEC_CLASS = ContinualReleaseSpec
    SPENDS_GRANT = True  # may read private records (dag_guard)
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.Executor)

    def __init__(self, examples: channel.Channel, ledger_store: str,
                 window_blocks: Sequence[str], epsilon: float, delta: float, micro_batches: int,
                 columns: Mapping[str, str], unit_column: str, key_column: str,
                 time_column: str, value_column: Optional[str] = None,
                 value_bound: float = 1.0, contribution_limit: int = 32,
                 mechanism: str = "auto", through: Optional[int] = None,
                 previous_state: Optional[channel.Channel] = None,
                 ledger_context: str = "default", pipeline_name: Optional[str] = None):
        # Refuse here, when the pipeline is built or compiled, not when it runs on a cluster.
        executor.query_of(dict(columns), unit_column=unit_column, key_column=key_column,
                          time_column=time_column, value_column=value_column,
                          value_bound=value_bound, contribution_limit=contribution_limit,
                          micro_batches=micro_batches, epsilon=epsilon, delta=delta,
                          mechanism=mechanism)
        if not window_blocks:
            raise ValueError("window_blocks names no block")
        super().__init__(spec=ContinualReleaseSpec(
            ledger_store=ledger_store, ledger_context=ledger_context,
            window_blocks=json.dumps(list(window_blocks)), epsilon=float(epsilon),
            delta=float(delta), micro_batches=micro_batches, columns=json.dumps(dict(columns)),
            unit_column=unit_column, key_column=key_column, time_column=time_column,
            value_column=value_column, value_bound=float(value_bound),
            contribution_limit=contribution_limit, mechanism=mechanism, through=through,
            pipeline_name=pipeline_name, examples=examples, previous_state=previous_state,
            state=channel.Channel(type=ContinualReleaseState),
            statistics=channel.Channel(type=DPStatistics),
            grant=channel.Channel(type=PrivacyGrant)))
