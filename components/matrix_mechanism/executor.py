"""MatrixMechanism executor: grant check, histogram, matrix mechanism, CSV + Parquet + MLMD.

Order: the spec is parsed and the strategy chosen (both data independent), and the share's
recorded event checked to be the Gaussian that runs, before the grant's share is consumed
inside the release protocol (`GrantInfo.releasing`: the step's outcome is recorded on the
grant); the records of
both splits are read, each mapped to one cell by the record rule (spec.py: a bad or
out-of-domain value counts in its attribute's public default cell; bytes that are no
tf.Example read as an empty one), and only the mechanism's output is written or logged.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError
from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils

from sage_tfx import console, release
from sage_tfx.components.privacy_grant import require_grant
from sage_tfx.components.util.examples_io import SPLITS, read_split
from sage_tfx.dp_statistics.matrix import best_strategy, mechanism
from sage_tfx.dp_statistics.matrix.granted import answers_table, mechanism_text, planned_event
from sage_tfx.dp_statistics.matrix.spec import WorkloadSpec, parse_spec
from sage_tfx.release import GuaranteeUnit

_FRONT_DOOR = "MatrixMechanism component"


def record_columns(serialized: Iterable[bytes], features: Sequence[str]) -> dict[str, list]:
    """Each record's first value of each feature (None when absent); a record that does not
    parse as a tf.Example reads as an empty one (the record rule: a public default)."""
    columns = {feature: [] for feature in features}
    for record in serialized:
        example = tf.train.Example()
        try:
            example.ParseFromString(record)
        except DecodeError:
            example = tf.train.Example()
        for feature in features:
            field = example.features.feature.get(feature)
            kind = field.WhichOneof("kind") if field is not None else None
            values = getattr(field, kind).value if kind else []
            columns[feature].append(values[0] if len(values) else None)
    return columns


def examples_histogram(spec: WorkloadSpec, examples_uri: str) -> np.ndarray:
    """The data vector of every record in the Examples' splits."""
    records = [r for split in SPLITS for r in read_split(examples_uri, split).numpy()]
    return spec.histogram(record_columns(records, spec.features))


def write_answers(directory: str, labels, answered, guarantee) -> None:
    table = answers_table(labels, answered)
    os.makedirs(directory, exist_ok=True)
    release.write_csv(table, os.path.join(directory, "answers.csv"), guarantee)
    release.write_parquet(table, os.path.join(directory, "answers.parquet"), guarantee)


def pipeline_strategy_cache(output_uri: str) -> str:
    """`strategies` under the pipeline root: TFX lays an output out as
    <pipeline root>/<component id>/<output key>/<execution id>."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.normpath(output_uri)))), "strategies")


class Executor(base_executor.BaseExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        spec = parse_spec(exec_properties["workload_spec"])
        answers = artifact_utils.get_single_instance(output_dict["answers"])
        strategy = best_strategy(spec.workload, cache_dir=exec_properties.get("strategy_cache")
                                 or pipeline_strategy_cache(answers.uri)).strategy
        # best_strategy keeps only candidates that support the workload (or raises): refused
        # before anything is consumed.
        examples = artifact_utils.get_single_instance(input_dict["examples"])
        info = require_grant(input_dict["grant"], [examples])
        step = exec_properties.get("grant_step") or "statistics"
        epsilon, delta = info.record.share(step)
        info.check_event(step, planned_event(epsilon, delta))
        # Consumed first: a second consumer gets GrantError, and the first outcome stands.
        with info.releasing(step, _FRONT_DOOR) as charged:
            charged.phase = "reading the granted Examples"
            histogram = examples_histogram(spec, examples.uri)
            charged.phase = "answering the workload"
            answered = mechanism.answer_workload(spec.workload, strategy, histogram,
                                                 epsilon=epsilon, delta=delta)
            info.check_event(step, answered.event)
            guarantee = charged.guarantee(GuaranteeUnit.RECORD,
                                          mechanism=mechanism_text(strategy),
                                          epsilon=epsilon, delta=delta)
            charged.phase = "writing the answers"
            write_answers(answers.uri, spec.workload.labels(), answered, guarantee)
            for name, value in (("epsilon", epsilon), ("delta", delta),
                                ("expected_rmse", answered.expected_rmse)):
                answers.set_float_custom_property(name, float(value))
            answers.set_int_custom_property("queries", spec.workload.query_count)
            answers.set_string_custom_property("strategy", strategy.name)
            answers.set_string_custom_property("event", str(answered.event))
            answers.set_string_custom_property("guarantee", guarantee.sentence())
            answers.set_string_custom_property("query_rmse", json.dumps(
                [float(v) for v in answered.query_rmse]))
            charged.released([answers.uri], guarantee)
        console.report("MatrixMechanism: %d queries answered, expected RMSE %.4g per query; %s",
                       spec.workload.query_count, answered.expected_rmse, guarantee.sentence())
