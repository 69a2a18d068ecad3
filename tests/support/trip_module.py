"""A DPTrainer module file for the trips of support.ingest.write_csv: seconds from miles."""
import tensorflow as tf

LABEL_KEY = "trip_seconds"


def feature_spec():
    return {"trip_miles": tf.io.FixedLenFeature([1], tf.float32),
            "trip_seconds": tf.io.FixedLenFeature([1], tf.int64)}


def model_inputs(features):
    return features["trip_miles"]


def build_model():
    return tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(8, activation="relu"),
                                tf.keras.layers.Dense(1)])


def loss():
    return tf.keras.losses.MeanSquaredError()


def tuner_fn(fn_args):
    """DPTuner's candidates (a plain list, as the module may give them)."""
    return [{"learning_rate": 1e-4}, {"learning_rate": 0.05}]
