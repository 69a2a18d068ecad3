"""A DPTrainer/DPTuner module for an easy seeded problem: label 1 when x1 + x2 > 0, learnt by
logistic regression from zero weights (an untrained model's loss is ln 2; its accuracy is not
1/2 after any step: it depends on the weights' direction only, which a tiny step learns too)."""
import tensorflow as tf

LABEL_KEY = "label"


def feature_spec():
    return {"x1": tf.io.FixedLenFeature([1], tf.float32),
            "x2": tf.io.FixedLenFeature([1], tf.float32),
            "label": tf.io.FixedLenFeature([1], tf.int64)}


def model_inputs(features):
    return tf.concat([features["x1"], features["x2"]], axis=1)


def build_model():
    return tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(
        1, activation="sigmoid", kernel_initializer="zeros")])


def loss():
    return tf.keras.losses.BinaryCrossentropy()


def tuner_fn(fn_args):
    # Learning rate 1e-4 barely moves the zero model's loss in 40 steps; 2.0 learns the boundary.
    return [{"learning_rate": 1e-4}, {"learning_rate": 2.0}]


def grid_tuner_fn(fn_args):
    return {"learning_rate": [0.1, 1.0], "l2_norm_clip": [0.5, 1.0]}


def empty_tuner_fn(fn_args):
    return []


def unknown_name_tuner_fn(fn_args):
    return [{"learning_rate": 0.1, "dropout": 0.2}]
