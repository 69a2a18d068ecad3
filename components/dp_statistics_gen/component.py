"""DPStatisticsGen: TFX's ExampleStatistics in TFDV's format, every number DP and paid by the
grant; DPSchemaGen: TFX's Schema from those statistics or from the user's schema file."""
from __future__ import annotations

import json
from typing import Mapping, Optional, Sequence

from tfx.dsl.components.base import base_component, executor_spec
from tfx.types import channel, component_spec, standard_artifacts

from sage_tfx.components.block_ledger import preflight
from sage_tfx.components.block_ledger.component import check_before_charge
from sage_tfx.components.dp_statistics_gen import executor
from sage_tfx.components.dp_statistics_gen.statistics import DEFAULT_QUANTILES, DEFAULT_TOP_K
from sage_tfx.components.privacy_grant import PrivacyGrant


class DPStatisticsGenSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "grant_step": component_spec.ExecutionParameter(type=str),
        "schema_file": component_spec.ExecutionParameter(type=str, optional=True),
        "columns": component_spec.ExecutionParameter(type=str, optional=True),  # JSON
        "bounds": component_spec.ExecutionParameter(type=str, optional=True),  # JSON
        "num_quantiles": component_spec.ExecutionParameter(type=int),
        "top_k": component_spec.ExecutionParameter(type=int),
    }
    INPUTS = {
        "examples": component_spec.ChannelParameter(type=standard_artifacts.Examples),
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
    }
    OUTPUTS = {
        "statistics": component_spec.ChannelParameter(type=standard_artifacts.ExampleStatistics),
    }


class DPStatisticsGen(base_component.BaseComponent):
    """StatisticsGen for granted Examples: per split, a DatasetFeatureStatisticsList (TFDV's
    format, `Split-<name>/FeatureStats.pb`) of DP statistics, paid by the grant's `grant_step`
    share: the number of examples; per feature its missing count; per numeric feature mean,
    std_dev, min, median, max and a quantile histogram (`num_quantiles` buckets, from one DP
    quantile tree); per string feature its `top_k` values and a rank histogram by DP partition
    selection. The share is split equally among the statistics (statistics.py; printed and
    stored as the `budget_split` property). Unit: one record of the granted blocks.

    The features and their public clamping bounds: a `schema_file` (schema.pbtxt; a numeric
    feature's bounds are its int_domain / float_domain min and max) or `columns` ({name: "int"
    | "float" | "string"}), and `bounds` ({name: (low, high)}, overriding the schema's). A
    numeric feature without bounds is refused when the component is built, and again by the
    BlockLedger before it charges."""

    SPEC_CLASS = DPStatisticsGenSpec
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.Executor)

    def __init__(self, examples: channel.Channel, grant: channel.Channel,
                 schema_file: Optional[str] = None, columns: Optional[Mapping[str, str]] = None,
                 bounds: Optional[Mapping[str, Sequence[float]]] = None,
                 grant_step: str = "statistics", num_quantiles: int = DEFAULT_QUANTILES,
                 top_k: int = DEFAULT_TOP_K):
        given = dict(schema_file=schema_file, columns=dict(columns) if columns else None,
                     bounds={name: [float(v) for v in pair] for name, pair in
                             (bounds or {}).items()},
                     num_quantiles=num_quantiles, top_k=top_k)
        # Refuse here, when the pipeline is built: missing bounds, bad options (no budget).
        executor.plan_for_share(given, ("train",), 1.0, 1e-6)
        super().__init__(spec=DPStatisticsGenSpec(
            grant_step=grant_step, schema_file=schema_file,
            columns=json.dumps(given["columns"]) if columns else None,
            bounds=json.dumps(given["bounds"]) if bounds else None,
            num_quantiles=num_quantiles, top_k=top_k, examples=examples, grant=grant,
            statistics=channel.Channel(type=standard_artifacts.ExampleStatistics)))
        check_before_charge(grant, preflight.Check(
            component="DPStatisticsGen", module_file="", purpose="statistics",
            statistics={**given, "grant_step": grant_step}))


class DPSchemaGenSpec(component_spec.ComponentSpec):
    PARAMETERS = {"schema_file": component_spec.ExecutionParameter(type=str, optional=True)}
    INPUTS = {"statistics": component_spec.ChannelParameter(
        type=standard_artifacts.ExampleStatistics, optional=True)}
    OUTPUTS = {"schema": component_spec.ChannelParameter(type=standard_artifacts.Schema)}


class DPSchemaGen(base_component.BaseComponent):
    """A TFX Schema (`schema.pbtxt`) without TFDV: from DPStatisticsGen's `statistics`
    (schema.infer_schema; post-processing of DP statistics, no budget) or copied from the
    user's `schema_file` (ImportSchemaGen's job). Give exactly one."""

    SPEC_CLASS = DPSchemaGenSpec
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.SchemaExecutor)

    def __init__(self, statistics: Optional[channel.Channel] = None,
                 schema_file: Optional[str] = None):
        if (statistics is None) == (schema_file is None):
            raise ValueError("DPSchemaGen takes either DPStatisticsGen's statistics or a "
                             "schema file: give exactly one")
        super().__init__(spec=DPSchemaGenSpec(
            schema_file=schema_file, statistics=statistics,
            schema=channel.Channel(type=standard_artifacts.Schema)))
