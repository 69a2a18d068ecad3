"""DP-SGD over a run of samples, with tensorflow-privacy's fast gradient clipping.

One step on sample S (Abadi et al. 2016; oblivious-sampling paper §3 "NoisySGD", §5):

    g = ( sum_{i in S} clip_C(grad loss_i) + N(0, sigma^2 C^2 I) ) / normaliser

* clip_C scales each per-example gradient to L2 norm <= C. tensorflow-privacy's
  `compute_clipped_gradients_and_outputs` does it without materialising per-example gradients
  (ghost norms for Dense/Embedding layers; other trainable layers are refused by name).
* The sum therefore moves by at most C when one record is added or removed (2C when replaced;
  oblivious_sample_gen/accounting.py accounts for that). Gaussian noise of std sigma * C makes
  each step the subsampled Gaussian mechanism the accountant composes.
* The normaliser is public: the sample size m for SWO/shuffling, the expected size gamma * n for
  Poisson (the actual size is private, paper §5). Dividing by it is post-processing.
* Every step has the same shape: a sample is padded to a public width with masked rows
  (weight 0: zero loss, so zero gradient, and clip factor 1), and a step whose sample did not
  fit the Poisson layout runs with every row masked: noise only. The number of steps is the
  descriptor's, never data-dependent.

Noise comes from a tf.random.Generator (Philox) seeded by sage_tfx.randomness.secret_seed (the
OS CSPRNG) unless a test passes a seed. What that does and does not give, honestly: the noise is
drawn inside TensorFlow's graph, once per step, so it cannot come from sage_tfx.mechanisms
(OpenDP, one Python call per release). These are float32 Gaussians (Box-Muller on Philox
output), not exact lattice samples. Mironov's (2012) attack is on Laplace, and needs the exact
noisy value of one release; here no noisy gradient leaves the step, only the model after every
step's float32 update, but Jin et al. (IEEE S&P 2022) show floating-point Gaussian samplers are
attackable too when their output is seen. So the epsilon the accountant reports is a proof for
the idealised mechanism (real-valued Gaussians of std sigma * C); it is not a proof for this
float32 implementation, and Philox's 63-bit seed is a PRNG key, not a CSPRNG stream.

The per-epoch training loss reported to `on_epoch` is not DP. The trainer writes it only to
TensorBoard under the ModelRun artifact (inside the platform, like the data itself), never to
its log, the Model artifact or ML Metadata.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

sys.skip_tf_privacy_import = True  # its __init__ imports estimator code gone since TF 2.16
import tensorflow as tf  # noqa: E402
from tensorflow_privacy.privacy.fast_gradient_clipping import clip_grads, layer_registry  # noqa: E402

from sage_tfx.components.oblivious_sample_gen.descriptor import SamplingDescriptor  # noqa: E402
from sage_tfx.components.oblivious_sample_gen.melbourne import chernoff_threshold  # noqa: E402
from sage_tfx.randomness import secret_seed  # noqa: E402

# Poisson padding width: a sample is larger with probability <= 2^-40 (it is then run at its
# own size; only the step's duration differs).
_PADDING_OVERFLOW_LOG_PROBABILITY = -40 * math.log(2)


def require_legacy_keras() -> None:
    """tensorflow-privacy 0.9 works with Keras 2 (`tf_keras`) only."""
    if not tf.keras.layers.Dense.__module__.startswith("tf_keras"):
        raise RuntimeError(
            "DPTrainer needs Keras 2: set TF_USE_LEGACY_KERAS=1 before TensorFlow is first "
            "imported (importing sage_tfx first does it; in a container, set it in the image).")


@dataclass(frozen=True)
class DPSGDConfig:
    noise_multiplier: float
    l2_norm_clip: float
    learning_rate: float

    def __post_init__(self):
        for name in ("noise_multiplier", "l2_norm_clip", "learning_rate"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value}")


@dataclass(frozen=True)
class StepPlan:
    """Which rows each step reads: rows[step] (padded to a common width) and weights[step]
    (1 for a sample's record, 0 for padding). `epoch_of_step` ties steps to epochs."""
    rows: np.ndarray
    weights: np.ndarray
    normaliser: float
    epochs: int

    @property
    def steps(self) -> int:
        return self.rows.shape[0]

    @classmethod
    def from_samples(cls, sample_ids: np.ndarray, descriptor: SamplingDescriptor,
                     epochs: Optional[int] = None) -> "StepPlan":
        """Steps for the first `epochs` epochs of samples laid out as `descriptor` says, where
        real records (sample id > 0) are numbered 0, 1, ... in slot order (the rows of the
        parsed feature tensors)."""
        epochs = descriptor.epochs if epochs is None else epochs
        slots, per_epoch = descriptor.slots_per_epoch, descriptor.samples_per_epoch
        sample_ids = np.asarray(sample_ids)
        row_of_slot = np.cumsum(sample_ids > 0) - 1
        members = []
        for epoch in range(epochs):
            ids = sample_ids[epoch * slots:(epoch + 1) * slots]
            order = np.argsort(ids, kind="stable")
            bounds = np.searchsorted(ids[order], np.arange(1, per_epoch + 2))
            for sample in range(per_epoch):
                in_sample = order[bounds[sample]:bounds[sample + 1]] + epoch * slots
                members.append(row_of_slot[in_sample])
        width = max(max(len(m) for m in members), _public_width(descriptor), 1)
        rows = np.zeros((len(members), width), dtype=np.int32)
        weights = np.zeros((len(members), width), dtype=np.float32)
        for step, member_rows in enumerate(members):
            rows[step, :len(member_rows)] = member_rows
            weights[step, :len(member_rows)] = 1.0
        return cls(rows, weights, descriptor.expected_batch_size, epochs)


def _public_width(descriptor: SamplingDescriptor) -> int:
    if descriptor.scheme != "poisson":
        return descriptor.sample_size
    mean = math.ceil(descriptor.n * descriptor.gamma)
    return chernoff_threshold(descriptor.n, descriptor.gamma, _PADDING_OVERFLOW_LOG_PROBABILITY,
                              mean)


def with_reduction(loss: tf.keras.losses.Loss, reduction: str) -> tf.keras.losses.Loss:
    """The same loss with another reduction: SUM gives sum_i w_i * loss_i (the clipped-gradient
    objective), NONE the per-example losses."""
    return type(loss).from_config(dict(loss.get_config(), reduction=reduction))


def noise_generator(seed: Optional[int] = None) -> tf.random.Generator:
    return tf.random.Generator.from_seed(secret_seed() if seed is None else seed)


def make_dp_step(model: tf.keras.Model, loss: tf.keras.losses.Loss, features: tf.Tensor,
                 labels: tf.Tensor, config: DPSGDConfig, normaliser: float,
                 generator: tf.random.Generator) -> Callable:
    """A compiled DP-SGD step: step(rows, weights) -> (weighted loss sum, weight sum)."""
    require_legacy_keras()
    model.compile(loss=loss)  # fast clipping derives per-example losses from model.loss
    optimizer = tf.keras.optimizers.SGD(config.learning_rate)
    registry = layer_registry.make_default_layer_registry()
    clipping_loss = with_reduction(loss, tf.keras.losses.Reduction.SUM)
    per_example = with_reduction(loss, tf.keras.losses.Reduction.NONE)
    noise_std = config.noise_multiplier * config.l2_norm_clip

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32),
                                  tf.TensorSpec([None], tf.float32)])
    def step(rows, weights):
        batch_features, batch_labels = tf.gather(features, rows), tf.gather(labels, rows)
        clipped, predictions, _ = clip_grads.compute_clipped_gradients_and_outputs(
            model, config.l2_norm_clip, registry, batch_features, batch_labels, weights,
            clipping_loss=clipping_loss)
        noisy = [(gradient + generator.normal(tf.shape(gradient), stddev=noise_std)) / normaliser
                 for gradient in clipped]
        optimizer.apply_gradients(zip(noisy, model.trainable_variables))
        return (tf.reduce_sum(per_example(batch_labels, predictions) * weights),
                tf.reduce_sum(weights))

    return step


def make_nondp_step(model: tf.keras.Model, loss: tf.keras.losses.Loss, features: tf.Tensor,
                    labels: tf.Tensor, learning_rate: float, normaliser: float) -> Callable:
    """The non-private reference (no clipping, no noise) with the same interface, plan and
    normaliser, for benchmarks and the accuracy table; never used on granted data."""
    optimizer = tf.keras.optimizers.SGD(learning_rate)
    per_example = with_reduction(loss, tf.keras.losses.Reduction.NONE)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32),
                                  tf.TensorSpec([None], tf.float32)])
    def step(rows, weights):
        batch_features, batch_labels = tf.gather(features, rows), tf.gather(labels, rows)
        with tf.GradientTape() as tape:
            losses = per_example(batch_labels, model(batch_features, training=True)) * weights
            objective = tf.reduce_sum(losses) / normaliser
        gradients = tape.gradient(objective, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return tf.reduce_sum(losses), tf.reduce_sum(weights)

    return step


def run_steps(step: Callable, plan: StepPlan,
              on_epoch: Optional[Callable[[int, float], None]] = None) -> None:
    """Run every step of `plan` in order; after each epoch, on_epoch(epoch, mean training loss)
    (1-based epoch; the loss is not DP, see the module docstring)."""
    steps_per_epoch = plan.steps // plan.epochs
    for epoch in range(plan.epochs):
        # Summed as tensors: converting each step's loss would wait for every step to finish.
        loss_sums, weight_sums = [], []
        for index in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch):
            batch_loss, batch_weight = step(tf.constant(plan.rows[index]),
                                            tf.constant(plan.weights[index]))
            loss_sums.append(batch_loss)
            weight_sums.append(batch_weight)
        if on_epoch is not None:
            on_epoch(epoch + 1, float(tf.add_n(loss_sums)) / max(float(tf.add_n(weight_sums)), 1.0))


def train(model: tf.keras.Model, loss: tf.keras.losses.Loss, features: tf.Tensor,
          labels: tf.Tensor, plan: StepPlan, config: DPSGDConfig, seed: Optional[int] = None,
          on_epoch: Optional[Callable[[int, float], None]] = None) -> None:
    """DP-SGD: every step of `plan`, in order (see run_steps)."""
    run_steps(make_dp_step(model, loss, features, labels, config, plan.normaliser,
                           noise_generator(seed)), plan, on_epoch)
