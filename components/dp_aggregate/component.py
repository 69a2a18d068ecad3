"""DPAggregate: a DP SQL query (SELECT WITH ANONYMIZATION ...) over a grant's Examples."""
from __future__ import annotations

import json
from typing import Mapping

from tfx.dsl.components.base import base_beam_component, executor_spec
from tfx.types import artifact, channel, component_spec

from sage_tfx.components.dag_guard import PrivateExamples
from sage_tfx.components.dp_aggregate import executor
from sage_tfx.components.privacy_grant import PrivacyGrant
from sage_tfx.dp_statistics.aggregation import frontend
from sage_tfx.dp_statistics.aggregation.budget import Composition


class DPStatistics(artifact.Artifact):
    """A DP release: `release.csv` and `release.parquet` under its uri (one row per released
    group). Custom properties only (Kubeflow V2): epsilon, delta (what the steps spend), unit
    (the guarantee's neighbouring relation, in words), grant_id, query, columns (JSON, the
    released column order). TFX's ExampleStatistics holds TFDV feature statistics, which
    StatisticsGen's consumers would read: a table of released aggregates is another type."""

    TYPE_NAME = "sage_tfx.DPStatistics"


class DPAggregateSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "query": component_spec.ExecutionParameter(type=str),
        "unit_column": component_spec.ExecutionParameter(type=str),
        "columns": component_spec.ExecutionParameter(type=str),
        # 1: add each aggregate's noise stddev and 95% interval; clamp counts at 0 (stated).
        "intervals": component_spec.ExecutionParameter(type=int, optional=True),
        "non_negative_counts": component_spec.ExecutionParameter(type=int, optional=True),
    }
    INPUTS = {
        "examples": component_spec.ChannelParameter(type=PrivateExamples),
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
    }
    OUTPUTS = {"statistics": component_spec.ChannelParameter(type=DPStatistics)}


class DPAggregate(base_beam_component.BaseBeamComponent):
    """Runs `query` on the granted Examples (all splits) with the Beam engine of
    sage_tfx.dp_statistics.aggregation, paid by the grant's shares.

    `columns` ({name: "int" | "float" | "string"}) is the Examples' public schema: each record
    is mapped to it by the record rule before anything else; `unit_column` (one of them) is the
    privacy unit. The release's unit (its `unit` property) is read from how the granted blocks
    were cut: all rows of one unit when every block was cut by `unit_column`
    (BlockExampleGen with block_by="users" and block_key=unit_column), else the weaker "within
    the blocks read" (e.g. blocks by month). The query is parsed and checked (row ownership, columns, options) when the
    pipeline is built. `intervals`: each aggregate also gets `<name>_stddev`, `<name>_ci_low`
    and `<name>_ci_high` (its noise and a 95% interval, post-processing);
    `non_negative_counts`: counts clamped at 0, stated in the guarantee. Request its grant with `split=DPAggregate.split(...)` on the BlockLedger
    component (a basic ledger: the steps' events are checked, when recorded, at run time).
    """

    SPEC_CLASS = DPAggregateSpec
    SPENDS_GRANT = True  # may read private records (dag_guard)
    EXECUTOR_SPEC = executor_spec.BeamExecutorSpec(executor.Executor)

    def __init__(self, examples: channel.Channel, grant: channel.Channel, query: str,
                 unit_column: str, columns: Mapping[str, str], intervals: bool = False,
                 non_negative_counts: bool = False):
        # Refuse a bad query now, when the pipeline is built.
        frontend.check_query(*executor.query_inputs(query, unit_column, dict(columns)))
        super().__init__(spec=DPAggregateSpec(
            query=query, unit_column=unit_column, columns=json.dumps(dict(columns)),
            intervals=int(bool(intervals)), non_negative_counts=int(bool(non_negative_counts)),
            examples=examples, grant=grant, statistics=channel.Channel(type=DPStatistics)))

    @staticmethod
    def split(query: str, unit_column: str, columns: Mapping[str, str], epsilon: float,
              delta: float) -> dict[str, str]:
        """The grant's split among the query's steps (for BlockLedger's `split`): the basic
        plan's shares, which a PLD plan keeps (it only recalibrates each step's noise:
        budget.plan), so no privacy accountant runs when the pipeline is built."""
        planned = frontend.plan_query(*executor.query_inputs(query, unit_column, dict(columns)),
                                      epsilon, delta, Composition.BASIC)
        return frontend.grant_terms(planned.budget).split
