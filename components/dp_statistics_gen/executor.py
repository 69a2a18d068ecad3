"""DPStatisticsGen's and DPSchemaGen's executors.

DPStatisticsGen, the release protocol's order: the grant was charged by the BlockLedger
component, after the preflight (`preflight`, registered by the component) refused missing
bounds, features not read as one value, and a grant whose step event or ledger cannot pay for
the plan (`check_payable`); `require_grant` checks the grant and the Examples against the
ledger, and the ledger's record says who wrote the Examples (`check_examples_producer`); the
plan (statistics.plan_statistics) is made from public inputs and the step's share, and checked
against the grant again (it may have been charged elsewhere), all before the share is
consumed; then, inside the
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
from tensorflow_metadata.proto.v0 import statistics_pb2
from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils

from sage_tfx import console
from sage_tfx.components.dp_statistics_gen import schema as schemas
from sage_tfx.components.dp_statistics_gen.statistics import (RECORD_COLUMN, SPLIT_COLUMN,
                                                              StatisticsError, StatisticsPlan,
                                                              compute, plan_statistics)
from sage_tfx.components.privacy_grant import EXAMPLES_GRANT_ID, GrantError, require_grant
from sage_tfx.components.util.examples_io import read_split, records_table
from sage_tfx.dp_statistics.aggregation.frontend import (GrantTerms, check_accountable,
                                                         require_epsilon_delta)
from sage_tfx.dp_statistics.aggregation.spec import QueryError
from sage_tfx.release import GuaranteeUnit
from sage_tfx.sage_access.accounting import BudgetRequest, split_share
from sage_tfx.sage_access.exact import set_exact_property

_FRONT_DOOR = "DPStatisticsGen component"
# Custom properties naming the release on the ExampleStatistics artifact (standard TFX type:
# custom properties only). DPSchemaGen infers only from statistics that carry a guarantee.
GUARANTEE_PROPERTY = "guarantee"
BUDGET_SPLIT_PROPERTY = "budget_split"
# Who may write the Examples DPStatisticsGen reads (the ledger's data records name them:
# ledger.record_data's `producer`), with the output that holds them.
EXAMPLES_PRODUCERS = {"BlockLedger": "the BlockLedger's granted examples",
                      "DPTransform": "DPTransform's transformed_examples"}


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


def check_payable(planned: StatisticsPlan, step: str, request: BudgetRequest,
                  split: Mapping[str, str], events: Mapping[str, Any], accounting,
                  grant: str) -> None:
    """StatisticsError unless a grant of `request` with this split and these step `events`
    ({step: DpEvent}, what the grant records) pays for `planned` on `step`: the ledger's
    accountant would charge it with partition selection's delta spent outside the events (an
    rdp ledger cannot: frontend.check_accountable), and an event recorded for the step is the
    one that runs (StatisticsPlan.step_event). Made before the charge (`preflight`) and again
    for a grant charged elsewhere (the executor). `grant`: names it in the refusal."""
    terms = GrantTerms(dict(split), dict(events), planned.spent_delta)
    try:  # the ledger's rule first, as frontend.check_grant
        check_accountable(request, terms, accounting, f"{grant} cannot pay for DPStatisticsGen")
    except QueryError as error:
        raise StatisticsError(str(error)) from None
    recorded = events.get(step)
    if recorded is not None and recorded != planned.step_event:
        raise StatisticsError(
            f"step {step!r} of {grant} records the event {recorded}, but the statistics run "
            + (f"{planned.step_event}" if planned.pure else
               "partition selection of their string features' top values, whose delta lies "
               "outside any event (use a basic ledger without a step mechanism for it, or "
               "no string feature)") + "; nothing was released")


def preflight(given: Mapping[str, Any], grant_step: str, epsilon: float, delta: float,
              split: Mapping[str, Any], events: Mapping[str, Any], accounting) -> None:
    """The BlockLedger's check before it charges (block_ledger.preflight), with the grant it
    is about to request: (epsilon, delta), its split, the `events` its steps record and its
    ledger's `accounting`. The step exists, every numeric feature has bounds and reads as one
    value, string features have delta, the grant pays for the plan (check_payable). Raises
    ValueError."""
    if grant_step not in split:
        raise StatisticsError(f"the grant's split has no {grant_step!r} step for "
                              "DPStatisticsGen")
    planned = plan_for_share(given, ("train",), *split_share(epsilon, delta, split, grant_step))
    check_payable(planned, grant_step, BudgetRequest(epsilon=epsilon, delta=delta), split,
                  events, accounting, "the grant requested")


def check_examples_producer(producer: Optional[str], where: str) -> None:
    """StatisticsError unless the Examples are one row per record of the granted blocks, as
    the statistics' accounting assumes (one record, one row, in one split): the BlockLedger's
    own granted Examples, or DPTransform's transformed examples (record by record). Not
    ObliviousSampleGen's samples (a record in several samples, filler slots), nor anything
    else derived from the grant. `producer`: who made them (None: unknown)."""
    if producer not in EXAMPLES_PRODUCERS:
        raise StatisticsError(
            f"DPStatisticsGen reads one row per granted record: its examples must be "
            f"{' or '.join(EXAMPLES_PRODUCERS.values())}, but {where} "
            + (f"come from {producer}" if producer else "have no known producer")
            + "; nothing was read or released")


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
        examples = artifact_utils.get_single_instance(input_dict["examples"])
        # The component refused other producers when it was built; the ledger's record of who
        # wrote these Examples is checked too (an Importer, a hand-wired channel).
        check_examples_producer(info.ledger.data_producer(info.record, examples.uri),
                                f"the Examples at {examples.uri}")
        splits = artifact_utils.decode_split_names(examples.split_names)
        granted = require_epsilon_delta(info.record, "DPStatisticsGen")
        epsilon, delta = split_share(*granted, info.split, step)
        planned = plan_for_share(parameters(exec_properties), splits, epsilon, delta)
        recorded = {name: info.ledger.grant_event(info.record, name)
                    for name in info.record.events}
        check_payable(planned, step, BudgetRequest(epsilon=granted[0], delta=granted[1]),
                      info.split, recorded, info.ledger.accounting, f"grant {info.grant_id}")
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
            with tf.io.gfile.GFile(path, "rb") as handle:
                schema = schemas.infer_schema(
                    statistics_pb2.DatasetFeatureStatisticsList.FromString(handle.read()))
        tf.io.gfile.makedirs(target.uri)
        with tf.io.gfile.GFile(os.path.join(target.uri, schemas.SCHEMA_FILE), "w") as out:
            out.write(str(schema))
