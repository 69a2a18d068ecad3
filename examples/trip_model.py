"""The model module of examples/first_pipeline.py: a trip's duration in hours from its distance.

DPTrainer and SLAedValidator load this file by path (`module_file`). Bounds are public properties
of taxi trips (not of the data), so clipping costs no budget.
"""
import tensorflow as tf

LABEL_KEY = "trip_seconds"
MAX_MILES = 20.0


def feature_spec():
    return {"trip_miles": tf.io.FixedLenFeature([1], tf.float32),
            "trip_seconds": tf.io.FixedLenFeature([1], tf.int64)}


def model_inputs(features):
    return tf.clip_by_value(features["trip_miles"], 0.0, MAX_MILES) / MAX_MILES


def build_model():
    return tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(8, activation="relu"),
                                tf.keras.layers.Dense(1)])


def loss():
    return tf.keras.losses.MeanSquaredError()
