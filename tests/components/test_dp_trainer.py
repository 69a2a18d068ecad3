"""DPTrainer: calibration, the component on LocalDagRunner after the sampler, its refusals,
DP-SGD on the real taxi sample, and AdaSSP against least squares."""
import base64
import csv
import json
import gc
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tfx
from tfx.orchestration import metadata, pipeline
from tfx.orchestration.local.local_dag_runner import LocalDagRunner
from tfx.types import artifact_utils, standard_artifacts

from sage_tfx.components import PrivateExamples
from sage_tfx.components.dp_trainer import DPTrainer, dp_sgd, stand_in
from sage_tfx.components.dp_trainer import executor as trainer_executor
from sage_tfx.components.dp_trainer.adassp import adassp
from sage_tfx.components.dp_trainer.calibrate import (CalibrationError, calibrate,
                                                       plan_for_batch)
from sage_tfx.components.oblivious_sample_gen import ObliviousSampleGen, accounting
from sage_tfx.components.oblivious_sample_gen.sampling import samples_poisson, samples_swo
from sage_tfx.components.privacy_grant import GrantError
from sage_tfx.components.util import stand_in_cache
from sage_tfx.sage_access import BlockLedger, connect
from sage_tfx.sage_access.errors import BadRequest

from support import TRIP_MODULE
from support.calls import recorded_calls
from support.ingest import ingest_and_grant

KEY_VARIABLE = "SAGE_TEST_TRAINER_KEY"


@pytest.mark.parametrize("scheme", ["poisson", "swo", "shuffle"])
def test_calibration_spends_the_target_and_no_more(scheme):
    descriptor = plan_for_batch(scheme, size=10_000, batch=100, epochs=5)
    result = calibrate(descriptor, epsilon=2.0, delta=1e-6)
    assert result.steps == 500
    assert 0.98 * 2.0 <= result.epsilon <= 2.0
    # Round trip: the accountant at the calibrated noise gives the reported epsilon.
    assert accounting.epsilon(descriptor, result.noise_multiplier, 1e-6, epsilon_cap=2.0) \
        == pytest.approx(result.epsilon)
    # Slightly less noise would overspend.
    assert accounting.epsilon(descriptor, result.noise_multiplier * 0.99, 1e-6,
                              epsilon_cap=10.0) > 2.0


@pytest.mark.slow
def test_calibrate_command_prints_the_contract():
    out = subprocess.run(
        [sys.executable, "-m", "sage_tfx.components.dp_trainer.calibrate", "--scheme", "poisson",
         "--size", "60000", "--batch", "600", "--epochs", "100", "--epsilon", "1.0",
         "--delta", "1e-5", "--json"], capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    assert set(result) == {"noise_multiplier", "steps", "epsilon"}
    assert result["steps"] == 10_000
    assert 0.98 <= result["epsilon"] <= 1.0
    bad = subprocess.run(
        [sys.executable, "-m", "sage_tfx.components.dp_trainer.calibrate", "--scheme", "swo",
         "--size", "100", "--batch", "1000", "--epochs", "1", "--epsilon", "1", "--delta", "1e-5"],
        capture_output=True, text=True)
    assert bad.returncode == 2 and "sample size" in bad.stderr


def test_the_calibrate_and_trace_commands_load_without_tensorflow():
    # DP-SGD's calibration is dp_accounting's and the sampler's trace is numpy: TensorFlow's
    # import would cost each command (and its tests' processes) ~10 s of CPU.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, sage_tfx.components.dp_trainer.calibrate, "
         "sage_tfx.components.oblivious_sample_gen.trace; "
         "print(sorted({'tensorflow', 'tfx', 'apache_beam'} & set(sys.modules)))"],
        capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_calibration_refuses_a_budget_too_small_for_one_step():
    descriptor = plan_for_batch("swo", size=1000, batch=1000, epochs=1)
    with pytest.raises(CalibrationError, match="cannot pay for 1 DP-SGD step"):
        calibrate(descriptor, epsilon=1e-4, delta=1e-7)
    with pytest.raises(CalibrationError, match="delta"):
        calibrate(descriptor, epsilon=1.0, delta=0.0)


def _artifacts(store, type_name, cls):
    artifact_type = store.get_artifact_type(type_name)
    return [artifact_utils.deserialize_artifact(artifact_type, a)
            for a in store.get_artifacts_by_type(type_name)]


@pytest.mark.slow
def test_trainer_pipeline_and_refusals(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, base64.b64encode(os.urandom(32)).decode())
    root = str(tmp_path)
    store_path = os.path.join(root, "metadata.sqlite")
    # One share per trainer (a share is consumed once), one per refused run below, and the DP
    # count the Poisson sampler pays for its size (the SWO sampler is given a public size).
    gen, grant = ingest_and_grant(root, store_path, block_epsilon=2.0, epsilon=2.0, delta=5e-7,
                                  split={step: 0.1 for step in (
                                      "training", "poisson", "linear", "sampling_count",
                                      "refused-1", "refused-2", "refused-3", "refused-4",
                                      "refused-5")})
    sampler = ObliviousSampleGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                                 scheme="swo", sample_size=8, epochs=3, seed=3, public_size=48)
    trainer = DPTrainer(examples=sampler.outputs["samples"], grant=grant.outputs["grant"],
                        module_file=TRIP_MODULE, l2_norm_clip=1.0, learning_rate=0.05, seed=4)
    poisson = ObliviousSampleGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                                 scheme="poisson", gamma=0.125, epochs=2,
                                 encryption_key_env=KEY_VARIABLE, record_width=1024,
                                 seed=6).with_id("poisson")
    poisson_trainer = DPTrainer(examples=poisson.outputs["samples"], grant=grant.outputs["grant"],
                                module_file=TRIP_MODULE, l2_norm_clip=1.0, learning_rate=0.05,
                                encryption_key_env=KEY_VARIABLE, grant_step="poisson",
                                seed=7).with_id("poisson_trainer")
    linear = DPTrainer(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                       module_file=TRIP_MODULE, mode="adassp", feature_bound=5.0, label_bound=400.0,
                       grant_step="linear", seed=5).with_id("linear")
    # DP-SGD's stand-in check of the module: made once for both DP-SGD trainers, in the
    # BlockLedger's preflight and in DPTrainer (no transform graph: the same check, which
    # reads no record; util/stand_in_cache.py).
    monkeypatch.setattr(stand_in_cache, "_passed", set())
    checked = recorded_calls(monkeypatch, stand_in, "check_module")
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="training", pipeline_root=os.path.join(root, "pipeline"),
        components=[gen, grant, sampler, trainer, poisson, poisson_trainer, linear],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store_path)))
    assert len(checked) == 1

    store = connect(store_path)
    models = {m.get_string_custom_property("sampling_scheme") or "adassp": m
              for m in _artifacts(store, "Model", standard_artifacts.Model)}
    # Poisson samples, stored encrypted: floor(1 / gamma) = 8 steps per epoch whatever n is.
    assert models["poisson"].get_int_custom_property("steps") == 16
    assert 0.98 * 0.2 <= float(models["poisson"].get_string_custom_property("dp_epsilon")) <= 0.2
    model = models["swo"]
    props = {k: v.string_value or v.int_value for k, v in model.mlmd_artifact.custom_properties.items()}
    # The grant is (2.0, 5e-7), a tenth of it for each trainer: (0.2, 5e-8).
    assert 0.95 * 0.2 <= float(props["dp_epsilon"]) <= 0.2
    assert float(props["dp_delta"]) == pytest.approx(0.5e-7)
    assert props["sampling_scheme"] == "swo"
    [samples] = [e for e in _artifacts(store, PrivateExamples.TYPE_NAME, PrivateExamples)
                 if e.get_string_custom_property("sampling_scheme") == "swo"]
    # A public size of 48 rows: 6 samples of 8 per epoch, 3 epochs; the count of steps that ran.
    assert props["steps"] == 18
    assert samples.get_int_custom_property("sampling_n") == 48
    assert json.loads(props["blocks"]) == ["2024-03", "2024-02"]
    assert float(props["noise_multiplier"]) > 0 and float(props["l2_norm_clip"]) == 1.0

    # The SavedModel serves serialized tf.Examples without the label.
    loaded = tf.saved_model.load(os.path.join(model.uri, "Format-Serving"))
    example = tf.train.Example(features=tf.train.Features(feature={
        "trip_miles": tf.train.Feature(float_list=tf.train.FloatList(value=[2.5]))}))
    outputs = loaded.signatures["serving_default"](
        examples=tf.constant([example.SerializeToString()]))["outputs"]
    assert outputs.shape == (1, 1) and np.isfinite(outputs.numpy()).all()
    # AdaSSP spends the same training share; its linear model serves the same way.
    assert float(models["adassp"].get_string_custom_property("dp_epsilon")) == pytest.approx(0.2)
    linear_model = tf.saved_model.load(os.path.join(models["adassp"].uri, "Format-Serving"))
    assert np.isfinite(linear_model.signatures["serving_default"](
        examples=tf.constant([example.SerializeToString()]))["outputs"].numpy()).all()
    model_runs = _artifacts(store, "ModelRun", standard_artifacts.ModelRun)
    assert any(name.startswith("events.out.tfevents") for model_run in model_runs
               for name in os.listdir(model_run.uri))

    [granted] = [e for e in _artifacts(store, PrivateExamples.TYPE_NAME, PrivateExamples)
                 if e.get_string_custom_property("sage_grant_id")
                 and not e.get_string_custom_property("sampling_scheme")]
    [grant_artifact] = _artifacts(store, "sage_tfx.PrivacyGrant", None)
    outputs = {"model": [standard_artifacts.Model()], "model_run": [standard_artifacts.ModelRun()]}
    for artifact_list in outputs.values():
        artifact_list[0].uri = os.path.join(root, "refused", artifact_list[0].TYPE_NAME)
    base = {"module_file": TRIP_MODULE, "l2_norm_clip": 1.0, "learning_rate": 0.05}

    refused_steps = iter(["refused-1", "refused-2", "refused-3", "refused-4", "refused-5"])

    def run(examples, **overrides):
        overrides.setdefault("grant_step", next(refused_steps))
        trainer_executor.Executor().Do({"examples": [examples], "grant": [grant_artifact]},
                                       outputs, dict(base, **overrides))

    # A training share too small for one step.
    with pytest.raises(CalibrationError, match="cannot pay"):
        run(samples, max_noise_multiplier=0.5)
    # Examples without a grant (a single block's Examples, never granted as such).
    per_block = [e for e in _artifacts(store, PrivateExamples.TYPE_NAME, PrivateExamples)
                 if e.get_string_custom_property("block_id")]
    with pytest.raises(GrantError, match="without a grant"):
        run(per_block[0])
    # Granted Examples that were never sampled.
    with pytest.raises(trainer_executor.SamplesMismatch, match="no sampling descriptor"):
        run(granted)
    # After the charge, the module's own failure is found on public stand-in records before
    # any record is read, and its cause is recorded and shown (issue 45: a loss returning one
    # number showed only as "failed while computing" without SAGE_TFX_DEBUG). The share of the
    # run refused for its missing grant above was not consumed.
    scalar_loss = tmp_path / "scalar_loss.py"
    scalar_loss.write_text(f"from importlib.machinery import SourceFileLoader\n"
                           f"trip = SourceFileLoader('trip', {TRIP_MODULE!r}).load_module()\n"
                           "from tensorflow import keras, reduce_mean, square\n"
                           "LABEL_KEY, feature_spec = trip.LABEL_KEY, trip.feature_spec\n"
                           "model_inputs, build_model = trip.model_inputs, trip.build_model\n"
                           "class Scalar(keras.losses.Loss):\n"
                           "    def __call__(self, y, p, sample_weight=None):\n"
                           "        return reduce_mean(square(y - p))\n"
                           "def loss():\n    return Scalar()\n")
    cause = "the loss must give one value per example"
    with pytest.raises(BadRequest, match="fails on a public stand-in batch.*" + cause):
        trainer_executor.Executor().Do({"examples": [samples], "grant": [grant_artifact]},
                                       outputs, dict(base, module_file=str(scalar_loss),
                                                     grant_step="refused-2"))
    outcome = BlockLedger(store_path).grant_outcomes(
        grant_artifact.get_string_custom_property("grant_id"))["refused-2"]
    assert outcome["outcome"] == "failed" and cause in outcome["reason"]
    # A descriptor that does not match the data.
    n = 48
    samples.set_int_custom_property("sampling_n", n + 8)  # claims one more sample per epoch
    samples.set_int_custom_property("sampling_samples_per_epoch", (n + 8) // 8)
    samples.set_int_custom_property("sampling_slots_per_epoch", (n + 8) // 8 * 8)
    with pytest.raises(trainer_executor.SamplesMismatch, match="slots"):
        run(samples)
    samples.set_int_custom_property("sampling_samples_per_epoch", n // 8)  # inconsistent with n
    with pytest.raises(trainer_executor.SamplesMismatch, match="is not what swo sampling"):
        run(samples)
    assert not os.path.exists(outputs["model"][0].uri)  # nothing written by a refused run


def test_poisson_steps_read_fixed_units_whatever_the_samples():
    samples = samples_poisson(tf.range(2000), 0.05, seed=8, epochs=2)
    plan = dp_sgd.StepPlan.for_layout(samples.real, samples.descriptor)
    other = samples_poisson(tf.range(2000), 0.05, seed=9, epochs=2)
    other_plan = dp_sgd.StepPlan.for_layout(other.real, other.descriptor)
    assert plan.steps == 2 * 20 and plan.normaliser == pytest.approx(100.0)
    # The rows each step reads depend on (size, gamma) alone; only the weights differ.
    assert np.array_equal(plan.rows, other_plan.rows)
    assert not np.array_equal(plan.weights, other_plan.weights)
    assert plan.weights.sum(axis=1).tolist() == [len(b) for b in samples.batches()]


def one_step_update(seed: int, noise_multiplier: float, clip: float = 1.0) -> np.ndarray:
    """The parameter change of one DP-SGD step on a fixed batch from a fixed model."""
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(500)])
    before = np.concatenate([w.numpy().ravel() for w in model.trainable_variables])
    features = tf.constant(np.random.default_rng(1).standard_normal((8, 4)), tf.float32)
    labels = tf.constant(np.random.default_rng(2).standard_normal((8, 500)), tf.float32)
    plan = dp_sgd.StepPlan(np.arange(8, dtype=np.int32)[None, :], np.ones((1, 8), np.float32),
                           normaliser=8.0, epochs=1)
    steps = dp_sgd.train(model, tf.keras.losses.MeanSquaredError(), features, labels, plan,
                         dp_sgd.DPSGDConfig(noise_multiplier, clip, 1.0), seed=seed)
    assert steps == 1
    return np.concatenate([w.numpy().ravel() for w in model.trainable_variables]) - before


def test_dp_sgd_noise_variance_measured_from_two_runs_on_the_same_batch():
    # Two runs differ only in the noise: update_1 - update_2 = lr / B (z_1 - z_2) with z ~
    # N(0, (sigma C)^2) per parameter, so the difference has variance 2 (lr sigma C / B)^2.
    # 2,500 parameters: the sample variance is within 10% with probability 1 - 5e-4
    # (chi-square with 2,499 dof, 3.5 sd). A step without noise (noise_std = 0) gives 0.
    sigma, clip, batch = 3.0, 0.5, 8.0
    difference = one_step_update(1, sigma, clip) - one_step_update(2, sigma, clip)
    expected = 2 * (sigma * clip / batch) ** 2
    assert difference.var() == pytest.approx(expected, rel=0.1)


@pytest.mark.parametrize("size", [1_000_001, 1_000_000])
def test_dp_sgd_noise_is_standard_normal_times_its_stddev(size):
    # The step's sampler (Box-Muller on an AES keystream) against N(0, 2.5^2) over 10^6 draws.
    # Kolmogorov-Smirnov refused at p < 1e-4 (the false-failure rate for a correct sampler;
    # the seed is fixed): on these draws a sampler 1% off in scale gives p < 1e-5. The sample
    # variance within 1% (7 standard errors). The draws are independent: the cos and sin
    # halves of the pairs are uncorrelated, and a second call gives fresh draws (|r| below 4
    # standard errors each).
    from scipy import stats
    generator = dp_sgd.noise_generator(5)
    draws = dp_sgd.keyed_gaussian_noise(dp_sgd.noise_key(generator), size, 2.5)
    assert draws.shape == (size,) and draws.dtype == np.float32
    assert draws.ctypes.data % 64 == 0  # NoiseBuffer hands them to TensorFlow in place
    draws = draws.astype(np.float64)
    assert stats.kstest(draws / 2.5, "norm").pvalue > 1e-4
    assert draws.var() == pytest.approx(2.5 ** 2, rel=0.01)
    half = size // 2
    assert abs(np.corrcoef(draws[:half], draws[half:2 * half])[0, 1]) < 4 / math.sqrt(half)
    again = dp_sgd.keyed_gaussian_noise(dp_sgd.noise_key(generator), size, 2.5)
    assert abs(np.corrcoef(draws, again)[0, 1]) < 4 / math.sqrt(size)
    # A huge scale (a huge clip) stays finite: stddev^2 would overflow float32.
    huge = dp_sgd.keyed_gaussian_noise(dp_sgd.noise_key(generator), 10_000, 1e25).astype(
        np.float64) / 1e25
    assert np.isfinite(huge).all() and huge.std() == pytest.approx(1.0, rel=0.1)


def test_dp_sgd_noise_tails_reach_twelve_standard_deviations():
    """The radius is built from 104 random bits (keyed_gaussian_noise's docstring): the
    largest draw is sqrt(208 ln 2) = 12.01 standard deviations, not the 5.65 of a float32
    uniform, and the transform is exact at the extremes of its words."""
    ones, zero = np.uint64(2 ** 64 - 1), np.uint64(0)  # U = 1 - 2^-52 and U = 0
    extremes = np.empty(6, np.float32)
    dp_sgd.box_muller(np.array([ones, ones, ones, zero, zero, zero]), np.zeros(3, np.uint32),
                      1.0, extremes)
    assert extremes[0] == pytest.approx(math.sqrt(208 * math.log(2)), rel=1e-6)
    assert extremes[1] == pytest.approx(math.sqrt(104 * math.log(2)), rel=1e-6)  # 8.49
    assert extremes[2] == 0.0
    assert extremes[0] > 12.0
    assert (extremes[3:] == 0.0).all()  # the sin halves at angle 0


def test_keyed_noise_is_a_function_of_the_key_and_the_position():
    """A draw depends on its key and its position only: a shorter call gives a prefix of a
    longer one (across chunk boundaries, every 2^15 draws), another key other draws."""
    key = bytes(range(32))
    long = dp_sgd.keyed_gaussian_noise(key, 300_001, 1.0)
    np.testing.assert_array_equal(dp_sgd.keyed_gaussian_noise(key, 140_000, 1.0),
                                  long[:140_000])
    other = dp_sgd.keyed_gaussian_noise(bytes(32), 300_001, 1.0)
    assert abs(np.corrcoef(long, other)[0, 1]) < 4 / math.sqrt(long.size)


def test_draws_that_tensorflow_cannot_read_in_place_are_refused_not_a_crash():
    # TensorFlow aborts the process on a misaligned tensor; the buffer refuses such draws first.
    misaligned = dp_sgd._aligned_float32(17)[1:]  # 4 bytes past a 64-byte boundary
    with pytest.raises(ValueError, match="64-byte boundary"):
        dp_sgd._in_place(misaligned)


def test_keyed_noise_is_box_muller_of_the_aes_keystream():
    """A known answer from an independent reading of keyed_gaussian_noise's layout: one
    AES-256-CTR keystream (counter from 0) for the whole call; in chunk c of P pairs, pair j's
    radius words are bytes 16j to 16j + 16 and its angle word bytes 16P + 4j, little-endian;
    U1, U2 and A their top 52, 52 and 23 bits. V = 1 - U1 - U2 2^-52 is computed exactly (as a
    fraction) and must equal the kernel's float64 tail; the draws must be stddev sqrt(-2 ln V)
    (cos, sin)(2 pi A) to float32 rounding. Two chunks and an odd size: any other choice of
    bytes (an angle read from U2's, low bits for top bits) fails."""
    from fractions import Fraction

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from sage_tfx.components.dp_trainer import noise_kernel
    key, pairs_per_chunk = bytes(range(32)), dp_sgd._PAIRS_PER_CHUNK
    size = 2 * pairs_per_chunk + 7  # a second chunk, and half a pair
    draws = dp_sgd.keyed_gaussian_noise(key, size, 3.0)
    keystream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(
        bytes(2 * 20 * pairs_per_chunk))
    expected = []
    for chunk in range(2):
        block = keystream[20 * pairs_per_chunk * chunk:20 * pairs_per_chunk * (chunk + 1)]
        words = np.frombuffer(block[:16 * pairs_per_chunk], "<u8")
        angle_words = np.frombuffer(block[16 * pairs_per_chunk:], "<u4")
        tail = np.empty(pairs_per_chunk)
        noise_kernel.tails(words.astype(np.uint64), tail)  # a writable native copy
        some = range(0, pairs_per_chunk, 97)  # exact arithmetic on a sample of the pairs
        exact = [float(Fraction(2 ** 104 - (int(words[2 * j] >> 12) << 52)
                                - int(words[2 * j + 1] >> 12), 2 ** 104)) for j in some]
        assert tail[list(some)].tolist() == exact
        radius = 3.0 * np.sqrt(-2.0 * np.log(tail))
        angle = 2.0 * np.pi * (angle_words >> 9).astype(np.float64) * 2.0 ** -23
        expected += [radius * np.cos(angle), radius * np.sin(angle)]
    np.testing.assert_allclose(draws, np.concatenate(expected)[:size], rtol=1e-5, atol=3e-5)


def test_unseeded_noise_keys_come_from_the_os_csprng():
    """The product passes no seed: every fill's key is 256 fresh bits from the OS CSPRNG
    (sage_tfx.randomness.secret_key), not Philox's 63-bit seed, and the buffer serves from it."""
    assert dp_sgd.noise_generator() is None
    keys = {dp_sgd.noise_key(None) for _ in range(100)}
    assert len(keys) == 100 and all(len(key) == 32 for key in keys)
    buffer = dp_sgd.NoiseBuffer(dp_sgd.noise_generator(), 2.0)
    buffer.reserve(1_000)
    served = buffer.take(1_000).numpy()
    assert np.isfinite(served).all() and 1.5 < served.std() < 2.5


def test_the_noise_buffer_serves_every_draw_once_and_with_the_law_of_fresh_draws(monkeypatch):
    """NoiseBuffer: takes of varying sizes across refills (a refill of 1,000 discards the
    unread tail) are iid N(0, 2^2): Kolmogorov-Smirnov over 60,000 served draws refused at
    p < 1e-4 (the false-failure rate; fixed seed), no run of draws served twice (single
    float32 values do coincide, ~30 times in 60,000; two consecutive ones with probability
    ~1e-6 over the run, so a repeated pair means reuse), lag-1 correlation within 4
    standard errors. A take that no reserve covers fails, never
    reuses a draw."""
    from scipy import stats
    monkeypatch.setattr(dp_sgd.NoiseBuffer, "REFILL_DRAWS", 1_000)
    buffer = dp_sgd.NoiseBuffer(dp_sgd.noise_generator(3), 2.0)
    take = tf.function(buffer.take)
    served, sizes = [], np.random.default_rng(0).integers(1, 400, size=300)
    for size in sizes:
        buffer.reserve(int(size))
        served.append(take(tf.constant(size)).numpy())
    assert [len(draws) for draws in served] == list(sizes)
    served = np.concatenate(served).astype(np.float64)
    consecutive = np.stack([served[:-1], served[1:]], axis=1)
    assert len(np.unique(consecutive, axis=0)) == len(consecutive)
    assert stats.kstest(served / 2.0, "norm").pvalue > 1e-4
    assert abs(np.corrcoef(served[:-1], served[1:])[0, 1]) < 4 / math.sqrt(len(served))
    fresh = dp_sgd.NoiseBuffer(dp_sgd.noise_generator(4), 2.0)
    fresh.reserve(900)  # a refill of 1,000
    assert fresh.take(900).shape[0] == 900
    unreserved = fresh.take(200)  # past the buffer's end: short, not wrapped around
    assert unreserved.shape[0] == 100
    with pytest.raises(tf.errors.InvalidArgumentError):  # as a step's split refuses it
        tf.split(unreserved, [200])
    # The eager variables' noise, added in one op: exactly the next draws, in each tensor's
    # shape; past the buffer's end it fails, and nothing is marked read.
    added = dp_sgd.NoiseBuffer(dp_sgd.noise_generator(5), 2.0)
    added.reserve(900)
    gradients = [tf.ones([3, 4]), tf.zeros([5])]
    expected = tf.identity(added._draws[:17]).numpy()
    first, second = added.add_to(gradients)
    np.testing.assert_array_equal(first.numpy(), 1 + expected[:12].reshape(3, 4))
    np.testing.assert_array_equal(second.numpy(), expected[12:])
    assert int(added._next) == 17
    with pytest.raises(tf.errors.OutOfRangeError, match="holds 983 unread draws and the step "
                                                         "needs 1000"):
        added.add_to([tf.zeros([1000])])
    assert int(added._next) == 17


def test_draws_made_ahead_are_the_draws_each_refill_would_make(monkeypatch):
    """The buffer draws its next fill on a worker thread, keyed in reserve() in refill order:
    a seed serves exactly keyed_gaussian_noise of the generator's successive keys, as drawing
    at each refill does. A refill the draws made ahead do not cover skips their key (they are
    discarded unread) and draws with the next one; the next fill is then drawn ahead at that
    larger size, so a model whose every step reads more than a buffer draws once per step."""
    monkeypatch.setattr(dp_sgd.NoiseBuffer, "REFILL_DRAWS", 1_000)
    buffer = dp_sgd.NoiseBuffer(dp_sgd.noise_generator(5), 2.0)
    served = []
    for size in (300, 300, 300, 300, 1_500, 200, 1_400, 1_400):
        buffer.reserve(size)
        # The variable holds the fill's memory (_in_place): freeing and reusing the heap must
        # not change what it serves.
        gc.collect()
        churn = [np.full(1_000 + 13 * k, -7.0, np.float32) for k in range(50)]
        del churn
        served.append(buffer.take(size).numpy())
    oracle = dp_sgd.noise_generator(5)
    # Keys: fill 1, ahead 2, ahead 3 (discarded at the 1,500), 4 (drawn then), ahead 5, 6, 7
    # (each 1,500: as many as the last refill).
    keys = [dp_sgd.noise_key(oracle) for _ in range(7)]
    fills = {k: dp_sgd.keyed_gaussian_noise(keys[k - 1], size, 2.0)
             for k, size in ((1, 1_000), (2, 1_000), (4, 1_500), (5, 1_500), (6, 1_500),
                             (7, 1_500))}
    expected = [fills[1][:300], fills[1][300:600], fills[1][600:900], fills[2][:300],
                fills[4], fills[5][:200], fills[6][:1_400], fills[7][:1_400]]
    assert len(served) == len(expected)
    for got, want in zip(served, expected):
        np.testing.assert_array_equal(got, want)
    # The key drawn ahead and skipped gives other draws: the oversize fill did not reuse it.
    assert not np.array_equal(dp_sgd.keyed_gaussian_noise(keys[2], 1_500, 2.0), fills[4])


def test_settle_waits_for_the_fill_drawn_ahead_and_keeps_it(monkeypatch):
    """step.settle() (benchmarks time a run of steps with it) returns once the fill drawn
    ahead is done, and that fill is still the one the next refill serves."""
    monkeypatch.setattr(dp_sgd.NoiseBuffer, "REFILL_DRAWS", 1_000)
    buffer = dp_sgd.NoiseBuffer(dp_sgd.noise_generator(5), 2.0)
    buffer.reserve(1_000)
    buffer.take(1_000)
    buffer.settle()
    assert buffer._ahead[1].done()
    buffer.reserve(1_000)
    oracle = dp_sgd.noise_generator(5)
    keys = [dp_sgd.noise_key(oracle) for _ in range(2)]
    np.testing.assert_array_equal(buffer.take(1_000).numpy(),
                                  dp_sgd.keyed_gaussian_noise(keys[1], 1_000, 2.0))


def test_a_dp_step_draws_its_noise_from_the_buffer_not_from_the_generator():
    """Steps take their noise from the NoiseBuffer: the generator moves once per refill
    (2^20 draws cover ~1,000 steps of this 1,003-parameter model), not once per step."""
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(200),
                                 tf.keras.layers.Dense(1)])
    features, labels = tf.ones((16, 4)), tf.zeros((16, 1))
    generator = dp_sgd.noise_generator(1)
    step = dp_sgd.make_dp_step(model, tf.keras.losses.MeanSquaredError(), features, labels,
                               dp_sgd.DPSGDConfig(1.0, 1.0, 0.1), 16.0, generator)
    step(tf.range(16), tf.ones(16))
    after_first = generator.state.numpy().copy()
    before = [w.numpy() for w in model.trainable_variables]
    for _ in range(20):
        step(tf.range(16), tf.ones(16))
    assert (generator.state.numpy() == after_first).all()
    moved = [np.abs(w.numpy() - b).max() for w, b in zip(model.trainable_variables, before)]
    assert min(moved) > 0  # every variable got its (noisy) update


def test_steps_are_counted_as_they_execute():
    samples = samples_swo(tf.range(200), 16, seed=1, epochs=3)
    features = tf.random.stateless_normal((int(samples.records.shape[0]), 2), seed=[1, 2])
    labels = tf.zeros((int(samples.records.shape[0]), 1))
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    executed = []
    ran = dp_sgd.train(model, tf.keras.losses.MeanSquaredError(), features, labels,
                       dp_sgd.StepPlan.for_layout(samples.real, samples.descriptor),
                       dp_sgd.DPSGDConfig(1.0, 1.0, 0.1), seed=1, on_step=executed.append)
    # 200 // 16 = 12 samples per epoch, 3 epochs: counted by the callback, not the plan.
    assert executed == list(range(1, 37)) and ran == 36


def taxi_trips():
    """(features [miles, hour/23], seconds/1000) of the real Chicago taxi sample in tfx."""
    path = os.path.join(os.path.dirname(tfx.__file__), "examples", "chicago_taxi_pipeline",
                        "data", "simple", "data.csv")
    features, labels = [], []
    with open(path) as handle:
        for row in csv.DictReader(handle):
            if row["trip_miles"] and row["trip_seconds"]:
                miles, seconds = float(row["trip_miles"]), float(row["trip_seconds"])
                if 0 < miles <= 30 and 0 < seconds <= 7200:
                    features.append([miles / 10.0, float(row["trip_start_hour"]) / 23.0])
                    labels.append([seconds / 1000.0])
    return np.asarray(features, np.float32), np.asarray(labels, np.float32)


@pytest.mark.slow
def test_dp_sgd_on_the_taxi_sample_beats_the_naive_model():
    features, labels = taxi_trips()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(labels))
    test, train = order[:3000], order[3000:]
    # Rows stand in for records: SWO samples of row indices, as ObliviousSampleGen lays them out.
    samples = samples_swo(tf.constant(train.astype(np.int64)), 256, seed=5, epochs=5)
    rows = samples.records
    train_x, train_y = tf.constant(features[rows]), tf.constant(labels[rows])
    calibration = calibrate(samples.descriptor, epsilon=8.0, delta=1e-6)
    steps = []
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    losses = []
    dp_sgd.train(model, tf.keras.losses.MeanSquaredError(), train_x, train_y,
                 dp_sgd.StepPlan.for_layout(samples.real, samples.descriptor),
                 dp_sgd.DPSGDConfig(calibration.noise_multiplier, 1.0, 0.5), seed=6,
                 on_epoch=lambda epoch, loss: losses.append(loss), on_step=steps.append)
    assert len(losses) == 5 and len(steps) == 5 * (len(train) // 256)
    test_mse = float(np.mean((model(features[test]).numpy() - labels[test]) ** 2))
    naive_mse = float(np.mean((labels[train].mean() - labels[test]) ** 2))
    # Trip distance explains much of the duration: the DP model clearly beats the mean.
    print(f"taxi DP-SGD test MSE {test_mse:.4f}, naive {naive_mse:.4f}")
    assert test_mse < 0.75 * naive_mse, (test_mse, naive_mse)  # measured: 0.51


def test_adassp_approaches_least_squares_as_epsilon_grows():
    rng = np.random.default_rng(0)
    features = rng.uniform(-1, 1, size=(4000, 3))
    labels = features @ np.array([1.0, -2.0, 0.5]) + 0.3 + rng.normal(0, 0.1, size=4000)
    ols = np.linalg.lstsq(np.hstack([features, np.ones((4000, 1))]), labels, rcond=None)[0]
    errors = [np.linalg.norm(adassp(features, labels, eps, 1e-6, feature_bound=2.0,
                                    label_bound=5.0).weights - ols)
              for eps in (0.3, 10.0, 1e4) for _ in range(3)]
    low, middle, high = (np.mean(errors[i:i + 3]) for i in (0, 3, 6))
    assert low > middle > high
    assert high < 1e-2
    with pytest.raises(ValueError, match="delta"):
        adassp(features, labels, 1.0, 0.0, feature_bound=2.0, label_bound=5.0)


def test_adassp_noise_scale_measured_against_an_independent_calibration(monkeypatch):
    # Record each Gaussian release AdaSSP makes and measure its noise (output - input). Oracle:
    # dp_accounting's PLD accountant (not the RDP calibration the code uses) gives the smallest
    # multiplier for which three Gaussians are (1, 1e-6)-DP; PLD is tighter than RDP, so a
    # correct multiplier is >= it. 60 runs x 10 triangle entries = 600 draws per run set: the
    # sample sd has relative sd ~3%, so measured >= 0.85 x oracle fails with prob < 1e-6 while
    # sigma halved (measured ~0.5-0.55 x oracle) is caught.
    from dp_accounting.pld import accountant, common
    from sage_tfx.components.dp_trainer import adassp as adassp_lib
    released = []
    real = adassp_lib.mechanisms.gaussian_with_noise_multiplier

    def spy(values, *, l2_sensitivity, noise_multiplier):
        release = real(values, l2_sensitivity=l2_sensitivity, noise_multiplier=noise_multiplier)
        released.append((np.ravel(release.value) - np.ravel(values)) / l2_sensitivity)
        return release
    monkeypatch.setattr(adassp_lib.mechanisms, "gaussian_with_noise_multiplier", spy)
    rng = np.random.default_rng(0)
    features = rng.uniform(-1, 1, size=(500, 3))
    labels = features @ np.array([1.0, -2.0, 0.5]) + rng.normal(0, 0.1, size=500)
    for _ in range(60):
        adassp(features, labels, 1.0, 1e-6, feature_bound=2.0, label_bound=5.0)
    oracle = accountant.get_smallest_gaussian_noise(
        common.DifferentialPrivacyParameters(1.0, 1e-6), num_queries=3)
    measured = np.std(np.concatenate(released))
    assert len(released) == 180
    assert 0.85 * oracle <= measured <= 1.3 * oracle, (measured, oracle)


def train_with_one_bad_row(bad_features, bad_label, poisson_regression, bad_weight=1.0,
                           steps=3):
    """A one-layer model after `steps` DP-SGD steps on 8 rows, the last one (bad_features,
    bad_label) with weight `bad_weight`; fixed noise seed. Poisson regression (exp link,
    Poisson loss) or least squares."""
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(
        1, activation="exponential" if poisson_regression else None)])
    loss = tf.keras.losses.Poisson() if poisson_regression else tf.keras.losses.MeanSquaredError()
    rng = np.random.default_rng(3)
    features = np.vstack([rng.standard_normal((7, 2)), [bad_features]]).astype(np.float32)
    labels = np.vstack([np.abs(rng.standard_normal((7, 1))), [[bad_label]]]).astype(np.float32)
    weights = np.array([[1.0] * 7 + [bad_weight]] * steps, np.float32)
    plan = dp_sgd.StepPlan(np.tile(np.arange(8, dtype=np.int32), (steps, 1)), weights,
                           normaliser=8.0, epochs=1)
    dp_sgd.train(model, loss, tf.constant(features), tf.constant(labels), plan,
                 dp_sgd.DPSGDConfig(1.0, 1.0, 0.1), seed=4)
    return np.concatenate([w.numpy().ravel() for w in model.trainable_variables])


# A finite feature of 1e30 overflows exp(w x) in Poisson regression (then 0 * inf = NaN in
# the clipped gradient); 1e39 overflows float32 itself (inf) in a least-squares model.
BAD_ROWS = [([1e30, -1e30], 1.0, True), ([1e39, 0.5], 1.0, False)]


@pytest.mark.parametrize("bad_features,bad_label,poisson_regression", BAD_ROWS)
def test_a_record_that_overflows_float32_is_dropped_and_the_model_stays_finite(
        bad_features, bad_label, poisson_regression):
    trained = train_with_one_bad_row(bad_features, bad_label, poisson_regression)
    assert np.isfinite(trained).all()
    # Exactly what a dropped record gives: a null slot (zero row, weight 0), same noise.
    dropped = train_with_one_bad_row([0.0, 0.0], 0.0, poisson_regression, bad_weight=0.0)
    assert np.array_equal(trained, dropped)


@pytest.mark.parametrize("bad_features,bad_label,poisson_regression", BAD_ROWS)
def test_without_the_overflow_guard_one_record_makes_the_model_nan(
        monkeypatch, bad_features, bad_label, poisson_regression):
    monkeypatch.setattr(dp_sgd, "kept_rows", lambda losses, norms: tf.ones_like(losses, tf.bool))
    assert not np.isfinite(train_with_one_bad_row(bad_features, bad_label,
                                                  poisson_regression)).all()


@pytest.mark.parametrize("rows", [60, 300, 4000])
def test_adassp_ridge_is_wangs_algorithm_2_when_the_noise_is_zero(monkeypatch, rows):
    # With the three releases returning their exact inputs (noise 0: accuracy only, no
    # privacy claim), the ridge is Wang's closed form: lambda_min~ = max(0, lambda_min - s
    # Phi^-1(1 - rho/2)), lambda = max(0, s sqrt(d ln(2 d^2 / rho)) - lambda_min~), s = sigma
    # B_x^2. 60 rows: lambda_min~ = 0; 300 rows: both terms positive (s ~ 31, lambda_min ~ 83);
    # 4000 rows: lambda_min is large enough for ridge 0.
    from scipy import stats
    from sage_tfx.components.dp_trainer import adassp as adassp_lib
    from sage_tfx.mechanisms import Release

    def exact(values, *, l2_sensitivity, noise_multiplier):
        return Release(np.asarray(values, dtype=np.float64), None)
    monkeypatch.setattr(adassp_lib.mechanisms, "gaussian_with_noise_multiplier", exact)
    rng = np.random.default_rng(1)
    features = rng.uniform(-1, 1, size=(rows, 3))
    labels = features @ np.array([1.0, -2.0, 0.5]) + 0.3
    result = adassp(features, labels, 1.0, 1e-6, feature_bound=2.0, label_bound=5.0, rho=0.1)
    design = np.hstack([features, np.ones((rows, 1))])
    design *= np.minimum(1.0, 2.0 / np.linalg.norm(design, axis=1, keepdims=True))
    s = result.noise_multiplier * 2.0 ** 2
    lambda_min = max(0.0, np.linalg.eigvalsh(design.T @ design)[0] - s * stats.norm.ppf(0.95))
    ridge = max(0.0, s * math.sqrt(4 * math.log(2 * 16 / 0.1)) - lambda_min)
    assert result.ridge == pytest.approx(ridge, rel=1e-9, abs=1e-12)
    assert (ridge > 0) == (rows < 4000)


def test_adassp_releases_at_the_sensitivities_of_wangs_analysis(monkeypatch):
    # Module docstring (Weyl; Frobenius norm of x x^T; ||x y||): lambda_min and the Gram
    # triangle move by at most B_x^2 when a row is added, X^T y by B_x B_y. The mechanisms scale
    # their noise by what they are told, so the sensitivity each release is told is the claim.
    from sage_tfx.components.dp_trainer import adassp as adassp_lib
    told = []
    real = adassp_lib.mechanisms.gaussian_with_noise_multiplier

    def spy(values, *, l2_sensitivity, noise_multiplier):
        told.append(l2_sensitivity)
        return real(values, l2_sensitivity=l2_sensitivity, noise_multiplier=noise_multiplier)
    monkeypatch.setattr(adassp_lib.mechanisms, "gaussian_with_noise_multiplier", spy)
    features = np.random.default_rng(2).uniform(-1, 1, size=(50, 2))
    adassp(features, features[:, 0], 1.0, 1e-6, feature_bound=3.0, label_bound=5.0)
    assert told == [9.0, 9.0, 15.0]


def test_adassp_ridge_moves_with_the_noisy_minimum_eigenvalue(seeded_noise):
    """Issue 29 item 12: the ridge is lambda = C - max(0, lambda_min + s Z - s Phi^-1(1 - rho/2))
    with C = s sqrt(d ln(2 d^2 / rho)), s = sigma B_x^2 and Z ~ N(0, 1) the released eigenvalue's
    noise. Between the two clamps, Z = (C - lambda - lambda_min) / s + Phi^-1(1 - rho/2) is read
    back from each run's ridge. With d = 20 (C = 13.9 s) and lambda_min = 7 s, no clamp is met
    unless |Z| > 4.9 (probability 1e-6 per run), so over 100 runs sum Z^2 is chi-square(100):
    outside its 1e-6 and 1 - 1e-6 quantiles (about 46 and 178) with probability < 2e-6, plus
    1e-4 for a clamp: the false-failure rate of a seed (seeded_noise fixes it at 0). The exact
    eigenvalue gives Z = 0 in every run (sum 0); half its noise gives a sum near 25."""
    from scipy import stats

    from sage_tfx.components.dp_trainer import adassp as adassp_lib

    epsilon, delta, rho, bound, runs = 1.0, 1e-6, 0.05, 1.0, 100
    base = np.random.default_rng(5).uniform(-1, 1, size=(200, 19))
    s = adassp_lib.noise_multiplier(epsilon, delta) * bound ** 2
    design, _ = adassp_lib.clip_rows(base, np.zeros(200), bound, 1.0)
    copies = max(1, round(7 * s / np.linalg.eigvalsh(design.T @ design)[0]))
    features = np.tile(base, (copies, 1))
    design, _ = adassp_lib.clip_rows(features, np.zeros(len(features)), bound, 1.0)
    lambda_min = np.linalg.eigvalsh(design.T @ design)[0]
    d = design.shape[1]
    assert 6 < lambda_min / s < 8 and d == 20
    ceiling = s * math.sqrt(d * math.log(2 * d * d / rho))
    noise = np.array([(ceiling - adassp(features, features[:, 0], epsilon, delta,
                                        feature_bound=bound, label_bound=1.0, rho=rho).ridge
                       - lambda_min) / s + stats.norm.ppf(1 - rho / 2) for _ in range(runs)])
    squares = float(np.sum(noise ** 2))
    low, high = stats.chi2.ppf(1e-6, runs), stats.chi2.isf(1e-6, runs)
    assert low <= squares <= high, (squares, low, high)


def test_calibration_refuses_delta_one_as_a_calibration_error():
    with pytest.raises(CalibrationError, match="delta"):
        calibrate(plan_for_batch("swo", 1000, 100, 1), 1.0, 1.0)


def test_noisy_steps_that_ran_are_measured_from_the_model():
    # Issue 24: the steps that ran, measured from what happened to the model rather than
    # counted by the code under test. Every row is null (weight 0), so every clipped gradient
    # is 0 and each executed step moves each parameter by lr / B * z, z ~ N(0, (sigma C)^2):
    # after T steps the mean square change is T (lr sigma C / B)^2. Over 10,000 parameters
    # (4 * 2000 weights + 2000 biases) the mean square is chi-square(10,000) / 10,000 times
    # that: within 10% with probability 1 - 4e-12. One step of 6 (ratio 1/6), 5 of 6 (5/6) or
    # no noise (0) fails it, even if the step counter counts the plan.
    sigma, clip, learning_rate, batch, steps = 2.0, 0.5, 0.3, 4, 6
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2000)])
    before = np.concatenate([w.numpy().ravel() for w in model.trainable_variables])
    features = tf.constant(np.random.default_rng(3).standard_normal((batch, 4)), tf.float32)
    labels = tf.constant(np.random.default_rng(4).standard_normal((batch, 2000)), tf.float32)
    plan = dp_sgd.StepPlan(np.tile(np.arange(batch, dtype=np.int32), (steps, 1)),
                           np.zeros((steps, batch), np.float32), normaliser=float(batch),
                           epochs=2)
    counted = []
    dp_sgd.train(model, tf.keras.losses.MeanSquaredError(), features, labels, plan,
                 dp_sgd.DPSGDConfig(sigma, clip, learning_rate), seed=5, on_step=counted.append)
    change = np.concatenate([w.numpy().ravel() for w in model.trainable_variables]) - before
    assert counted == list(range(1, steps + 1))
    expected = steps * (learning_rate * sigma * clip / batch) ** 2
    assert np.mean(change ** 2) == pytest.approx(expected, rel=0.1)
