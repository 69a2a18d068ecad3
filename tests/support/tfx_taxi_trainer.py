"""A DPTrainer module written as TFX's taxi template writes its trainer (taxi_utils_native_keras
.py, `_build_keras_model`): a wide-and-deep functional model on named Inputs keyed by the
transformed feature names (float32 and int32, shape (1,)), Normalization (not adapted) on the
deep side, CategoryEncoding on the wide side, a sigmoid output reshaped to (1,), compiled by the
module with binary cross-entropy and Adam. What the conversion adds is the LABEL_KEY line (the
transformed label); DPTrainer is given model_fn="_build_keras_model". run_fn stays, unused."""
from typing import List

import tensorflow as tf

_DENSE_FLOAT_FEATURE_KEYS = ["trip_miles", "hour_fraction"]
_BUCKET_FEATURE_KEYS = ["trip_miles_bucket"]
_FEATURE_BUCKET_COUNT = 3
_CATEGORICAL_FEATURE_KEYS = ["hour"]
_MAX_CATEGORICAL_FEATURE_VALUES = [24]
_LABEL_KEY = "long"


def _transformed_name(key):
    return key + "_xf"


def _transformed_names(keys):
    return [_transformed_name(key) for key in keys]


LABEL_KEY = _transformed_name(_LABEL_KEY)  # the conversion's one added line


def _build_keras_model(hidden_units: List[int] = None) -> tf.keras.Model:
    deep_input = {
        colname: tf.keras.layers.Input(name=colname, shape=(1,), dtype=tf.float32)
        for colname in _transformed_names(_DENSE_FLOAT_FEATURE_KEYS)
    }
    wide_bucket_input = {
        colname: tf.keras.layers.Input(name=colname, shape=(1,), dtype="int32")
        for colname in _transformed_names(_BUCKET_FEATURE_KEYS)
    }
    wide_categorical_input = {
        colname: tf.keras.layers.Input(name=colname, shape=(1,), dtype="int32")
        for colname in _transformed_names(_CATEGORICAL_FEATURE_KEYS)
    }
    input_layers = {**deep_input, **wide_bucket_input, **wide_categorical_input}

    deep_layers = []
    for layer in deep_input.values():
        deep_layers.append(tf.keras.layers.Normalization()(layer))
    deep = tf.keras.layers.concatenate(deep_layers)
    for numnodes in (hidden_units or [8, 4]):
        deep = tf.keras.layers.Dense(numnodes)(deep)

    wide_layers = []
    for key in _transformed_names(_BUCKET_FEATURE_KEYS):
        wide_layers.append(
            tf.keras.layers.CategoryEncoding(num_tokens=_FEATURE_BUCKET_COUNT)(input_layers[key]))
    for key, num_tokens in zip(_transformed_names(_CATEGORICAL_FEATURE_KEYS),
                               _MAX_CATEGORICAL_FEATURE_VALUES):
        wide_layers.append(
            tf.keras.layers.CategoryEncoding(num_tokens=num_tokens)(input_layers[key]))
    wide = tf.keras.layers.concatenate(wide_layers)

    output = tf.keras.layers.Dense(1, activation="sigmoid")(
        tf.keras.layers.concatenate([deep, wide]))
    output = tf.keras.layers.Reshape((1,))(output)

    model = tf.keras.Model(list(input_layers.values()), output)
    model.compile(
        loss="binary_crossentropy",
        optimizer=tf.keras.optimizers.Adam(learning_rate=0.001),
        metrics=[tf.keras.metrics.BinaryAccuracy()],
    )
    return model


def run_fn(fn_args):
    """TFX Trainer's entry point; DPTrainer trains and exports the model itself."""
    raise AssertionError("DPTrainer must not call run_fn")
