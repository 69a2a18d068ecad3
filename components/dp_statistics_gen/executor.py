"""DPStatisticsGen's and DPSchemaGen's executors.

DPStatisticsGen, the release protocol's order: the grant was charged by the BlockLedger
component, after the preflight (`preflight`, registered by the component) refused missing
bounds; `require_grant` checks the grant and the Examples against the ledger; the plan
(statistics.plan_statistics) is made from public inputs and the step's share, and checked
against the event the grant recorded, all before the share is consumed; then, inside the
protocol (`GrantInfo.releasing`: the step's outcome is recorded), the records are read by the
record rule, the DP queries run, and one `FeatureStats.pb` per split is written (TFX
StatisticsGen's layout: a binary DatasetFeatureStatisticsList in `Split-<name>/`).
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

import numpy as np
import pandas as pd
import tensorflow as tf
from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils

from sage_tfx import console
from sage_tfx.components.dp_statistics_gen import schema as schemas
from sage_tfx.components.dp_statistics_gen.statistics import (RECORD_COLUMN, SPLIT_COLUMN,
                                                              StatisticsError, StatisticsPlan,
                                                              compute, plan_statistics)
from sage_tfx.components.privacy_grant import EXAMPLES_GRANT_ID, GrantError, require_grant
from sage_tfx.components.util.examples_io import read_split, records_table
from sage_tfx.release import GuaranteeUnit
from sage_tfx.sage_access.accounting import pure_dp_event, split_share
from sage_tfx.sage_access.exact import set_exact_property

_FRONT_DOOR = "DPStatisticsGen component"
# Custom properties naming the release on the ExampleStatistics artifact (standard TFX type:
# custom properties only). DPSchemaGen infers only from statistics that carry a guarantee.
GUARANTEE_PROPERTY = "guarantee"
BUDGET_SPLIT_PROPERTY = "budget_split"


def parameters(exec_properties: Mapping[str, Any]) -> dict:
    """The component's parameters as plan_statistics and schemas.public_features take them."""
    columns = exec_properties.get("columns")
    bounds = exec_properties.get("bounds")
    return dict(schema_file=exec_properties.get("schema_file") or None,
                columns=json.loads(columns) if columns else None,
                bounds=json.loads(bounds) if bounds else None,
                num_quantiles=int(exec_properties["num_quantiles"]),
                top_k=int(exec_properties["top_k"]))


def plan_for_share(given: Mapping[str, Any], splits, epsilon: float,
                   delta: float) -> StatisticsPlan:
    """The statistics' plan on a step's share: every check that needs no data (the preflight
    makes it with the split names unknown, the executor with the Examples')."""
    features = schemas.public_features(given["schema_file"], given["columns"], given["bounds"])
    return plan_statistics(features, tuple(splits), epsilon, delta,
                           num_quantiles=given["num_quantiles"], top_k=given["top_k"])


def preflight(given: Mapping[str, Any], grant_step: str, epsilon: float, delta: float,
              split: Mapping[str, Any]) -> None:
    """The BlockLedger's check before it charges (block_ledger.preflight): the step exists,
    every numeric feature has bounds, string features have delta. Raises ValueError."""
    if grant_step not in split:
        raise StatisticsError(f"the grant's split has no {grant_step!r} step for "
                              "DPStatisticsGen")
    plan_for_share(given, ("train",), *split_share(epsilon, delta, split, grant_step))


def _rows(examples, splits, columns: Mapping[str, str]) -> pd.DataFrame:
    """One row per record of every split: the features by the record rule, missing -> NULL,
    with its split and a record id (its position: distinct per record, which is all the
    operator needs of a unit)."""
    frames = []
    for split in splits:
        serialized = [bytes(r) for r in read_split(examples.uri, split).numpy()]
        frame = records_table(serialized, dict(columns), numeric_nulls=True,
                              string_nulls=True).to_pandas()
        frame[SPLIT_COLUMN] = split
        frames.append(frame)
    rows = pd.concat(frames, ignore_index=True)
    rows[RECORD_COLUMN] = np.arange(len(rows))
    return rows


class Executor(base_executor.BaseExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        info = require_grant(input_dict["grant"], input_dict["examples"],
                             consumer="DPStatisticsGen")
        step = exec_properties["grant_step"]
        if step not in info.split:
            raise GrantError(f"grant {info.grant_id} has no {step!r} step (its split: "
                             f"{sorted(info.split)})")
        if info.epsilon is None:
            raise GrantError(f"grant {info.grant_id} is an RDP curve; DP statistics need an "
                             "(epsilon, delta) grant")
        examples = artifact_utils.get_single_instance(input_dict["examples"])
        splits = artifact_utils.decode_split_names(examples.split_names)
        epsilon, delta = split_share(info.epsilon, info.delta or 0.0, info.split, step)
        given = parameters(exec_properties)
        planned = plan_for_share(given, splits, epsilon, delta)
        # A ledger that recorded an event for the step charged that event: a pure Laplace
        # step matches it; partition selection's delta lies outside any event it can carry.
        if planned.pure:
            info.check_event(step, pure_dp_event(epsilon))
        elif info.event(step) is not None:
            raise GrantError(f"step {step!r} of grant {info.grant_id} recorded the event "
                             f"{info.event(step)}, but the top values' partition selection "
                             "spends delta outside any event; use a basic ledger without a "
                             "step mechanism for it")
        console.report("DPStatisticsGen: grant %s, step %s (epsilon %.4g, delta %.3g) split "
                       "equally: %s", info.grant_id, step, epsilon, delta, planned.describe())
        target = artifact_utils.get_single_instance(output_dict["statistics"])
        with info.releasing(step, _FRONT_DOOR) as charged:
            charged.phase = "reading the granted Examples"
            rows = _rows(examples, splits, {f.name: f.kind for f in planned.features})
            charged.phase = "computing the DP statistics"
            released = compute(rows, planned)
            charged.phase = "writing the statistics"
            target.split_names = artifact_utils.encode_split_names(list(splits))
            for split, statistics in released.items():
                directory = artifact_utils.get_split_uri([target], split)
                tf.io.gfile.makedirs(directory)
                with tf.io.gfile.GFile(os.path.join(directory, schemas.STATISTICS_FILE),
                                       "wb") as out:
                    out.write(statistics.SerializeToString())
            target.span = examples.span
            guarantee = charged.guarantee(
                GuaranteeUnit.RECORD, epsilon=epsilon, delta=planned.spent_delta,
                mechanism=f"DP statistics, budget split equally: {planned.describe()}")
            target.set_string_custom_property(GUARANTEE_PROPERTY, guarantee.sentence())
            target.set_string_custom_property(BUDGET_SPLIT_PROPERTY, json.dumps(planned.split))
            target.set_string_custom_property(EXAMPLES_GRANT_ID, info.grant_id)
            set_exact_property(target, "dp_epsilon", epsilon)
            set_exact_property(target, "dp_delta", planned.spent_delta)
            charged.released([target.uri], guarantee)
        console.report("DPStatisticsGen: released statistics of %d split(s); %s", len(splits),
                       guarantee.sentence())


class SchemaExecutor(base_executor.BaseExecutor):
    """DPSchemaGen: the user's schema file copied (ImportSchemaGen's job), or a schema inferred
    from DPStatisticsGen's statistics of the `train` split (else the first split)."""

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        target = artifact_utils.get_single_instance(output_dict["schema"])
        schema_file: Optional[str] = exec_properties.get("schema_file") or None
        if schema_file is not None:
            schema = schemas.read_schema(schema_file)
        else:
            statistics = artifact_utils.get_single_instance(input_dict["statistics"])
            if not statistics.get_string_custom_property(GUARANTEE_PROPERTY):
                raise StatisticsError("these ExampleStatistics state no DP guarantee (they "
                                      "were not made by DPStatisticsGen); a schema is "
                                      "inferred only from DP statistics")
            splits = artifact_utils.decode_split_names(statistics.split_names)
            split = "train" if "train" in splits else splits[0]
            path = os.path.join(artifact_utils.get_split_uri([statistics], split),
                                schemas.STATISTICS_FILE)
            from tensorflow_metadata.proto.v0 import statistics_pb2

            with tf.io.gfile.GFile(path, "rb") as handle:
                schema = schemas.infer_schema(
                    statistics_pb2.DatasetFeatureStatisticsList.FromString(handle.read()))
        tf.io.gfile.makedirs(target.uri)
        with tf.io.gfile.GFile(os.path.join(target.uri, schemas.SCHEMA_FILE), "w") as out:
            out.write(str(schema))
