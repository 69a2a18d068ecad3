"""The pushed model serves records as training read them: a missing feature or a non-finite
value is its public default (record_rule), in the serving signature itself."""
import numpy as np
import tensorflow as tf

from sage_tfx.components.dp_trainer.executor import save_model
from sage_tfx.components.record_rule import null_record, sanitise_records
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
