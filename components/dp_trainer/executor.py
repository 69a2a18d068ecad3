"""DPTrainer executor: check the grant and the samples, calibrate noise to the training share,
train (DP-SGD or AdaSSP), and write a SavedModel with a serving signature."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2
from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils
from tfx.utils import path_utils

from sage_tfx import console
from sage_tfx.components.dp_trainer import adassp as adassp_lib
from sage_tfx.components.dp_trainer import constants as model_keys
from sage_tfx.components.dp_trainer import dp_sgd, stand_in
from sage_tfx.components.dp_trainer.parameters import (DEFAULT_GRANT_STEP, DEFAULT_MODE,
                                                       TUNABLE, TrainerMode, calibrate_run,
                                                       module_needs)
from sage_tfx.components.oblivious_sample_gen import accounting, samples_io
from sage_tfx.components.oblivious_sample_gen import constants as sample_keys
from sage_tfx.components.oblivious_sample_gen.descriptor import SamplingDescriptor, Scheme
from sage_tfx.components.oblivious_sample_gen.sampling import plan
from sage_tfx.release import GuaranteeUnit
from sage_tfx.components.privacy_grant import require_grant
from sage_tfx.components.util.examples_io import TRAIN_SPLIT, read_split
from sage_tfx.components.util.stand_in_cache import check_once
from sage_tfx.components.util.user_module import RecordDecoder, UserModule, declared_inputs
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.exact import custom_value, set_exact_property


class SamplesMismatch(BadRequest):
    """The samples do not have the layout their sampling descriptor states (a public layout:
    a BadRequest, whose message the release protocol may record and show)."""


def read_descriptor(samples) -> SamplingDescriptor:
    flat = {name: custom_value(samples, name) for name in samples.mlmd_artifact.custom_properties}
    if sample_keys.SCHEME not in flat:
        raise SamplesMismatch(f"the Examples at {samples.uri} carry no sampling descriptor; "
                              "DP-SGD trains on ObliviousSampleGen's output")
    descriptor = SamplingDescriptor.from_properties(flat)
    expected = dataclasses.replace(
        plan(descriptor.scheme, descriptor.n, descriptor.epochs,
             sample_size=descriptor.sample_size, gamma=descriptor.gamma),
        # Poisson is always sized from a DP count, whose undershoot the accountant must cover.
        size_truncation_probability=(accounting.SIZE_TRUNCATION_PROBABILITY
                                     if descriptor.scheme == Scheme.POISSON else 0.0))
    if descriptor != expected:
        raise SamplesMismatch(f"sampling descriptor {descriptor} is not what {descriptor.scheme} "
                              f"sampling of size {descriptor.n} produces ({expected})")
    return descriptor


def check_layout(sample_ids: np.ndarray, descriptor: SamplingDescriptor) -> None:
    """The slots match the descriptor: their number, and each slot's sample id is 0 (a null or
    a dummy) or the sample its unit holds."""
    expected_slots = descriptor.epochs * descriptor.slots_per_epoch
    if len(sample_ids) != expected_slots:
        raise SamplesMismatch(f"the samples hold {len(sample_ids)} slots; the descriptor says "
                              f"{descriptor.epochs} epoch(s) x {descriptor.slots_per_epoch}")
    unit_ids = np.tile(np.repeat(np.arange(1, descriptor.samples_per_epoch + 1),
                                 descriptor.slot_width), descriptor.epochs)
    if np.any((sample_ids != 0) & (sample_ids != unit_ids)):
        raise SamplesMismatch(f"a slot's sample id is not the sample of its unit of "
                              f"{descriptor.slot_width} slots")


def decode_slots(decoder: RecordDecoder, records: list[bytes]) -> tuple[tf.Tensor, tf.Tensor,
                                                                         np.ndarray]:
    """(inputs, labels, real) for every slot, real or not, in slot order: an empty slot is
    sanitised to the null record (every feature at its default) and zeroed, so all slots take
    the same path."""
    real = np.array([len(record) > 0 for record in records])
    inputs, labels = decoder.decode(records)
    mask = tf.constant(real)

    def zeroed(tensor):
        return tf.where(tf.reshape(mask, [-1] + [1] * (tensor.shape.rank - 1)), tensor,
                        tf.zeros_like(tensor))
    return tf.nest.map_structure(zeroed, inputs), zeroed(labels), real


def write_scalar(tag: str, value: float) -> None:
    """A TensorBoard scalar, written with TensorFlow's own summary op: `tf.summary.scalar` needs
    the tensorboard package, which the platform does not install (TensorBoard reads the logs)."""
    metadata = summary_pb2.SummaryMetadata()
    metadata.plugin_data.plugin_name = "scalars"
    tf.summary.write(tag, tf.constant(value, tf.float32), metadata=metadata)


class _Serving(tf.Module):
    """What the SavedModel holds: the model, the transform layer, and the signatures a TFX
    run_fn exports: `serving_default` (serialized raw tf.Examples, label absent -> {"outputs":
    predictions}) and, with a transform graph, `transform_features` (serialized raw
    tf.Examples -> the transformed features, which TFMA reads). Both map a bad feature as
    training does, to its public default: one missing, holding another number of values than
    its spec (an empty list, two for one) or a non-finite float (record_rule.
    parse_with_defaults). Not mapped: a value list of another type than the spec's (text or
    int64 for a float feature; training converts an exact one) and bytes that are no
    tf.Example: the request fails."""

    def __init__(self, model: tf.keras.Model, decoder: RecordDecoder):
        super().__init__()
        self.model = model
        self.decoder = decoder
        self.transform_layer = decoder.transform_layer
        self.exported = {"serving_default": tf.function(
            lambda examples: {"outputs": self.model(self.decoder.serving_inputs(examples))},
            input_signature=[_EXAMPLES])}
        if self.transform_layer is not None:
            self.exported["transform_features"] = tf.function(
                self.decoder.transformed_features, input_signature=[_EXAMPLES])


_EXAMPLES = tf.TensorSpec([None], tf.string, name="examples")


def save_model(model: tf.keras.Model, decoder: RecordDecoder, model_uri: str) -> str:
    path = path_utils.serving_model_path(model_uri)
    module = _Serving(model, decoder)
    tf.saved_model.save(module, path, signatures=module.exported)
    return path


class Executor(base_executor.BaseExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        mode = TrainerMode.parse(exec_properties.get("mode") or DEFAULT_MODE, "trainer mode")
        examples = artifact_utils.get_single_instance(input_dict["examples"])
        grant = require_grant(input_dict["grant"], [examples])
        grant.refuse_fixed_seed("DPTrainer", exec_properties.get("seed"))
        if input_dict.get("hyperparameters"):
            # (Imported here: DPTuner's package builds on this one's component.)
            from sage_tfx.components.dp_tuner.search_space import read_best_hyperparameters

            # As TFX's Trainer: the one file of the HyperParameters artifact (public: the tuner
            # released it under its own grant step), read before any share is consumed.
            exec_properties = {**exec_properties, **read_best_hyperparameters(
                artifact_utils.get_single_uri(input_dict["hyperparameters"]))}
        unset = [name for name in TUNABLE if exec_properties.get(name) is None]
        if mode == TrainerMode.DP_SGD and unset:
            raise ValueError(f"DP-SGD needs {unset}: give them, or hyperparameters holding them "
                             "(nothing of the training share was consumed)")
        step = exec_properties.get("grant_step") or DEFAULT_GRANT_STEP
        epsilon, delta = grant.share(step)
        with grant.releasing(step, "DPTrainer component") as charged:
            if mode == TrainerMode.DP_SGD:
                # DP-SGD has no event before it runs (privacy_grant.planned_event), so the ledger
                # must have charged its (epsilon, delta) share, not another mechanism's curve.
                grant.check_event(step, None)
            transform_graph = bool(input_dict.get("transform_graph"))
            module = UserModule.load(exec_properties.get("module_file"), mode,
                                     module_needs(mode, transform_graph),
                                     model_fn=exec_properties.get("model_fn"))
            transform_output = None
            if transform_graph:
                import tensorflow_transform as tft
                transform_output = tft.TFTransformOutput(
                    artifact_utils.get_single_instance(input_dict["transform_graph"]).uri)
            model = artifact_utils.get_single_instance(output_dict["model"])
            model_run = artifact_utils.get_single_instance(output_dict["model_run"])

            if mode == TrainerMode.ADASSP:
                decoder = RecordDecoder(module, transform_output)
                keras_model, properties = self._adassp(examples, decoder, epsilon, delta,
                                                       exec_properties)
                # The ledger charged the event it recorded for this step; release only if it ran.
                grant.check_event(step, adassp_lib.dp_event(
                    properties[model_keys.NOISE_MULTIPLIER]))
            else:
                keras_model, decoder, properties = self._dp_sgd(
                    examples, module, transform_output, epsilon, delta, exec_properties,
                    model_run.uri)
            save_model(keras_model, decoder, model.uri)
            properties.update({model_keys.GRANT_ID: grant.grant_id,
                               model_keys.BLOCKS: json.dumps(list(grant.blocks)),
                               model_keys.TRAINER_MODE: mode})
            for name, value in properties.items():
                if isinstance(value, float):
                    set_exact_property(model, name, value)
                elif isinstance(value, int):
                    model.set_int_custom_property(name, value)
                else:
                    model.set_string_custom_property(name, value)
            # The model also depends on the steps before it (the transform's statistics, the
            # sampler's DP count): its guarantee is the whole grant's, which composes them all.
            charged.released([model.uri], charged.guarantee(GuaranteeUnit.RECORD))

    def _dp_sgd(self, samples, module: UserModule, transform_output, epsilon: float,
                delta: float, exec_properties: dict[str, Any], log_dir: str):
        descriptor = read_descriptor(samples)
        # Calibrate before reading any record: a grant too small refuses here.
        run, calibration = calibrate_run(descriptor, exec_properties.get("epochs"), epsilon, delta,
                                         exec_properties.get("max_noise_multiplier"))
        epochs = run.epochs
        config = dp_sgd.DPSGDConfig(calibration.noise_multiplier,
                                    float(exec_properties["l2_norm_clip"]),
                                    float(exec_properties["learning_rate"]))
        # Before any record is read: the module's code on public stand-in batches, decoded as
        # this run decodes (the transform graph, which the preflight did not have, included),
        # with one DP-SGD step on a model of its own. A failure there depends on no record, so
        # its cause is named (clipping.Refused, recorded with the failed step). Without a
        # transform graph it is the preflight's check: once per process, module and model_fn
        # (util/stand_in_cache.py); with one, it reads this run's graph and runs every time.
        if transform_output is None:
            check_once("DP-SGD stand-in check", exec_properties.get("module_file"),
                       (False, exec_properties.get("model_fn")),
                       lambda: stand_in.check_module(module))
        else:
            stand_in.check_module(module, transform_output)
        if exec_properties.get("seed") is not None:
            # Tests only: the user's initializers draw from the global seeds, fix them too.
            tf.keras.utils.set_random_seed(int(exec_properties["seed"]))
        keras_model = module.build_model()
        loss = module.training_loss(keras_model)
        # The model's compiled optimizer (a TFX module's Adam) never runs: DP-SGD's updates are
        # plain SGD on the noised clipped sum (dp_sgd.make_dp_step). Said when the user compiled
        # the model (what they asked for is not what runs); public facts only.
        optimizer = getattr(keras_model, "optimizer", None)
        if module.loss is None or optimizer is not None:
            console.report("DPTrainer DP-SGD: loss %s per example (%s)%s", type(loss).__name__,
                           "the module's loss()" if module.loss is not None
                           else "the model's compiled loss",
                           "" if optimizer is None else f"; the compiled optimizer "
                           f"{type(optimizer).__name__} is replaced by DP-SGD's plain SGD on "
                           "noised clipped gradients")
        decoder = RecordDecoder(module, transform_output, None if module.model_inputs is not None
                                else declared_inputs(keras_model))
        key_variable = exec_properties.get("encryption_key_env")
        encrypted = bool(samples.get_int_custom_property(sample_keys.ENCRYPTED))
        if encrypted and not key_variable:
            raise ValueError("the samples are encrypted; pass encryption_key_env")
        records, sample_ids = samples_io.read_samples(
            os.path.join(samples.uri, f"Split-{TRAIN_SPLIT}"), descriptor,
            samples.get_int_custom_property(sample_keys.RECORD_WIDTH),
            samples_io.key_from_env(key_variable) if encrypted else None)
        check_layout(sample_ids, descriptor)
        used = epochs * descriptor.slots_per_epoch
        inputs, labels, real = decode_slots(decoder, records[:used])
        step_plan = dp_sgd.StepPlan.for_layout(real, run)

        # Epsilon after each epoch depends only on public parameters; computed up front.
        epsilon_after = [accounting.epsilon(dataclasses.replace(run, epochs=e),
                                            config.noise_multiplier, delta, epsilon_cap=epsilon)
                         for e in range(1, epochs + 1)]
        writer = tf.summary.create_file_writer(log_dir)

        def on_epoch(epoch: int, _training_loss: float) -> None:
            # The console and the ModelRun's TensorBoard carry public facts only. The training
            # loss is an exact function of the granted records, not DP: it is written nowhere.
            console.report("DPTrainer epoch %d/%d: epsilon spent %.4g of %.4g", epoch, epochs,
                           epsilon_after[epoch - 1], epsilon)
            with writer.as_default(step=epoch):
                write_scalar("epsilon", epsilon_after[epoch - 1])

        # The Model's `steps` is what ran, counted as the steps execute.
        # The bar counts steps, a public number (calibration.steps); it shows no loss.
        with console.progress(f"DPTrainer DP-SGD, {epochs} epoch(s)", calibration.steps) as bar:
            steps_run = dp_sgd.train(keras_model, loss, inputs, labels, step_plan,
                                     config, seed=exec_properties.get("seed"),
                                     on_epoch=on_epoch, progress=bar.update)
        if steps_run != calibration.steps:
            raise RuntimeError(f"{steps_run} DP-SGD steps ran; the calibration paid for "
                               f"{calibration.steps}")
        writer.flush()
        return keras_model, decoder, {
            model_keys.DP_EPSILON: calibration.epsilon, model_keys.DP_DELTA: delta,
            model_keys.NOISE_MULTIPLIER: config.noise_multiplier,
            model_keys.L2_NORM_CLIP: config.l2_norm_clip,
            model_keys.LEARNING_RATE: config.learning_rate, model_keys.STEPS: steps_run,
            model_keys.EPOCHS: epochs, model_keys.SAMPLING_SCHEME: descriptor.scheme}

    def _adassp(self, examples, decoder: RecordDecoder, epsilon: float, delta: float,
                exec_properties: dict[str, Any]):
        for bound in ("feature_bound", "label_bound"):
            if exec_properties.get(bound) is None:
                raise ValueError(f"mode 'adassp' needs {bound}")
        # The decoder applies the record rule (record_rule.py): missing, malformed and
        # non-finite values become public defaults, so adassp() gets a finite matrix whatever
        # one record holds, and never raises after the grant was charged.
        inputs, labels = decoder.decode(list(read_split(examples.uri, TRAIN_SPLIT).numpy()))
        result = adassp_lib.adassp(inputs.numpy(), labels.numpy().reshape(-1), epsilon, delta,
                                   float(exec_properties["feature_bound"]),
                                   float(exec_properties["label_bound"]),
                                   label_offset=float(exec_properties.get("label_offset") or 0.0))
        dimension = int(inputs.shape[1])
        keras_model = tf.keras.Sequential([tf.keras.Input((dimension,)), tf.keras.layers.Dense(1)])
        keras_model.layers[-1].set_weights([result.weights[:-1].reshape(dimension, 1).astype(np.float32),
                                            result.weights[-1:].astype(np.float32)])
        console.report("DPTrainer AdaSSP: epsilon %.4g, delta %.3g, noise multiplier %.4g",
                       epsilon, delta, result.noise_multiplier)
        return keras_model, {model_keys.DP_EPSILON: epsilon, model_keys.DP_DELTA: delta,
                             model_keys.NOISE_MULTIPLIER: result.noise_multiplier,
                             model_keys.FEATURE_BOUND: float(exec_properties["feature_bound"]),
                             model_keys.LABEL_BOUND: float(exec_properties["label_bound"]),
                             model_keys.LABEL_OFFSET:
                                 float(exec_properties.get("label_offset") or 0.0)}
