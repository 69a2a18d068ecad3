"""DPTrainer on a module written as TFX's taxi template writes its trainer (issue 44 part 4):
the model-building function of the module by name, a wide-and-deep functional model on named
Inputs (float32 and int32) with Normalization and CategoryEncoding, the transformed label, the
compiled loss made per example, and the signatures a TFX run_fn exports (raw tf.Examples in,
the record rule's defaults, the transform, the model; `transform_features` for TFMA)."""
import os

import numpy as np
import pytest

import sage_tfx  # noqa: F401  (Keras 2, before TensorFlow loads)
import tensorflow as tf

from sage_tfx.components.dp_trainer import clipping, dp_sgd
from sage_tfx.components.dp_trainer.parameters import TrainerMode, module_needs
from sage_tfx.components.util.losses import with_reduction
from sage_tfx.components.util.user_module import UserModule, declared_inputs

from support import TFX_TRAINER_MODULE, TFX_TRANSFORM_MODULE

MODEL_FN = "_build_keras_model"
BATCH = 8


def _tfx_module() -> UserModule:
    return UserModule.load(TFX_TRAINER_MODULE, TrainerMode.DP_SGD,
                           module_needs(TrainerMode.DP_SGD, transform_graph=True),
                           model_fn=MODEL_FN)


def _features(rng) -> dict:
    """A batch of the template model's four Inputs, ids beyond their CategoryEncoding's range
    included (3 buckets: 5 and -1; 24 hours: 99)."""
    buckets = rng.integers(0, 3, (BATCH, 1))
    buckets[:2, 0] = [5, -1]
    hours = rng.integers(0, 24, (BATCH, 1))
    hours[2, 0] = 99
    return {"trip_miles_xf": tf.constant(rng.standard_normal((BATCH, 1)), tf.float32),
            "hour_fraction_xf": tf.constant(rng.random((BATCH, 1)), tf.float32),
            "trip_miles_bucket_xf": tf.constant(buckets, tf.int32),
            "hour_xf": tf.constant(hours, tf.int32)}


def test_one_pass_clipping_of_the_wide_and_deep_dict_model_bounds_each_example_by_c():
    """The layer walk takes the multi-input functional model (Normalization, CategoryEncoding
    and concatenate have no trainable weights): its per-example norms equal the jacobian's,
    taken one example at a time, and each example's clipped contribution to the sum has norm
    at most C (1 + 1e-5, float32 rounding). Ids outside a CategoryEncoding's range encode as
    id 0 (clipping.public_ids) instead of failing Keras' range assertion."""
    rng = np.random.default_rng(11)
    module = _tfx_module()
    tf.keras.utils.set_random_seed(12)
    model = module.build_model()
    clipping.public_ids_only(model)
    features = _features(rng)
    labels = tf.constant(rng.integers(0, 2, (BATCH,)), tf.float32)  # [B] beside [B, 1]
    per_example = with_reduction(module.training_loss(model), tf.keras.losses.Reduction.NONE)
    with tf.GradientTape() as tape:
        losses = per_example(labels, model(features, training=True))
    jacobians = tape.jacobian(losses, model.trainable_variables)
    reference = np.sqrt(sum(np.square(tf.reshape(j, [BATCH, -1]).numpy().astype(np.float64))
                            .sum(axis=1) for j in jacobians))
    clip = float(np.median(reference))  # binds for some examples and not for others

    @tf.function
    def contributions():
        gradients = clipping.OnePass(model, model.trainable_variables, per_example, features,
                                     labels, tf.ones([BATCH]))
        factors = clip / tf.maximum(clip, gradients.norms)
        kept = dp_sgd.kept_rows(gradients.losses, gradients.norms)
        return gradients.norms, gradients.whole_model, tf.map_fn(
            lambda row: tf.norm(tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in
                                           gradients.clipped_sum(factors * tf.one_hot(row, BATCH),
                                                                 kept)], 0)),
            tf.range(BATCH), fn_output_signature=tf.float32)
    norms, whole_model, clipped = contributions()
    assert not whole_model  # the walk, not whole-model per-example gradients
    np.testing.assert_allclose(norms.numpy(), reference, rtol=1e-4)
    assert np.all(clipped.numpy() <= clip * (1 + 1e-5)), clipped.numpy().max()
    assert (reference > clip).any()
    # The out-of-range ids encode as id 0: the same predictions as with 0 there.
    at_zero = dict(features, trip_miles_bucket_xf=tf.where(
        features["trip_miles_bucket_xf"] > 2, 0, tf.maximum(features["trip_miles_bucket_xf"], 0)),
        hour_xf=tf.where(features["hour_xf"] > 23, 0, features["hour_xf"]))
    np.testing.assert_array_equal(model(features).numpy(), model(at_zero).numpy())


def _raw_record(**values) -> bytes:
    """A raw tf.Example holding `values` (ints as int64, floats as float)."""
    example = tf.train.Example()
    for name, value in values.items():
        feature = example.features.feature[name]
        (feature.int64_list if isinstance(value, int) else feature.float_list).value.append(value)
    return example.SerializeToString()


@pytest.mark.slow
def test_the_tfx_template_module_trains_and_serves_raw_records_as_training_read_them(
        tmp_path, capfd):
    """BlockExampleGen -> BlockLedger -> DPTransform -> ObliviousSampleGen -> DPTrainer with
    the TFX-style module (model_fn, no feature_spec, no model_inputs, no loss, the transformed
    label): DP-SGD trains it, and the SavedModel's serving_default, given raw records missing
    features (the label always) or holding NaN, predicts exactly what the model gives on the
    same records decoded as training decodes them; transform_features gives the transformed
    features training saw."""
    from tfx.orchestration import metadata, pipeline
    from tfx.orchestration.local.local_dag_runner import LocalDagRunner
    import tensorflow_transform as tft

    from sage_tfx.components import DPTrainer, DPTransform, ObliviousSampleGen
    from sage_tfx.components.util.user_module import RecordDecoder
    from sage_tfx.components.record_rule import sanitise_records
    from sage_tfx.sage_access import connect

    from support.ingest import ingest_and_grant

    root, store_path = str(tmp_path), str(tmp_path / "metadata.sqlite")
    gen, grant = ingest_and_grant(root, store_path, trips_per_month=20, block_epsilon=2.0,
                                  epsilon=2.0, delta=1e-7,
                                  split={"transform": 0.5, "training": 0.5})
    transform = DPTransform(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                            module_file=TFX_TRANSFORM_MODULE)
    sampler = ObliviousSampleGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                                 scheme="swo", sample_size=8, epochs=2, seed=3, public_size=40)
    trainer = DPTrainer(examples=sampler.outputs["samples"], grant=grant.outputs["grant"],
                        module_file=TFX_TRAINER_MODULE, model_fn=MODEL_FN,
                        transform_graph=transform.outputs["transform_graph"],
                        l2_norm_clip=1.0, learning_rate=0.5, seed=4)
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="tfx_module", pipeline_root=os.path.join(root, "pipeline"),
        components=[gen, grant, transform, sampler, trainer],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store_path)))
    log = capfd.readouterr().err
    assert ("loss BinaryCrossentropy per example (the model's compiled loss); the compiled "
            "optimizer Adam is replaced by DP-SGD's plain SGD") in log

    store = connect(store_path)
    [model_artifact] = store.get_artifacts_by_type("Model")
    assert model_artifact.custom_properties["steps"].int_value == 2 * 40 // 8
    [graph] = store.get_artifacts_by_type("TransformGraph")
    loaded = tf.saved_model.load(os.path.join(model_artifact.uri, "Format-Serving"))
    assert set(loaded.signatures) == {"serving_default", "transform_features"}

    records = [_raw_record(trip_start_timestamp=1706800000, trip_miles=2.5, trip_seconds=700),
               _raw_record(trip_start_timestamp=1706803600, trip_miles=0.7),  # no label
               _raw_record(trip_miles=float("nan")),  # no timestamp, NaN miles, no label
               _raw_record()]  # nothing: every feature its default
    served = loaded.signatures["serving_default"](examples=tf.constant(records))["outputs"]
    # Training's decoding of the same records: the record rule in Python, the transform, the
    # model's Inputs, then the trained model (the SavedModel's own).
    module = _tfx_module()
    decoder = RecordDecoder(module, tft.TFTransformOutput(graph.uri),
                            declared_inputs(module.build_model()))
    inputs, _ = decoder.decode(sanitise_records(records, decoder.raw_spec))
    # (The restored Keras model takes its Inputs as the list it was built on.)
    np.testing.assert_array_equal(served.numpy(), loaded.model(list(inputs.values())).numpy())
    assert served.shape == (4, 1) and np.all(np.isfinite(served.numpy()))
    assert len(set(served.numpy().ravel().tolist())) > 1  # the records are told apart

    transformed = loaded.signatures["transform_features"](examples=tf.constant(records))
    trained_on = decoder.transform_layer(decoder._parse(decoder.sanitise(records)))
    assert set(transformed) == set(trained_on) >= {"long_xf", "trip_miles_xf", "hour_xf"}
    for name, values in trained_on.items():
        np.testing.assert_array_equal(transformed[name].numpy(), values.numpy())
    assert transformed["long_xf"].numpy().tolist() == [1, 0, 0, 0]
