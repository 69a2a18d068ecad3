"""The taxi task of Sage §3.1 (Listing 1) for DPTransform, DPTrainer and SLAedValidator.

Predict a trip's duration in hours (trip_seconds / 3600, clipped to [0, 1]) from its distance
and a DP feature: the average speed of the trips that started in that hour.
Every bound below is public (a property of taxi trips, not of this data), so scaling costs no
budget; only `dp_group_by_mean` looks at the data, with the whole transform share.
"""
import tensorflow as tf

from sage_tfx.components.dp_transform import analyzers as dp

LABEL_KEY = "trip_seconds"
MAX_MILES = 20.0          # longer trips are clipped: the scaled distance is in [0, 1]
MAX_SPEED_MPH = 60.0
FEATURES = ("miles_scaled", "hour_speed")


def feature_spec():
    return {"trip_miles": tf.io.FixedLenFeature([1], tf.float32),
            "trip_start_hour": tf.io.FixedLenFeature([1], tf.int64),
            "trip_seconds": tf.io.FixedLenFeature([1], tf.int64)}


def preprocessing_fn(inputs):
    miles = tf.reshape(inputs["trip_miles"], [-1])
    hour = tf.reshape(inputs["trip_start_hour"], [-1])
    duration_hours = tf.clip_by_value(
        tf.cast(tf.reshape(inputs["trip_seconds"], [-1]), tf.float32) / 3600.0, 0.0, 1.0)
    # A trip's speed (miles over at least one minute), scaled to [0, 1] with a public bound.
    speed = dp.scale_with_bounds(miles / tf.maximum(duration_hours, 1.0 / 60), 0.0, MAX_SPEED_MPH)
    return {
        "miles_scaled": dp.scale_with_bounds(miles, 0.0, MAX_MILES),
        "hour_speed": dp.dp_group_by_mean(hour, speed, num_keys=24, value_range=(0.0, 1.0),
                                          budget_share=1.0),
        LABEL_KEY: tf.reshape(duration_hours, [-1, 1]),
    }


def model_inputs(features):
    return tf.stack([tf.reshape(features[name], [-1]) for name in FEATURES], axis=1)


# A typical Chicago taxi trip (public guesses, like the bounds above): 2 miles at 12 mph.
TYPICAL_MILES, TYPICAL_SPEED_MPH = 2.0, 12.0


def build_model():
    """A small network that starts as the public guess "every trip takes 12 minutes".

    DP-SGD takes a few hundred noisy steps here, so where it starts matters:
    * The output layer starts at zero weights and bias 0.2 h, so the untrained model predicts
      12 minutes for every trip, close to the naive model. With random output weights a model
      trained at a small epsilon stayed far from it, worse than the naive model (the validator
      then REJECTs and the pipeline stops).
    * Inputs are re-centred on the typical trip, in units of it (public constants, no budget):
      the scaled distance of a 2-mile trip is 0.1, and its gradient that small made the
      first layer learn slowly.
    """
    return tf.keras.Sequential([
        tf.keras.Input((len(FEATURES),)),
        tf.keras.layers.Rescaling([MAX_MILES / TYPICAL_MILES, MAX_SPEED_MPH / TYPICAL_SPEED_MPH],
                                  offset=-1.0),
        tf.keras.layers.Dense(16, activation="relu"),
        tf.keras.layers.Dense(1, kernel_initializer="zeros",
                              bias_initializer=tf.keras.initializers.Constant(0.2))])


def loss():
    return tf.keras.losses.MeanSquaredError()


def tuner_fn(fn_args):
    """DPTuner's space (TFX's tuner_fn; a dict of values: keras-tuner is not installed): DP-SGD's
    learning rate and clip norm around the example's (0.05, 0.5)."""
    return {"learning_rate": [0.02, 0.05, 0.2, 0.5], "l2_norm_clip": [0.5, 1.0]}
