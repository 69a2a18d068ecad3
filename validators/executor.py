"""SLAedValidator executor: predictions of the SavedModel on the granted test split, one SLAed
test, and the ModelBlessing."""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf
from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils
from tfx.utils import io_utils, path_utils

from sage_tfx import console
from sage_tfx.release import GuaranteeUnit
from sage_tfx.components.privacy_grant import require_grant
from sage_tfx.components.record_rule import finite, null_record
from sage_tfx.components.util.examples_io import EVAL_SPLIT, read_split
from sage_tfx.components.util.losses import with_reduction
from sage_tfx.components.util.user_module import RecordDecoder, UserModule, raw_spec_needs
from sage_tfx.sage_access.accounting import pure_dp_event
from sage_tfx.sage_access.exact import set_exact_property
from sage_tfx.validators import constants
from sage_tfx.validators.slaed import (ACCEPT, REJECT, RETRY, Metric, ValidationResult,
                                      accuracy_validator, baseline_gap_validator,
                                      loss_validator)

_PREDICTION_BATCH = 4096
# What each metric needs of the user's module (beyond user_module.ALWAYS_NEEDED and, without a
# TransformGraph, user_module.RAW_SPEC_NEEDS).
MODULE_NEEDS = {Metric.LOSS: ("loss",), Metric.ACCURACY: ()}


def check_parameters(metric: str, target: float, confidence: float,
                     loss_bound: Optional[float], baseline_margin: Optional[float] = None,
                     baseline_outputs: Sequence[float] = ()) -> Metric:
    """Refuse bad parameters when the pipeline is built, before anything runs or is charged;
    the metric they name."""
    metric = Metric.parse(metric, "metric")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if metric == Metric.LOSS:
        if loss_bound is None or not loss_bound > 0:
            raise ValueError(f"metric 'loss' needs loss_bound B > 0, got {loss_bound}")
        if not 0.0 <= target <= loss_bound:
            raise ValueError(f"target loss {target} is outside [0, B={loss_bound}]")
    elif not 0.0 <= target <= 1.0:
        raise ValueError(f"target accuracy {target} is outside [0, 1]")
    elif baseline_outputs:
        raise ValueError("baseline_outputs are constant predictions for metric 'loss'; metric "
                         "'accuracy' compares against every class by itself")
    bound = loss_bound if metric == Metric.LOSS else 1.0
    if baseline_margin is not None and not 0.0 <= baseline_margin < bound:
        raise ValueError(f"baseline_margin {baseline_margin} is outside [0, {bound})")
    if not all(np.isfinite(float(value)) for value in baseline_outputs):
        raise ValueError(f"baseline_outputs must be finite numbers, got {list(baseline_outputs)}")
    return metric


def predictions(model_uri: str, serialized: np.ndarray) -> np.ndarray:
    """The serving signature's outputs for every serialized test example."""
    serve = tf.saved_model.load(path_utils.serving_model_path(model_uri)).signatures[
        "serving_default"]
    return np.concatenate([serve(examples=tf.constant(serialized[i:i + _PREDICTION_BATCH]))
                           ["outputs"].numpy()
                           for i in range(0, len(serialized), _PREDICTION_BATCH)])


def per_example_metric(metric: Metric, module: UserModule, labels: np.ndarray,
                       outputs: np.ndarray) -> np.ndarray:
    """Per-example loss, or 1.0/0.0 for correct/incorrect. A non-finite output or label (or
    loss) gives a NaN loss, which the loss validator counts as its bound B, or an incorrect
    prediction: a constant, whatever the bad value was (record_rule)."""
    all_finite = (np.isfinite(outputs.reshape(len(outputs), -1)).all(axis=1)
                  & np.isfinite(labels.reshape(len(labels), -1)).all(axis=1))
    if metric == Metric.LOSS:
        per_example = with_reduction(module.loss(), tf.keras.losses.Reduction.NONE)
        # finite() only lets the loss be computed; the rows it changed are overridden below.
        values = per_example(finite(tf.constant(labels, tf.float32)),
                             finite(tf.constant(outputs, tf.float32))).numpy().reshape(-1)
        return np.where(all_finite, values, np.nan)
    predicted_class = getattr(module, "predicted_class", None)
    if predicted_class is not None:
        predicted = np.asarray(predicted_class(outputs)).reshape(-1)
    elif outputs.ndim == 2 and outputs.shape[1] > 1:
        predicted = np.argmax(finite(tf.constant(outputs)).numpy(), axis=1)
    else:
        predicted = (outputs.reshape(-1) >= 0.5).astype(np.int64)
    return np.where(all_finite & (predicted == labels.reshape(-1)), 1.0, 0.0)


def baseline_losses(metric: Metric, module: UserModule, labels: np.ndarray,
                    outputs: np.ndarray, baseline_outputs: Sequence[float],
                    baseline_model_outputs: Optional[np.ndarray]) -> np.ndarray:
    """Per-example losses (for accuracy, errors) of the public baselines, one column each:
    every class predicted always (accuracy: the classes are the model's outputs, 0..k-1, or
    0 and 1 for one output), or each constant of `baseline_outputs` (loss), then the baseline
    model's outputs when there is one."""
    if metric == Metric.ACCURACY:
        classes = outputs.shape[1] if outputs.ndim == 2 and outputs.shape[1] > 1 else 2
        flat_labels = labels.reshape(len(labels), -1)[:, 0]
        columns = [np.where(flat_labels == label, 0.0, 1.0) for label in range(classes)]
    else:
        columns = [per_example_metric(metric, module, labels, np.full_like(outputs, constant))
                   for constant in baseline_outputs]
    if baseline_model_outputs is not None:
        columns.append(per_example_metric(metric, module, labels, baseline_model_outputs))
        if metric == Metric.ACCURACY:
            columns[-1] = 1.0 - columns[-1]
    return np.stack(columns, axis=1) if columns else np.empty((len(labels), 0))


def validate(metric: Metric, values: np.ndarray, baselines: np.ndarray, target: float,
             epsilon: float, confidence: float, loss_bound: Optional[float],
             baseline_margin: Optional[float]) -> tuple[ValidationResult,
                                                        Optional[ValidationResult]]:
    """The SLAed test of the target, and, when there are baselines and a margin, the baseline
    test (slaed.baseline_gap_validator): each on half of epsilon, each at confidence
    1 - (1 - confidence) / 2, so that an ACCEPT, which needs both, is wrong (misses the target
    or does not beat a baseline by the margin) with probability <= (1 - confidence) / 2, the
    single test's guarantee (union bound). REJECT comes from the target test alone."""
    compare = baseline_margin is not None and baselines.shape[1] > 0
    test_epsilon = epsilon / 2.0 if compare else epsilon
    test_confidence = 1.0 - (1.0 - confidence) / 2.0 if compare else confidence
    if metric == Metric.LOSS:
        result = loss_validator(values, target, test_epsilon, test_confidence, float(loss_bound))
    else:
        result = accuracy_validator(values, target, test_epsilon, test_confidence)
    if not compare:
        return result, None
    model_losses = values if metric == Metric.LOSS else 1.0 - values
    gap = baseline_gap_validator(model_losses, baselines, float(baseline_margin), test_epsilon,
                                 test_confidence,
                                 float(loss_bound) if metric == Metric.LOSS else 1.0)
    outcome = (REJECT if result.outcome == REJECT else
               ACCEPT if result.outcome == ACCEPT and gap.outcome == ACCEPT else RETRY)
    return (ValidationResult(outcome, result.dp_estimate, result.lower_bound,
                             result.upper_bound, target, epsilon, confidence, result.dp_count,
                             result.details), gap)


def write_tfma_metrics(evaluation_uri: str, metric: Metric, result: ValidationResult,
                       gap: Optional[ValidationResult]) -> None:
    """The DP values of the tests as TFMA's Evaluator writes metrics: one MetricsForSlice for the
    overall slice in `metrics.tfrecord`, so tfma.load_metrics and TFMA's viewers read them. Only
    DP releases and their bounds (post-processing); no per-slice metrics (each slice would need
    its own budget), plots or TFMA validation results: the blessing decides."""
    from tensorflow_model_analysis.proto import metrics_for_slice_pb2
    values = {f"dp_{metric}": result.dp_estimate, f"dp_{metric}_lower_bound": result.lower_bound,
              f"dp_{metric}_upper_bound": result.upper_bound}
    if gap is not None:
        values.update(dp_baseline_gap=gap.dp_estimate,
                      dp_baseline_gap_lower_bound=gap.lower_bound)
    metrics = metrics_for_slice_pb2.MetricsForSlice()
    metrics.slice_key.SetInParent()  # the overall slice
    for name, value in values.items():
        entry = metrics.metric_keys_and_values.add()
        entry.key.name = name
        entry.value.double_value.value = float(value)
    tf.io.gfile.makedirs(evaluation_uri)  # a Kubeflow task's output directory may not exist yet
    with tf.io.TFRecordWriter(os.path.join(evaluation_uri, "metrics.tfrecord")) as writer:
        writer.write(metrics.SerializeToString())


class Executor(base_executor.BaseExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        target, confidence = float(exec_properties["target"]), float(exec_properties["confidence"])
        loss_bound = exec_properties.get("loss_bound")
        baseline_margin = exec_properties.get("baseline_margin")
        baseline_outputs = json.loads(exec_properties.get("baseline_outputs") or "[]")
        metric = check_parameters(exec_properties["metric"], target, confidence, loss_bound,
                                  baseline_margin, baseline_outputs)
        examples = artifact_utils.get_single_instance(input_dict["examples"])
        grant = require_grant(input_dict["grant"], [examples])
        step = exec_properties.get("grant_step") or "validation"
        epsilon, _ = grant.share(step)
        with grant.releasing(step, "SLAedValidator component") as charged:
            grant.check_event(step, pure_dp_event(epsilon))  # Laplace releases summing to epsilon
            module = UserModule.load(exec_properties.get("module_file"), metric,
                                     (*MODULE_NEEDS[metric], *raw_spec_needs(
                                         bool(input_dict.get("transform_graph")))))
            model = artifact_utils.get_single_instance(input_dict["model"])

            transform_output = None
            if input_dict.get("transform_graph"):
                import tensorflow_transform as tft
                transform_output = tft.TFTransformOutput(
                    artifact_utils.get_single_instance(input_dict["transform_graph"]).uri)
            decoder = RecordDecoder(module, transform_output)
            # Bad records get their public defaults (record_rule) before the model or the metric
            # sees them: the serving signature would raise on a record missing a feature.
            # Row 0 is a null record, dropped after the metric ran: an empty test split (a dataset
            # of size 0) takes the same path as any other and releases with count 0.
            serialized = np.array(decoder.sanitise([null_record(decoder.raw_spec)] + list(
                read_split(examples.uri, EVAL_SPLIT).numpy())), dtype=object)
            labels = decoder.labels(serialized).numpy()
            outputs = predictions(model.uri, serialized)
            values = per_example_metric(metric, module, labels, outputs)[1:]
            baseline_model_outputs = None
            if input_dict.get("baseline_model"):  # empty before any model was blessed
                baseline_model_outputs = predictions(artifact_utils.get_single_instance(
                    input_dict["baseline_model"]).uri, serialized)
            baselines = baseline_losses(metric, module, labels, outputs, baseline_outputs,
                                        baseline_model_outputs)[1:]
            result, gap = validate(metric, values, baselines, target, epsilon, confidence,
                                   loss_bound, baseline_margin)

            blessing = artifact_utils.get_single_instance(output_dict["blessing"])
            blessed = result.outcome == ACCEPT
            io_utils.write_string_file(os.path.join(blessing.uri, "BLESSED" if blessed
                                                    else "NOT_BLESSED"), "")
            blessing.set_int_custom_property(constants.BLESSED, int(blessed))
            blessing.set_string_custom_property(constants.CURRENT_MODEL, model.uri)
            blessing.set_int_custom_property(constants.CURRENT_MODEL_ID, model.id)
            blessing.set_string_custom_property(constants.OUTCOME, result.outcome)
            blessing.set_string_custom_property(constants.METRIC, metric)
            for name, value in ((constants.DP_METRIC, result.dp_estimate),
                                (constants.LOWER_BOUND, result.lower_bound),
                                (constants.UPPER_BOUND, result.upper_bound),
                                (constants.TARGET, target), (constants.CONFIDENCE, confidence),
                                (constants.EPSILON_USED, epsilon)):
                set_exact_property(blessing, name, value)
            if gap is not None:
                for name, value in ((constants.BASELINE_GAP, gap.dp_estimate),
                                    (constants.BASELINE_GAP_LOWER_BOUND, gap.lower_bound),
                                    (constants.BASELINE_MARGIN, gap.target)):
                    set_exact_property(blessing, name, value)
                blessing.set_int_custom_property(constants.BASELINES, gap.details["baselines"])
                console.report("SLAedValidator: against %d baselines, DP gap %.4g, population "
                               "gap > %.4g (margin %.4g)", gap.details["baselines"],
                               gap.dp_estimate, gap.lower_bound, gap.target)
            if output_dict.get("evaluation"):
                write_tfma_metrics(artifact_utils.get_single_instance(
                    output_dict["evaluation"]).uri, metric, result, gap)
            console.report("SLAedValidator: %s (DP %s %.4g, population %s in [%.4g, %.4g] at "
                           "confidence %.3g, epsilon %.3g)", result.outcome, metric,
                           result.dp_estimate,
                           metric, result.lower_bound, result.upper_bound, confidence, epsilon)
            # The decision depends on the model too: the whole grant's guarantee covers both.
            released = [blessing.uri] + [artifact.uri for artifact in
                                         output_dict.get("evaluation", [])]
            charged.released(released, charged.guarantee(GuaranteeUnit.RECORD))
