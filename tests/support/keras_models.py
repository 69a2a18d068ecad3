"""Small Keras models the DP-SGD tests build layer by layer."""
import tensorflow as tf


def functional(*layers, input_shape, dtype="float32"):
    """A functional model applying `layers` in turn to one input of `input_shape`."""
    inputs = tf.keras.Input(input_shape, dtype=dtype)
    outputs = inputs
    for layer in layers:
        outputs = layer(outputs)
    return tf.keras.Model(inputs, outputs)
