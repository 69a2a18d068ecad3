"""The pushed model serves records as training read them: a missing feature, a value list of
another length than the spec's (an empty list, two values for one) or a non-finite value is
its public default (record_rule), in the serving signature itself."""
import numpy as np
import tensorflow as tf

from sage_tfx.components.dp_trainer.executor import save_model
from sage_tfx.components.record_rule import (null_record, parse_with_defaults,
                                              sanitise_records)
from sage_tfx.components.util.user_module import RecordDecoder, UserModule

from support import TRIP_MODULE


def _record(**floats):
    return tf.train.Example(features=tf.train.Features(feature={
        name: tf.train.Feature(float_list=tf.train.FloatList(value=[value]))
        for name, value in floats.items()})).SerializeToString()


def test_a_record_missing_a_feature_is_served_as_training_read_it(tmp_path):
    module = UserModule.load(TRIP_MODULE, "training", ())
    decoder = RecordDecoder(module)
    model = module.build_model()
    model.layers[0].bias.assign(tf.fill(model.layers[0].bias.shape, 0.5))  # f(0) != 0
    path = save_model(model, decoder, str(tmp_path))
    serve = tf.saved_model.load(path).signatures["serving_default"]
    requests = [_record(trip_miles=2.5), _record(), _record(trip_miles=float("nan")),
                _record(trip_miles=float("inf"), other=3.0)]
    served = serve(examples=tf.constant(requests))["outputs"].numpy()
    # What training computes from the same records: the Python record rule, then the model.
    trained_inputs, _ = decoder.decode(sanitise_records(requests, decoder.raw_spec))
    np.testing.assert_allclose(served, model(trained_inputs).numpy(), rtol=1e-6)
    # The three bad records are the null record (trip_miles 0), not an error.
    null_inputs, _ = decoder.decode([null_record(decoder.raw_spec)])
    np.testing.assert_allclose(served[1:], np.repeat(model(null_inputs).numpy(), 3, axis=0),
                               rtol=1e-6)


def _floats(name, values) -> bytes:
    """A record whose feature `name` is a float_list of `values` (maybe none: an empty list)."""
    example = tf.train.Example()
    example.features.feature[name].float_list.value.extend(values)
    return example.SerializeToString()


def test_a_record_with_an_empty_list_or_two_values_is_served_as_training_read_it(tmp_path):
    """A feature present with an empty value list, or two values where the spec has one, is
    its default in training (the Python rule); the serving signature gives the same
    predictions instead of failing the request (parse_example's "Values size: 0 but output
    shape: []")."""
    module = UserModule.load(TRIP_MODULE, "training", ())
    decoder = RecordDecoder(module)
    model = module.build_model()
    model.layers[0].bias.assign(tf.fill(model.layers[0].bias.shape, 0.5))  # f(0) != 0
    serve = tf.saved_model.load(save_model(model, decoder, str(tmp_path))).signatures[
        "serving_default"]
    requests = [_floats("trip_miles", [2.5]), _floats("trip_miles", []),
                _floats("trip_miles", [2.5, 7.0]), _floats("trip_miles", [3.0])]
    served = serve(examples=tf.constant(requests))["outputs"].numpy()
    trained_inputs, _ = decoder.decode(requests)
    np.testing.assert_allclose(served, model(trained_inputs).numpy(), rtol=1e-6)
    assert served[1] == served[2] != served[0]  # both the default, not the first value


def test_parse_with_defaults_reads_each_dtype_and_shape_as_the_python_rule():
    """For int64, string and float features of shapes [], [1] and [2] (a default_value of its
    own included), a record with no values, the spec's number, or one too many or too few
    parses in the graph as the Python rule's sanitised record parses."""
    spec = {"id": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
            "name": tf.io.FixedLenFeature([1], tf.string),
            "pair": tf.io.FixedLenFeature([2], tf.float32, default_value=[0.5, 1.5]),
            "many": tf.io.VarLenFeature(tf.float32)}
    lists = {"id": "int64_list", "name": "bytes_list", "pair": "float_list",
             "many": "float_list"}
    value_lists = {"id": ([], [7], [7, 8]), "name": ([], [b"a"], [b"a", b"b"]),
                   "pair": ([], [2.0], [2.0, 3.0], [2.0, 3.0, 4.0]), "many": ([], [1.0, 2.0])}
    records = []
    for name, choices in value_lists.items():
        for values in choices:
            example = tf.train.Example()
            getattr(example.features.feature[name], lists[name]).value.extend(values)
            records.append(example.SerializeToString())
    served = parse_with_defaults(tf.constant(records), spec)
    trained = tf.io.parse_example(tf.constant(sanitise_records(records, spec)), spec)
    for name in spec:
        if name == "many":
            served[name], trained[name] = (tf.sparse.to_dense(served[name]),
                                           tf.sparse.to_dense(trained[name]))
        assert served[name].shape == trained[name].shape, name
        np.testing.assert_array_equal(served[name].numpy(), trained[name].numpy())
    assert served["pair"].numpy()[8].tolist() == [2.0, 3.0]  # exactly two values are kept


def test_labels_of_shape_b_and_b_1_give_the_same_per_example_losses():
    from sage_tfx.components.util.losses import with_reduction
    predictions = tf.constant([[0.2], [0.7], [0.4]])
    for loss in (tf.keras.losses.MeanSquaredError(), tf.keras.losses.BinaryCrossentropy()):
        per_example = with_reduction(loss, tf.keras.losses.Reduction.NONE)
        flat = per_example(tf.constant([0.0, 1.0, 1.0]), predictions)
        column = per_example(tf.constant([[0.0], [1.0], [1.0]]), predictions)
        assert flat.shape == (3,)  # not one number: Keras broadcasts [B] against [B, 1]
        np.testing.assert_allclose(flat.numpy(), column.numpy())
    # Class ids beside K scores stay as they are.
    sparse = with_reduction(tf.keras.losses.SparseCategoricalCrossentropy(),
                            tf.keras.losses.Reduction.NONE)
    assert sparse(tf.constant([0, 2]), tf.constant([[0.5, 0.2, 0.3], [0.1, 0.1, 0.8]])).shape == (2,)
