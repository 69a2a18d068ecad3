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
from sage_tfx.components.dp_trainer.parameters import TrainerMode
from sage_tfx.components.util.losses import with_reduction
from sage_tfx.components.util.user_module import UserModule, import_module_file

from support import TFX_TRAINER_MODULE, TFX_TRANSFORM_MODULE

MODEL_FN = "_build_keras_model"
BATCH = 8


def _tfx_module() -> UserModule:
    from sage_tfx.components.dp_trainer.parameters import module_needs

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
    tf.keras.utils.set_random_seed(12)
    model = import_module_file(TFX_TRAINER_MODULE)._build_keras_model()
    clipping.public_ids_only(model)
    features = _features(rng)
    labels = tf.constant(rng.integers(0, 2, (BATCH,)), tf.float32)  # [B] beside [B, 1]
    columns = labels[:, None]  # the same labels as [B, 1]
    per_example = with_reduction(tf.keras.losses.BinaryCrossentropy(),
                                 tf.keras.losses.Reduction.NONE)
    with tf.GradientTape() as tape:
        losses = per_example(labels, model(features, training=True))
    jacobians = tape.jacobian(losses, model.trainable_variables)
    reference = np.sqrt(sum(np.square(tf.reshape(j, [BATCH, -1]).numpy().astype(np.float64))
                            .sum(axis=1) for j in jacobians))
    clip = float(np.median(reference))  # binds for some examples and not for others

    @tf.function
    def contributions(labels):
        gradients = clipping.OnePass(model, model.trainable_variables, per_example, features,
                                     labels, tf.ones([BATCH]))
        factors = clip / tf.maximum(clip, gradients.norms)
        kept = dp_sgd.kept_rows(gradients.losses, gradients.norms)
        return gradients.norms, gradients.whole_model, tf.map_fn(
            lambda row: tf.norm(tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in
                                           gradients.clipped_sum(factors * tf.one_hot(row, BATCH),
                                                                 kept)], 0)),
            tf.range(BATCH), fn_output_signature=tf.float32)
    for shaped in (labels, columns):
        norms, whole_model, clipped = contributions(shaped)
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
    from sage_tfx.components.util.user_module import RecordDecoder, declared_inputs
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


def test_the_compiled_loss_is_taken_per_example_for_labels_of_shape_b_and_b_1():
    """Without loss(), DP-SGD trains the loss the model was compiled with ("binary_crossentropy"
    by name), per example: each row's binary cross-entropy as Keras computes it, whether the
    labels are [B] (a TFX label of shape []) or [B, 1] like the model's output."""
    rng = np.random.default_rng(13)
    module = _tfx_module()
    model = module.build_model()
    clipping.public_ids_only(model)
    loss = module.training_loss(model)
    assert type(loss) is tf.keras.losses.BinaryCrossentropy
    predictions = model(_features(rng))
    labels = rng.integers(0, 2, (BATCH,)).astype(np.float32)
    per_example = with_reduction(loss, tf.keras.losses.Reduction.NONE)
    expected = tf.keras.losses.binary_crossentropy(labels[:, None], predictions).numpy()
    assert expected.shape == (BATCH,)
    for shaped in (labels, labels[:, None]):
        np.testing.assert_allclose(per_example(shaped, predictions).numpy(), expected, rtol=1e-6)


def _module_file(tmp_path, replace=(), add="") -> str:
    """The TFX-style trainer module with its text replaced and lines added."""
    with open(TFX_TRAINER_MODULE) as handle:
        text = handle.read()
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "trainer_module.py"
    path.write_text(text + add)
    return str(path)


@pytest.mark.parametrize("case", ["compiled loss of its own", "no such model_fn",
                                  "no feature_spec without a transform graph",
                                  "an Input no feature feeds", "a model mixing the batch",
                                  "a subclassed model without model_inputs"])
def test_a_tfx_module_that_cannot_train_is_refused_before_the_charge(store_path, tmp_path, case):
    """What DPTrainer would refuse after the charge, from the module alone, is refused by the
    BlockLedger before it charges, naming the cause: nothing is charged or recorded. With a
    transform graph (not made yet) the model's checks run on stand-ins of its declared Inputs
    (names, dtypes, shapes), which find a model mixing the examples of a batch."""
    from tfx.types import channel, standard_artifacts

    from sage_tfx.components import BlockLedger as BlockLedgerComponent, DPTrainer
    from sage_tfx.components import ObliviousSampleGen
    from sage_tfx.components.block_ledger import executor
    from sage_tfx.components.privacy_grant import PrivacyGrant
    from sage_tfx.sage_access import BlockLedger
    from sage_tfx.sage_access.errors import BadRequest

    module, model_fn, transform_graph = (_module_file(tmp_path), MODEL_FN,
                                         channel.Channel(type=standard_artifacts.TransformGraph))
    if case == "compiled loss of its own":
        module = _module_file(tmp_path, [('loss="binary_crossentropy"',
                                          "loss=lambda y, p: tf.square(y - p)")])
        message = (r"the model's compiled loss <function .*<lambda> at .*> is not a Keras loss "
                   r"DP-SGD can take per example .*define loss\(\) in the module")
    elif case == "a model mixing the batch":  # found on stand-ins of the declared Inputs
        module = _module_file(tmp_path, [(
            "tf.keras.layers.Normalization()(layer)",
            "tf.keras.layers.Lambda(lambda x: x - tf.reduce_mean(x, 0))(layer)")])
        message = "the model: an example's output depends on other examples of its batch"
    elif case == "a subclassed model without model_inputs":  # no named Inputs to feed
        module = _module_file(tmp_path, add=(
            "class _Subclassed(tf.keras.Model):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.dense = tf.keras.layers.Dense(1, activation='sigmoid')\n"
            "    def call(self, features):\n"
            "        return self.dense(features['trip_miles_xf'])\n"
            "def _build_keras_model():\n"
            "    model = _Subclassed()\n"
            "    model.compile(loss='binary_crossentropy', optimizer='adam')\n"
            "    return model\n"))
        message = (r"while reading the model's named Inputs: .*the model declares no named "
                   r"Inputs \(a subclassed model\?\): define model_inputs")
    elif case == "no such model_fn":
        model_fn, message = "_build_model", r"lacks \['_build_model'\]"
    elif case == "no feature_spec without a transform graph":
        transform_graph = None
        message = r"lacks \['feature_spec'\] .*give the component the TransformGraph"
    else:  # raw features, without a transform: an Input must be named after one
        transform_graph = None
        module = _module_file(tmp_path, add=(
            "def feature_spec():\n"
            "    return {name: tf.io.FixedLenFeature([1], tf.float32) for name in\n"
            "            ['trip_miles_xf', 'hour_fraction_xf', 'hour_xf', 'long_xf']}\n"))
        message = (r"the model's Inputs \['trip_miles_bucket_xf'\] are not among the features "
                   r"\['hour_fraction_xf', 'hour_xf', 'long_xf', 'trip_miles_xf'\]")
    grant = BlockLedgerComponent(ledger_store=store_path, epsilon=1.0, delta=1e-7, window=2,
                                 split={"training": 1.0})
    sampler = ObliviousSampleGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                                 scheme="swo", sample_size=10, epochs=1, public_size=100)
    DPTrainer(examples=sampler.outputs["samples"], grant=grant.outputs["grant"],
              module_file=module, model_fn=model_fn, transform_graph=transform_graph,
              l2_norm_clip=1.0, learning_rate=0.1)
    ledger = BlockLedger.create(store_path, min_request_epsilon=0.05)
    for block in ("b1", "b2"):
        ledger.add_block(block, 2.0, 1e-6, data_uri=str(tmp_path / block))
    examples, grant_artifact = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant_artifact.uri = str(tmp_path / "out-examples"), str(tmp_path / "out-grant")
    with pytest.raises(BadRequest, match="refused before the charge") as refused:
        executor.Executor().Do({}, {"examples": [examples], "grant": [grant_artifact]},
                               {**grant.exec_properties, "ledger_store": store_path})
    assert refused.match("DPTrainer: .*" + message)
    assert [b.spent[0] for b in BlockLedger(store_path).blocks()] == [0.0, 0.0]
    assert not BlockLedger(store_path).grant_records()


def test_each_named_input_reads_its_feature_cast_and_reshaped_the_same_on_every_cpu(tmp_path):
    """Without model_inputs, each of the model's named Inputs reads the feature of its name
    (raw here: no transform), reshaped to the Input's shape ([B] -> [B, 1]) and cast to its
    dtype; a float beyond an int32 Input's range is clamped to it first (the cast of such a
    value differs by CPU), and a NaN, like a missing feature, is 0."""
    from sage_tfx.components.util.user_module import RecordDecoder

    module = _module_file(tmp_path, add=(
        "def feature_spec():\n"
        "    return {'hour_xf': tf.io.FixedLenFeature([], tf.float32),\n"
        "            'trip_miles_xf': tf.io.FixedLenFeature([1], tf.float32),\n"
        "            'long_xf': tf.io.FixedLenFeature([], tf.int64)}\n"))
    loaded = UserModule.load(module, TrainerMode.DP_SGD, model_fn=MODEL_FN)
    decoder = RecordDecoder(loaded, inputs={
        "hour_xf": tf.TensorSpec([1], tf.int32), "trip_miles_xf": tf.TensorSpec([1], tf.float32)})
    records = [_raw_record(hour_xf=value, trip_miles_xf=1.5, long_xf=1)
               for value in (2.7, -3.5, 1e30, -1e30, float("nan"))] + [_raw_record()]
    inputs, labels = decoder.decode(records)
    assert inputs["hour_xf"].dtype == tf.int32 and inputs["hour_xf"].shape == (6, 1)
    assert inputs["hour_xf"].numpy().ravel().tolist() == [2, -3, 2**31 - 1, -2**31, 0, 0]
    assert inputs["trip_miles_xf"].numpy().ravel().tolist() == [1.5] * 5 + [0.0]
    assert labels.numpy().tolist() == [1.0] * 5 + [0.0]


def test_another_number_of_values_than_the_input_is_refused_or_fitted_per_example_when_run(tmp_path):
    """A feature of 2 values per example read by an Input of shape (1,) would reshape [B, 2]
    into [2B, 1], another batch size: refused before anything runs, naming the feature and the
    Input. When the width is known only when the graph runs (a densified variable-length
    feature: the batch's longest record sets it), nothing may fail after the charge: each
    example is fitted alone (its first values, zero-padded), so a long record neither stops
    the run nor moves another example's input."""
    from sage_tfx.components.util.user_module import RecordDecoder, as_input

    module = _module_file(tmp_path, add=(
        "def feature_spec():\n"
        "    return {'trip_miles_xf': tf.io.FixedLenFeature([2], tf.float32),\n"
        "            'long_xf': tf.io.FixedLenFeature([], tf.int64)}\n"))
    loaded = UserModule.load(module, TrainerMode.DP_SGD, model_fn=MODEL_FN)
    decoder = RecordDecoder(loaded, inputs={"trip_miles_xf": tf.TensorSpec([1], tf.float32)})
    message = (r"the feature 'trip_miles_xf' has 2 values per example \(shape \(2,\)\) and the "
               r"model's Input 'trip_miles_xf' takes 1 \(shape \(1,\)\)")
    with pytest.raises(ValueError, match=message):
        decoder.decode([_raw_record(long_xf=1)] * 3)
    unknown = tf.function(lambda value: as_input("trip_miles_xf", value,
                                                 tf.TensorSpec([1], tf.float32)),
                          input_signature=[tf.TensorSpec([None, None], tf.float32)])
    batch = tf.constant([[1.0, 0.0], [2.0, 7.0], [3.0, 0.0]])  # one record of 2 values
    assert unknown(batch).numpy().tolist() == [[1.0], [2.0], [3.0]]
    assert unknown(batch[:, :1]).numpy().tolist() == [[1.0], [2.0], [3.0]]
    wide = tf.function(lambda value: as_input("trip_miles_xf", value,
                                              tf.TensorSpec([3], tf.float32)),
                       input_signature=[tf.TensorSpec([None, None], tf.float32)])
    assert wide(batch).numpy().tolist() == [[1.0, 0.0, 0.0], [2.0, 7.0, 0.0], [3.0, 0.0, 0.0]]
