"""DPTransform executor: run the user's preprocessing_fn with tensorflow_transform on Beam, where
only the DP analyzers of analyzers.py may look at the data.

Order (docs/architecture.md): check the grant, then trace the preprocessing_fn and refuse it if it
uses a non-DP analyzer or spends more than the transform share, and only then read a record. The
analysis runs on the granted train split; both splits are transformed with the result.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Optional

import apache_beam as beam
import tensorflow as tf
import tensorflow_transform as tft
import tensorflow_transform.beam as tft_beam
from tensorflow_transform import analyzer_nodes, impl_helper
from tensorflow_transform.tf_metadata import dataset_metadata, metadata_io
from tfx.types import artifact_utils
from tfx_bsl.public import tfxio

from sage_tfx.components.dp_transform import calls, row_audit
from sage_tfx import console
from sage_tfx.components.dp_transform.analyzers import (DPTransformError, TransformPlan,
                                                        is_dp_analyzer, transform_budget)
from sage_tfx.release import GuaranteeUnit
from sage_tfx.components.privacy_grant import EXAMPLES_GRANT_ID, carry_grant, require_grant
from sage_tfx.components.record_rule import RecordRuleError, check_spec, sanitise_record
from sage_tfx.components.util.beam_executor import BeamExecutor
from sage_tfx.components.util.examples_io import SPLITS, TRAIN_SPLIT
from sage_tfx.components.util.stand_ins import cause, stand_in_records
from sage_tfx.components.util.user_module import import_module_file
from sage_tfx.sage_access.accounting import pure_dp_event
from sage_tfx.sage_access.exact import set_exact_property

RECORDS = "data_tfrecord-00000-of-00001.gz"


def load_module(path: str, schema_file: Optional[str] = None) -> tuple[Callable, dict]:
    """The module's preprocessing_fn and the raw feature spec: the user's schema's
    (`schema_file`, what TFX's Transform reads from its schema channel; schema_feature_spec)
    when given, else the module's `feature_spec()` (as for DPTrainer)."""
    try:
        module = import_module_file(path)
    except ValueError as error:
        raise DPTransformError(str(error)) from error
    needed = ("preprocessing_fn",) if schema_file else ("preprocessing_fn", "feature_spec")
    missing = [name for name in needed if not hasattr(module, name)]
    if missing:
        raise DPTransformError(f"module file {path} lacks {missing} (needed by DPTransform"
                               + ("" if schema_file else " without a schema file: a schema "
                                  "inferred from DP statistics exists only after the charge")
                               + ")")
    feature_spec = (schema_feature_spec(schema_file) if schema_file
                    else module.feature_spec())
    try:
        check_spec(feature_spec)
    except RecordRuleError as error:
        raise DPTransformError(str(error)) from error
    try:  # TensorFlow Transform's schema, which the executor reads the records with
        dataset_metadata.DatasetMetadata.from_feature_spec(feature_spec)
    except ValueError as error:
        raise DPTransformError(f"the feature spec has no TensorFlow Transform schema: {error} "
                               "(DPTransform's public defaults are 0 and \"\")") from error
    return module.preprocessing_fn, feature_spec


def schema_feature_spec(schema_file: str) -> dict:
    """The raw feature spec of a user's schema.pbtxt, as TFX's Transform parses records with it
    (tensorflow_transform's schema_as_feature_spec), except that a feature without a shape,
    read by TFT as a VarLenFeature (a SparseTensor), is read as one value per record with its
    public default 0 or "" (a FixedLenFeature of shape []). That is what a TFX module's
    `_fill_in_missing` makes of the SparseTensor (a missing value becomes 0 or ""), so the
    module's preprocessing_fn computes the same values, and no SparseTensor (whose values are
    not rows: row_audit.py) reaches it. The record rule fills the default for a missing value,
    in training and in DPTrainer's serving signature alike (the raw metadata written holds
    this spec; TFT's schema has no default values, hence the rule's).
    A record holding several values of such a feature reads it as the default too (the
    record rule's; `_fill_in_missing` assumes at most one value and fails on more): every map
    here acts on one record alone, so the DP analyzers' guarantees hold."""
    from tensorflow_transform.tf_metadata import schema_utils
    from sage_tfx.components.dp_statistics_gen.schema import read_schema
    from sage_tfx.components.dp_statistics_gen.statistics import StatisticsError

    try:
        schema = read_schema(schema_file)
    except StatisticsError as error:
        raise DPTransformError(str(error)) from None
    spec = schema_utils.schema_as_feature_spec(schema).feature_spec
    return {name: (tf.io.FixedLenFeature([], feature.dtype)
                   if isinstance(feature, tf.io.VarLenFeature) else feature)
            for name, feature in spec.items()}


def _analyzer_defs(graph: tf.Graph):
    """Every analyzer node (and tensor source) the traced graph's outputs depend on."""
    seen, pending = set(), [sink.future for sink in
                            graph.get_collection(analyzer_nodes.TENSOR_REPLACEMENTS)]
    while pending:
        operation = pending.pop().parent_operation
        if id(operation) in seen:
            continue
        seen.add(id(operation))
        if isinstance(operation.operation_def, (analyzer_nodes.AnalyzerDef,
                                                analyzer_nodes.TensorSource)):
            yield operation.operation_def
        pending.extend(operation.inputs)


def audit(preprocessing_fn: Callable, feature_spec: dict, epsilon: float,
          delta: float = 0.0) -> list:
    """Trace the preprocessing_fn without data; raise unless every analyzer is a DP analyzer,
    the shares fit, and everything else treats each record on its own (row_audit.py). Returns
    the (analyzer, share) list (plan_transform has the whole plan)."""
    return plan_transform(preprocessing_fn, feature_spec, epsilon, delta).shares


def plan_transform(preprocessing_fn: Callable, feature_spec: dict, epsilon: float,
                   delta: float = 0.0) -> TransformPlan:
    """`audit`, returning the plan of the DP analyzers: their shares of the step's (epsilon,
    delta) and each one's planned release, hence the event the step runs (analyzers.py)."""
    with transform_budget(epsilon, delta) as budget:
        graph, inputs, outputs = impl_helper.trace_preprocessing_function(
            budget.wrap(preprocessing_fn), feature_spec, use_tf_compat_v1=True)
        budget.spends()
    definitions = list(_analyzer_defs(graph))
    sources = [d for d in definitions if isinstance(d, analyzer_nodes.TensorSource)]
    others = [d for d in definitions if not is_dp_analyzer(d)]
    if any(not isinstance(d, analyzer_nodes.TensorSource) for d in others):
        raise DPTransformError(non_private_refusal(others, inputs))
    with graph.as_default():
        mixing = row_audit.problems(graph, inputs, outputs,
                                    [tensor for source in sources for tensor in source.tensors])
    if mixing:
        raise DPTransformError(
            "the preprocessing_fn mixes the records of a batch outside the DP analyzers (TFT "
            "runs it on arbitrary batches, so one record's output would depend on others): "
            + "; ".join(mixing))
    return budget.resolve()


def non_private_refusal(definitions, inputs: dict) -> str:
    """The refusal of TFT's own analyzers, naming the user's calls (calls.user_calls)."""
    from sage_tfx.components.dp_transform import tft as dp_tft

    named = calls.user_calls(definitions, calls.features_by_tensor(inputs))
    without = [call for call in named if call.split("(")[0] not in dp_tft.DP_ANALYZERS]
    advice = ("import `from sage_tfx.components.dp_transform import tft` instead of "
              "tensorflow_transform")
    if without:
        advice = (f"Not supported by DP here: {', '.join(without)} (DP analyzers: "
                  f"{', '.join(dp_tft.DP_ANALYZERS)}, and analyzers.py's)"
                  + (f"; for the others, {advice}" if len(without) < len(named) else ""))
    else:
        advice = f"Each has a DP version: {advice}"
    return (f"the preprocessing_fn uses non-private analyzers ({', '.join(named)}): "
            "tensorflow_transform's analyzers publish exact statistics of the data in the "
            f"TransformGraph, and DPTransform publishes only DP ones. {advice}")


def check_planned_event(recorded, plan: TransformPlan, where: str) -> None:
    """Refuse unless the event a grant records for the transform step (`recorded`) covers what
    the analyzers run. None (a basic ledger without step_mechanisms) charges the step's
    (epsilon, delta): the plan's shares keep the analyzers inside it. A pure epsilon-DP step
    (step_mechanisms "laplace") covers analyzers without delta (their epsilons sum to at most
    the step's). Any other event must be the plan's (step_mechanisms "dp_transform",
    privacy_grant.steps). Run by the BlockLedger's preflight on the planned events, and by
    the executor on the grant's."""
    if recorded is None:
        return
    if recorded == pure_dp_event(plan.epsilon):
        spending_delta = [spend.call for spend in plan.spends if spend.uses_delta]
        if spending_delta:
            raise DPTransformError(
                f"{where} is planned as pure epsilon-DP (mechanism 'laplace'), but "
                f"{', '.join(spending_delta)} spends delta: plan the step as "
                "{'mechanism': 'dp_transform', 'module_file': ...}")
        return
    if recorded != plan.event:
        raise DPTransformError(f"{where} records {recorded}, but the preprocessing_fn's DP "
                               f"analyzers run {plan.event}; nothing was released")


def _analyse_and_transform(raw: dict, feature_spec: dict, preprocessing_fn: Callable,
                           transform_graph_uri: str, transformed_uri: str) -> None:
    """The Beam stages from serialized records (`raw`: a PCollection per split) to the
    transform graph (analysed on the train split) and the transformed Examples of every split.
    The record rule (record_rule.py) runs before TFT parses anything: a record missing a
    feature, or with a malformed or non-finite one, gets the public defaults instead of failing
    the analysis after the grant was charged."""
    raw_metadata = dataset_metadata.DatasetMetadata.from_feature_spec(feature_spec)
    source = tfxio.TFExampleBeamRecord(physical_format="tfrecord", schema=raw_metadata.schema,
                                       telemetry_descriptors=["sage_tfx", "DPTransform"])
    decoded = {split: (raw[split]
                       | f"Sanitise{split}" >> beam.Map(sanitise_record, feature_spec)
                       | f"Decode{split}" >> source.BeamSource())
               for split in SPLITS}
    adapter = source.TensorAdapterConfig()
    transform_fn = ((decoded[TRAIN_SPLIT], adapter)
                    | "Analyze" >> tft_beam.AnalyzeDataset(preprocessing_fn))
    _ = transform_fn | "WriteTransformFn" >> tft_beam.WriteTransformFn(transform_graph_uri)
    for split in SPLITS:
        data, metadata = ((decoded[split], adapter), transform_fn) | \
            f"Transform{split}" >> tft_beam.TransformDataset()
        coder = tft.coders.ExampleProtoCoder(metadata.schema)
        _ = (data
             | f"Encode{split}" >> beam.Map(coder.encode)
             | f"Write{split}" >> beam.io.WriteToTFRecord(
                 os.path.join(transformed_uri, f"Split-{split}", "data_tfrecord"),
                 file_name_suffix=".gz",
                 compression_type=beam.io.filesystem.CompressionTypes.GZIP))


def stand_in_pass(preprocessing_fn: Callable, feature_spec: dict, plan: TransformPlan) -> None:
    """One whole preprocessing pass (every Beam stage of the executor, the DP analyzers with
    their noise and `plan`'s shares included) on public stand-in records of `feature_spec`
    (util/stand_ins.py), in a temporary directory: DPTransformError naming the cause if the
    module's code fails there. The records hold no data, so the outcome and the message depend
    on no record."""
    try:
        with transform_budget(plan.epsilon, plan.delta, plan) as budget, \
                tempfile.TemporaryDirectory() as temp_dir, \
                beam.Pipeline() as pipeline, \
                tft_beam.Context(temp_dir=os.path.join(temp_dir, "tft"),
                                 force_tf_compat_v1=True):
            raw = {split: pipeline | f"StandIn{split}" >> beam.Create(
                       stand_in_records(feature_spec)) for split in SPLITS}
            _analyse_and_transform(raw, feature_spec, budget.wrap(preprocessing_fn),
                                   os.path.join(temp_dir, "transform_graph"),
                                   os.path.join(temp_dir, "transformed_examples"))
    except DPTransformError:
        raise
    except Exception as error:
        raise DPTransformError(f"the preprocessing_fn fails on public stand-in records (built "
                               f"from its feature_spec, fixed seed): {cause(error)}") from error


def _schema_file(input_dict: dict) -> Optional[str]:
    """The schema.pbtxt of the optional `schema` input (DPSchemaGen's, or TFX's SchemaGen's or
    ImportSchemaGen's, which write the same file name)."""
    from sage_tfx.components.dp_statistics_gen.schema import SCHEMA_FILE

    if not input_dict.get("schema"):
        return None
    return os.path.join(artifact_utils.get_single_instance(input_dict["schema"]).uri,
                        SCHEMA_FILE)


def _split_pattern(examples, split: str) -> str:
    return os.path.join(artifact_utils.get_split_uri([examples], split), "*")


class Executor(BeamExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        grant = require_grant(input_dict["grant"], input_dict["examples"])
        epsilon, delta = grant.share(exec_properties["grant_step"])
        with grant.releasing(exec_properties["grant_step"], "DPTransform component") as charged:
            preprocessing_fn, feature_spec = load_module(exec_properties["module_file"],
                                                         _schema_file(input_dict))
            plan = plan_transform(preprocessing_fn, feature_spec, epsilon, delta)
            check_planned_event(grant.event(exec_properties["grant_step"]), plan,
                                f"step {exec_properties['grant_step']!r} of grant "
                                f"{grant.grant_id}")
            console.report("DPTransform: grant %s, transform epsilon %.4g delta %.3g split "
                           "among %s", grant.grant_id, epsilon, delta, plan.describe())

            examples = artifact_utils.get_single_instance(input_dict["examples"])
            transform_graph = artifact_utils.get_single_instance(output_dict["transform_graph"])
            transformed = artifact_utils.get_single_instance(output_dict["transformed_examples"])
            transformed.split_names = artifact_utils.encode_split_names(list(SPLITS))
            with transform_budget(epsilon, delta, plan) as budget, \
                    tempfile.TemporaryDirectory() as temp_dir, \
                    self._make_beam_pipeline() as pipeline, \
                    tft_beam.Context(temp_dir=temp_dir, force_tf_compat_v1=True):
                raw = {split: pipeline | f"Read{split}" >> beam.io.ReadFromTFRecord(
                           _split_pattern(examples, split)) for split in SPLITS}
                _analyse_and_transform(raw, feature_spec, budget.wrap(preprocessing_fn),
                                       transform_graph.uri, transformed.uri)
            if budget.spent_shares() != plan.shares:
                raise DPTransformError("the preprocessing_fn spent different shares when it ran "
                                       "than "
                                       "when it was audited")
            # The raw schema too, as TFX's Transform writes it: the trainer parses raw records
            # with it.
            metadata_io.write_metadata(dataset_metadata.DatasetMetadata.from_feature_spec(
                feature_spec), os.path.join(
                transform_graph.uri, tft.TFTransformOutput.RAW_METADATA_DIR))
            carry_grant(grant, transformed, "DPTransform")
            transform_graph.set_string_custom_property(EXAMPLES_GRANT_ID, grant.grant_id)
            set_exact_property(transform_graph, "dp_epsilon",
                               epsilon * sum(share for _, share in plan.shares))
            # The transform graph holds the DP statistics; the transformed Examples are granted
            # data, transformed record by record, and stay inside the platform.
            charged.released([transform_graph.uri], charged.guarantee(
                GuaranteeUnit.RECORD, epsilon=epsilon, delta=plan.additional_delta))
