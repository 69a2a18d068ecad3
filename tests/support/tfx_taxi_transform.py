"""DPTransform's module for the TFX-style trainer module beside it (tfx_taxi_trainer.py): the
preprocessing_fn of TFX's taxi template (taxi_utils_native_keras.py) on support.ingest's trips,
converted by its import. TFX lets Transform and Trainer take separate module files; the trainer
module then needs no feature_spec (its raw features come from the TransformGraph)."""
import tensorflow as tf

from sage_tfx.components.dp_transform import tft  # was: import tensorflow_transform as tft

_DENSE_FLOAT_FEATURE_KEYS = ["trip_miles"]
_BUCKET_FEATURE_KEYS = ["trip_miles"]
_FEATURE_BUCKET_COUNT = 3
_LABEL_KEY = "long"  # a trip of more than 10 minutes, from trip_seconds
CLAMP_BOUNDS = {"trip_miles": (0.0, 10.0)}  # public, per raw feature


def _transformed_name(key):
    return key + "_xf"


def feature_spec():
    return {"trip_start_timestamp": tf.io.FixedLenFeature([1], tf.int64),
            "trip_miles": tf.io.FixedLenFeature([1], tf.float32),
            "trip_seconds": tf.io.FixedLenFeature([1], tf.int64)}


def preprocessing_fn(inputs):
    outputs = {}
    for key in _DENSE_FLOAT_FEATURE_KEYS:
        outputs[_transformed_name(key)] = tft.scale_to_z_score(inputs[key])
    for key in _BUCKET_FEATURE_KEYS:
        outputs[_transformed_name(key + "_bucket")] = tft.bucketize(inputs[key],
                                                                   _FEATURE_BUCKET_COUNT)
    hour = (inputs["trip_start_timestamp"] // 3600) % 24
    outputs[_transformed_name("hour")] = hour  # categorical, int64, no analyzer
    outputs[_transformed_name("hour_fraction")] = tf.cast(hour, tf.float32) / 24.0
    # [batch] as TFX's label (a FixedLenFeature of shape []): the trainer's [B, 1] output.
    outputs[_transformed_name(_LABEL_KEY)] = tf.reshape(
        tf.cast(inputs["trip_seconds"] > 600, tf.int64), [-1])
    return outputs
