"""DP-SGD over a run of samples, clipping per example in one forward and backward pass.

One step on sample S (Abadi et al. 2016; oblivious-sampling paper §3 "NoisySGD", §5):

    g = ( sum_{i in S} clip_C(grad loss_i) + N(0, sigma^2 C^2 I) ) / normaliser

* clip_C scales each per-example gradient to L2 norm <= C: clip_C(g_i) = g_i C / max(C, |g_i|).
  clipping.OnePass takes the per-example norms and the clipped sum from one forward and one
  backward pass (ghost norms and book-keeping, Bu et al. 2023), with the overflow guard below
  between the norms and the sum; it is checked against per-example gradients taken one by
  one (tests/components/test_dp_clipping.py). Its small ops are compiled kernels
  (step_ops); TensorFlow cannot compile those with XLA, so the step is a TensorFlow graph,
  as the non-private reference step the benchmark compares it with is.
* The sum therefore moves by at most C when one record is added or removed (2C when replaced;
  oblivious_sample_gen/accounting.py accounts for that). Gaussian noise of std sigma * C makes
  each step the subsampled Gaussian mechanism the accountant composes.
* The normaliser is public: the sample size m for SWO/shuffling, the expected size gamma * n for
  Poisson (the actual size is private, paper §5). Dividing by it is post-processing.
* Every step has the same shape and reads the same slots whatever the data: step j reads the
  j-th unit of `slot_width` slots, real, null or dummy; nulls and dummies are masked (weight 0:
  zero loss, so zero gradient, and clip factor 1). The number of steps is the descriptor's,
  never data-dependent; `run_steps` counts the steps as they execute.
* Overflow (issue 16 §2). The record rule makes every input finite, but a huge finite value
  (a feature of 1e30) can still overflow the loss or the gradient in float32, and inf * 0 is
  NaN: clipping cannot save it, and one such record would make the model NaN. So a row whose
  loss or gradient norm (under the current model) is not finite is treated as dropped: it
  becomes the null row (zero inputs and labels) with weight 0 before the clipped gradient is
  taken (`kept_rows`). Which rows are dropped is a function of each record alone given the
  model, which is public (the previous steps' DP output), so this is a per-record map
  x -> x or null and the add/remove analysis covers it: the noisy sum moves by at most C
  when one record is added or removed, dropped or not. It is tf.where inside the compiled
  step, never a Python branch: the step has the same shape, reads the same rows, draws the
  same noise, and returns only its update. (A model whose own parameters overflow on the
  null row would still diverge, but that depends on the model alone, not on any record.)

Noise comes from AES-256 in counter mode, one key per buffer of draws: 256 bits from the OS
CSPRNG (sage_tfx.randomness.secret_key), or, where a test, a benchmark or the audit passes a
seed, from a Philox generator so that the run repeats (noise_generator, noise_key). What that
does and does not give, honestly: the draws are made in Python, outside the step's graph (a
buffer at a time, ahead of the steps, on a worker thread: NoiseBuffer), but not by
sage_tfx.mechanisms: OpenDP's sampler takes about 0.6 s per 17,000 draws
(docs/dp-aggregation.md), a minute per 2^20, against 3.4 ms here. These are float32 Gaussians
computed from the keystream by Box-Muller (keyed_gaussian_noise), not exact lattice samples.
Mironov's (2012) attack is on Laplace, and needs the exact noisy value of one release; here no
noisy gradient leaves the step, only the model after every step's float32 update, but Jin et
al. (IEEE S&P 2022) show floating-point Gaussian samplers are attackable too when their output
is seen. So the epsilon the accountant reports is a proof for the idealised
mechanism (real-valued Gaussians of std sigma * C); it is not a proof for this float32
implementation. The keystream is pseudorandom to anyone without its key (AES as a
pseudorandom function); a seeded run is only as unpredictable as its seed.

Lazy noise for embedding tables (issue 35). An embedding table of V rows gets V d Gaussians
per step (161,153 for 10,000 ids of dimension 16: 1.5 ms, more than the whole non-private
step, which updates at most B rows). Where it is exactly equivalent, the noise of a row is
added when the row is next read instead of at every step:

* Where. A top-level Keras `Embedding` of a functional or Sequential model, called once, whose
  ids are selected from the batch alone (no trainable variable before it; only layers that
  slice, cast or reshape, the same in training, see _ID_LAYERS), without a
  constraint, whose gradient is IndexedSlices with one index per id it gathers (traced once on
  a public stand-in batch of 2: no other read of the table, dense or gathered). The optimizer
  is plain SGD (tf.keras.optimizers.SGD, momentum 0): an update is -lr times the noisy clipped
  sum, and nothing else. Every other variable, and every table failing a check, gets eager
  dense noise.
* Why it is the same mechanism. Row r's clipped-sum gradient g_r(t) at step t is exactly 0
  when the batch does not gather r (every per-example gradient is 0 off the gathered rows), so
  under eager noise E_r(t + 1) = E_r(t) - lr g_r(t) - lr s Z_r(t), with Z_r(t) iid N(0, I_d)
  independent of everything before step t (s = sigma C). Between a step a that reads r and the
  next step b that reads it (or the end T), E_r(b) = [E_r(a) - lr g_r(a)] - lr s (Z_r(a) + ...
  + Z_r(b - 1)), and the sum of b - a independent N(0, I_d) is distributed as sqrt(b - a)
  N(0, I_d), independent of everything else. The lazy step keeps noised_through[r] (row r
  holds the noise of the steps before it; a step that reads r leaves its own noise pending),
  and draws lr s sqrt(t - noised_through[r]) Z' for each row step t gathers (all ids of the
  padded batch: real, null and dummy rows alike) before its forward pass, and for every row
  at materialise(). By induction over the steps, each step being a function of the values it
  reads, the batch and fresh independent noise, the joint law of every value a step reads,
  every eager variable and the final model is the eager one: the accountant's guarantee, on
  the final model and on anything a callback sees, is unchanged.
* What changes. Which draws of the NoiseBuffer a step is served, and the step's work, depend
  on how many distinct ids the batch gathers, as the gather and the
  non-private sparse update already do: a timing difference inside the process, not an output.
  Between steps the model in memory is not the eager one (rows not read since a step lack that
  step's noise); it never leaves run_steps unmaterialised: run_steps materialises every row
  before on_step and on_epoch, on return and on an exception; a caller of make_dp_step's step
  outside run_steps calls step.materialise() before reading the model. Each lazy draw is one
  served draw scaled to std s sqrt(k); materialising every row takes V d more (every step
  when on_step is set): keyed_gaussian_noise's tail argument counts every draw served.

The per-epoch training loss reported to `on_epoch` is not DP: DPTrainer writes it nowhere
(benchmarks on public data read it).
"""
from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from sage_tfx.components.dp_trainer import clipping, step_ops, noise_kernel
import tensorflow as tf  # after clipping, which imports tensorflow-privacy's submodules

from sage_tfx.components.oblivious_sample_gen.descriptor import SamplingDescriptor
from sage_tfx.components.util.legacy_keras import require_legacy_keras
from sage_tfx.components.util.losses import with_reduction
from sage_tfx.randomness import secret_key


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
    """Which rows each step reads: rows[step] and weights[step] (1 for a record, 0 for a null
    record or a dummy: zero loss, so zero gradient, and clip factor 1).

    The rows are public: step j reads the j-th unit of `slot_width` consecutive slots
    (descriptor.slot_width), real or not. Which slots are real is secret (for Poisson it is
    the sample's size) and only enters as the weights' values, never as an address."""
    rows: np.ndarray
    weights: np.ndarray
    normaliser: float
    epochs: int

    @property
    def steps(self) -> int:
        return self.rows.shape[0]

    @classmethod
    def for_layout(cls, real: np.ndarray, descriptor: SamplingDescriptor,
                   epochs: Optional[int] = None) -> "StepPlan":
        """Steps over the first `epochs` epochs of slots laid out as `descriptor` says, where
        slot i is row i of the parsed feature tensors and real[i] says whether it holds a
        record."""
        epochs = descriptor.epochs if epochs is None else epochs
        steps, width = descriptor.samples_per_epoch * epochs, descriptor.slot_width
        rows = np.arange(steps * width, dtype=np.int32).reshape(steps, width)
        weights = np.asarray(real[:steps * width], dtype=np.float32).reshape(steps, width)
        return cls(rows, weights, descriptor.expected_batch_size, epochs)


def gather_rows(features, rows: tf.Tensor):
    """Rows `rows` of the features: one tensor, or a structure of them (a model's named
    inputs), each [N, ...] -> [len(rows), ...]."""
    return tf.nest.map_structure(lambda feature: tf.gather(feature, rows), features)


def example_spec(features):
    """The tf.TensorSpec of one example of `features` (a structure of specs for a structure of
    tensors)."""
    return tf.nest.map_structure(lambda feature: tf.TensorSpec(feature.shape[1:], feature.dtype),
                                 features)


def noise_generator(seed: Optional[int] = None) -> Optional[tf.random.Generator]:
    """Where DP-SGD's noise keys come from: None (the product) for the OS CSPRNG; for a seed, a
    Philox generator, so that the run repeats."""
    return None if seed is None else tf.random.Generator.from_seed(seed)


def noise_key(generator: Optional[tf.random.Generator]) -> bytes:
    """A fresh 256-bit AES key: from the OS CSPRNG, or a seeded generator's next two seeds
    (4 x 64 bits)."""
    if generator is None:
        return secret_key(32)
    return generator.make_seeds(2).numpy().astype("<i8").tobytes()


# The draws are made in chunks of this many pairs: each chunk's keystream (20 bytes a pair, 320
# KB, in cache) is encrypted while the GIL is held (about 50 us), the rest of the arithmetic
# without it. 2^20 draws: 3.4 ms in chunks of 2^14 pairs, 3.6 in 2^16, 4.0 in 2^12.
_PAIRS_PER_CHUNK = 1 << 14


def keyed_gaussian_noise(key: bytes, size: int, stddev: float) -> np.ndarray:
    """`size` independent N(0, stddev^2) float32 draws, a function of (key, size, stddev) alone
    (so it may run on any thread), in a flat array aligned to 64 bytes (TensorFlow may then
    read it in place).

    The bits. The keystream of AES-256 in counter mode under `key` (the counter from 0): a
    pseudorandom function of the counter, so its blocks are as good as independent uniform
    bits to anyone without the key. Chunk c takes the next 20 P bytes of it (P =
    _PAIRS_PER_CHUNK pairs): 16 P bytes give each pair two 64-bit words (the radius), then 4 P
    bytes one 32-bit word each (the angle), little-endian words on the machines TensorFlow
    runs on (x86-64, ARM64). Its draws are the pairs' cos halves then their sin
    halves, and the draws are the chunks' in order, cut to `size`: a function of the key and
    the position, whatever `size` is.

    Box-Muller (1958): for independent V uniform on (0, 1] and A uniform on [0, 1), sqrt(-2 ln
    V) (cos 2 pi A, sin 2 pi A) are two independent standard normals (box_muller).

    Across CPUs. numpy's log, cos and sin dispatch per CPU feature, so the last bits of a draw
    may differ between machines for the same key. That is sound here, unlike DP-SQLP's keyed
    noise (mechanisms/polar_kernel.py): a fill is drawn once, under a fresh key, and added
    once; no step's noise is ever recomputed, on this machine or another.

    Why not mechanisms.keyed.KeyedGaussian, the AES Gaussian DP-SQLP uses: it evaluates noise
    at arbitrary (stream, counter) points, with the bits its release tests pin, by the polar
    method with rejection rounds; a flat fill of 2^20 took it 11.7 ms against 3.4 here. This
    one only fills buffers in order, so it runs the keystream straight through.

    The tail. A float32 uniform has 23 random bits, so V = 1 - U >= 2^-23 and no pair's
    radius sqrt(-2 ln V) would exceed sqrt(46 ln 2) = 5.65 standard deviations (TensorFlow's
    normal kernel clamps at 5.68). That truncation is not a floating-point detail: the ideal
    radius exceeds it exactly when the ideal V < 2^-23, probability 1.2e-7 per pair, 9.6e-3 per
    step for the 80,577 pairs of a 161,153-parameter model, and a process that differs from the
    accountant's idealised Gaussian with that probability is only as private as that total
    variation allows (below). So V is built from 104 random bits: two float64 uniforms (52
    bits each), V = (1 - U1) - U2 2^-52, uniform on (0, 1] at resolution 2^-104; the radius
    then reaches sqrt(208 ln 2) = 12.01 standard deviations, and the ideal one exceeds that
    with probability 2^-104 = 4.9e-32 per pair.
    What that gives: couple each pair with the ideal one so that they differ (beyond the
    float caveat of the module docstring) only on that event; a run that is served N draws
    (T steps of d each, plus each materialisation's lazy rows) uses at most N pairs
    (NoiseBuffer may serve a pair's two halves to two steps), so the two processes differ
    with probability at most tau = N 2^-104 on either neighbour, and for any set S of
    outcomes P(S) <= e^eps Q(S) + delta + (1 + e^eps) tau. The accountant does not add that
    term: it is below 1e-15 whenever (1 + e^eps) N < 2e16 (10^12 draws, a million parameters
    over a million steps, with eps up to 9 give 4.0e-16).
    Cost: 2^20 draws in about 3.4 ms of one core (TensorFlow's stateless uniforms and the same
    transform as graph ops took 16 ms of CPU, 9 ms on two cores)."""
    pairs = (size + 1) // 2
    chunks = -(-pairs // _PAIRS_PER_CHUNK)
    keystream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    plaintext = np.zeros(20 * _PAIRS_PER_CHUNK, np.uint8)  # encrypting zeros: the keystream
    words = np.empty(20 * _PAIRS_PER_CHUNK + 16, np.uint8)  # update_into wants a block spare
    draws = _aligned_float32(2 * _PAIRS_PER_CHUNK * chunks)
    for chunk in range(chunks):
        keystream.update_into(plaintext, words)
        box_muller(words[:16 * _PAIRS_PER_CHUNK].view(np.uint64),
                   words[16 * _PAIRS_PER_CHUNK:20 * _PAIRS_PER_CHUNK].view(np.uint32), stddev,
                   draws[2 * _PAIRS_PER_CHUNK * chunk:2 * _PAIRS_PER_CHUNK * (chunk + 1)])
    return draws[:size]


def box_muller(radius_words: np.ndarray, angle_words: np.ndarray, stddev: float,
               out: np.ndarray) -> None:
    """keyed_gaussian_noise's transform of n pairs' words (2n 64-bit radius words: U1 and U2
    from the top 52 bits of each pair's two; n 32-bit angle words: A from the top 23 bits) into
    `out` (2n float32): stddev sqrt(-2 ln V) cos 2 pi A for every pair, then the sin halves."""
    pairs = angle_words.shape[0]
    if radius_words.shape != (2 * pairs,) or out.shape != (2 * pairs,):
        # The kernels do not check bounds: a short array would be read or written past its end.
        raise ValueError(f"box_muller needs 2n radius words and 2n outputs for n = {pairs} "
                         f"angle words, got {radius_words.shape[0]} and {out.shape[0]}")
    tail = np.empty(pairs)
    noise_kernel.tails(radius_words, tail)  # V = (1 - U1) - U2 2^-52, in (0, 1]
    np.log(tail, out=tail)
    radius, angle = np.empty(pairs, np.float32), np.empty(pairs, np.float32)
    noise_kernel.radii(tail, np.float32(stddev), radius)
    noise_kernel.angles(angle_words, angle)
    np.multiply(np.cos(angle, out=out[:pairs]), radius, out=out[:pairs])
    np.multiply(np.sin(angle, out=out[pairs:]), radius, out=out[pairs:])


def _in_place(draws: np.ndarray) -> tf.Tensor:
    """`draws` as a tensor that reads their memory (DLPack: no copy, 0.3 against 1.3 ms per 2^20
    for a copy into the buffer). TensorFlow aborts the process on a tensor whose data is not
    64-byte aligned, so such draws are refused here first (keyed_gaussian_noise aligns its).
    Ownership passes to TensorFlow: assigning such a tensor, which nothing else holds, to a
    variable makes the variable keep that memory (kept alive by the DLPack capsule), not a copy,
    so the caller must not keep or write `draws` afterwards."""
    if draws.ctypes.data % 64:
        raise ValueError("noise draws handed to TensorFlow in place must start on a 64-byte "
                         "boundary")
    return tf.experimental.dlpack.from_dlpack(draws.__dlpack__())


def _aligned_float32(count: int) -> np.ndarray:
    """An uninitialised float32 array whose data starts on a 64-byte boundary (TensorFlow reads
    an array in place through DLPack only when it is aligned, and aborts otherwise)."""
    buffer = np.empty(count + 16, np.float32)
    start = (-buffer.ctypes.data % 64) // 4  # numpy aligns to at least 16 bytes
    return buffer[start:start + count]


class NoiseBuffer:
    """Independent N(0, stddev^2) draws served in order from a buffer that keyed_gaussian_noise
    refills at least REFILL_DRAWS at a time, under a fresh key each time (noise_key):
    reserve(most) before each compiled call (in Python), then inside it take(size) (draws, flat)
    or add_to(tensors) (the tensors plus the next draws, in one op). The next REFILL_DRAWS are
    drawn ahead, on a worker thread, while the steps run.

    Why. A draw per step has a fixed cost (as graph ops in the step, about 20 ops and 0.17 ms
    for the benchmark's 5,569-parameter MLP on a 0.8 ms non-private step) that outweighs
    drawing its few thousand values. Drawn 2^20 at a time, that cost is paid once per ~190
    MLP steps; a take is one slice of the buffer (0.05 ms), add_to one op. The refill
    decision is made in Python from an upper bound on what the next call reads, because a
    tf.cond in the step cost as much as the draw it saved.
    Why it is the same noise. The buffer's values are iid N(0, stddev^2), independent of the
    data and of everything the steps compute (nothing else uses the generator). Which
    positions a call reads depends only on the sizes asked, never on the values, and no
    position is read twice (a refill discards the unread tail: a choice made from sizes
    alone, so the values served stay iid). So the values served are iid N(0, stddev^2),
    independent of everything else, as fresh draws per call would be: the mechanism and its
    accounting are unchanged; only which generator output a seed gives each step changes.
    The buffered draws are as secret as their keys: they stay in the process
    beside the model and are never written or returned.
    Drawn ahead. A refill installs the draws made ahead (the variable takes their memory over:
    _in_place; nothing else keeps a fill) and starts the next ones on a worker thread, so drawing
    them (about 3.4 ms per 2^20 on this CPU, 2-3 refills per epoch of the benchmark's models,
    one per step for a model of a million parameters) overlaps the steps instead of stalling
    one. The next fill's key is
    taken from the generator in reserve(), on the caller's thread, in the order the refills
    happen; the worker only computes keyed_gaussian_noise from that key. So a seed gives the
    same draws as drawing at each refill did, and no two threads use the generator. The draws
    made ahead are as many as the last refill's (at least REFILL_DRAWS, more for a model whose
    step reads more): a refill they do not cover discards them unread and draws its own with
    the next key, a choice made from sizes alone, as the discarded tail's."""

    REFILL_DRAWS = 1 << 20  # 4 MiB of float32

    def __init__(self, generator: Optional[tf.random.Generator], stddev: float):
        # In host memory, where the draws are made and the noise op (CPU only) reads them.
        with tf.device("/CPU:0"):
            self._draws = tf.Variable(tf.zeros([0]), shape=tf.TensorShape([None]),
                                      trainable=False)
            self._next = tf.Variable(0, dtype=tf.int64, trainable=False)  # first unread

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
        def install(draws):
            self._draws.assign(draws)
            self._next.assign(0)

        # Traced here, once, and called as a concrete function: a call neither traces again
        # nor counts in TensorFlow's retracing detector (make_dp_step says why that matters).
        self._install = install.get_concrete_function()
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="dp-sgd-noise")
        self.restart(generator, stddev)

    def restart(self, generator: Optional[tf.random.Generator], stddev: float) -> None:
        """Serve draws from `generator`'s keys at `stddev` from now on, as a new buffer would:
        nothing drawn before is served again (the unread draws and the fill drawn ahead are
        dropped unread, a choice made from nothing but the restart)."""
        self._generator, self._stddev = generator, stddev
        self._size = self._promised = 0  # the buffer's size; draws reserved since its refill
        # The next fill, drawn ahead: (its size, its draws when done)
        self._ahead: Optional[tuple[int, concurrent.futures.Future]] = None

    def reserve(self, most: int) -> None:
        """Before a compiled call that takes at most `most` draws: refill if the unread draws
        might not cover them."""
        if self._promised + most > self._size:
            needed = max(most, self.REFILL_DRAWS)
            ahead, self._ahead = self._ahead, None
            if ahead is not None and ahead[0] >= needed:
                self._size, draws = ahead[0], ahead[1].result()
            else:  # the first refill, or one the draws made ahead do not cover (discarded)
                self._size = needed
                draws = keyed_gaussian_noise(noise_key(self._generator), needed, self._stddev)
            self._install(_in_place(draws))
            self._ahead = (self._size, self._worker.submit(
                keyed_gaussian_noise, noise_key(self._generator), self._size, self._stddev))
            self._promised = 0
        self._promised += most

    def settle(self) -> None:
        """Wait for the fill being drawn ahead, if any (it stays ahead: the next refill uses it)."""
        if self._ahead is not None:
            self._ahead[1].result()

    def add_to(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        """Inside a compiled call: each tensor plus the next unread draws in its shape, in one
        op (a take, split, reshapes and adds were a dozen ops per step). OutOfRangeError if the
        unread draws are too few (a take no reserve covered): never served twice or short."""
        if not tensors:
            return []
        noisy, unread = step_ops.add_noise(tensors, self._draws, self._next.read_value())
        self._next.assign(unread)
        return noisy

    def take(self, size) -> tf.Tensor:
        """Inside a compiled call: the next `size` (an int or a scalar integer tensor) unread
        draws, flat. Past the buffer's end (a take no reserve covered) the slice comes back
        short and the caller's split fails: a draw is never served twice."""
        start = self._next.read_value()
        draws = self._draws[start:start + tf.cast(size, tf.int64)]
        self._next.assign_add(tf.cast(size, tf.int64))
        return draws


@dataclass(frozen=True, eq=False)
class LazyTable:
    """An embedding table noised lazily (module docstring): `ids` maps a batch of features to
    the ids the layer gathers; row r holds the noise of the steps before noised_through[r]."""
    table: tf.Variable
    ids: Callable[[tf.Tensor], tf.Tensor]
    noised_through: tf.Variable
    ids_per_row: Optional[int]  # ids gathered per example at most; None if the trace left it open

    def touched(self, batch_features: tf.Tensor) -> tf.Tensor:
        """The distinct rows the batch gathers."""
        # As the forward pass computes them (out-of-range ids gather row 0).
        ids = clipping.public_ids(self.ids(batch_features, training=True), self.table.shape[0])
        return tf.unique(tf.reshape(ids, [-1]))[0]

    def most_touched(self, batch_rows: int) -> int:
        """An upper bound on len(touched(batch)) for a batch of `batch_rows` examples."""
        rows = self.table.shape[0]
        return rows if self.ids_per_row is None else min(rows, batch_rows * self.ids_per_row)


# What may stand between the input and a lazily noised table: layers that only select and
# reshape the input, the same in training as in inference and with no randomness, so the ids
# `touched` computes are the ids the forward pass gathers (a Dropout or GaussianNoise there
# would gather rows whose pending noise was never added).
_ID_LAYERS = ("InputLayer", "Reshape", "Flatten", "Permute")
_ID_OPS = ("__operators__.getitem", "cast", "reshape", "squeeze", "expand_dims")


def _selects_ids(layer: tf.keras.layers.Layer) -> bool:
    name = type(layer).__name__
    return name in _ID_LAYERS or (name in ("TFOpLambda", "SlicingOpLambda")
                                  and getattr(layer, "symbol", None) in _ID_OPS)


def lazy_tables(model: tf.keras.Model, features: tf.Tensor) -> list[LazyTable]:
    """The model's embedding tables where lazy noise is exactly eager noise (module docstring,
    "Where"); decided from the model's structure and a trace on a public stand-in batch."""
    if not getattr(model, "_is_graph_network", False) or len(model.inputs) != 1:
        return []
    candidates = {}
    for layer in model.layers:
        if (type(layer) is tf.keras.layers.Embedding and layer.trainable
                and layer.embeddings_constraint is None and not layer.sparse
                and len(layer._inbound_nodes) == 1):
            ids_model = tf.keras.Model(model.inputs, layer.input)
            if not ids_model.trainable_weights and all(map(_selects_ids, ids_model.layers)):
                candidates[layer.embeddings.ref()] = ids_model
    if not candidates:
        return []
    tables = [ref.deref() for ref in candidates]

    @tf.function
    def table_gradients(batch):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(tables)
            outputs = tf.nest.flatten(model(batch, training=True))
            total = tf.add_n([tf.reduce_sum(tf.cast(output, tf.float32)) for output in outputs])
        return tape.gradient(total, tables), [candidates[t.ref()](batch, training=True)
                                              for t in tables]

    gradients, ids = table_gradients.get_concrete_function(
        tf.nest.map_structure(lambda spec: tf.TensorSpec([2, *spec.shape], spec.dtype),
                              example_spec(features))).structured_outputs
    # Ids per example from the ids the trace of 2 examples gathers (not from the ids layer's
    # output shape: a reshape may move ids onto the batch axis). The layers allowed before a
    # lazy table only slice, cast and reshape, so a batch of B gathers at most B times half.
    return [LazyTable(table, candidates[table.ref()],
                      tf.Variable(tf.zeros([table.shape[0]], tf.int64), trainable=False),
                      None if gathered.shape.num_elements() is None
                      else -(-gathered.shape.num_elements() // 2))
            for table, gradient, gathered in zip(tables, gradients, ids)
            if isinstance(gradient, tf.IndexedSlices)
            and gradient.indices.shape.num_elements() == gathered.shape.num_elements()]


def pending_noise_scale(pending_steps: tf.Tensor) -> tf.Tensor:
    """The noise of k pending steps in units of one step's: the sum of k independent
    N(0, s^2) draws is N(0, k s^2), so sqrt(k)."""
    return tf.sqrt(tf.cast(pending_steps, tf.float32))


class TrainingStep:
    """step(rows, weights) -> (weighted loss sum, weight sum); step.materialise() adds every
    pending (lazy) noise, so that the model in memory is the one the mechanism releases;
    step.settle() waits for work the steps started in the background (the next noise fill)."""

    def __init__(self, step: Callable, materialise: Optional[Callable] = None,
                 settle: Optional[Callable] = None):
        self._step, self._materialise, self._settle = step, materialise, settle

    def __call__(self, rows: tf.Tensor, weights: tf.Tensor):
        return self._step(rows, weights)

    def materialise(self) -> None:
        if self._materialise is not None:
            self._materialise()

    def settle(self) -> None:
        """Wait until nothing the steps started still runs, so that a clock around a run of
        steps counts all of their work (benchmarks: a fill drawn ahead would otherwise be drawn
        during whatever runs next)."""
        if self._settle is not None:
            self._settle()


class DPStep(TrainingStep):
    """make_dp_step's step, which can also start another run of the same model on the same
    data (restart)."""

    def __init__(self, step: Callable, materialise: Optional[Callable], settle: Callable,
                 restart: Callable):
        super().__init__(step, materialise, settle)
        self._restart = restart

    def restart(self, config: DPSGDConfig, normaliser: float,
                generator: Optional[tf.random.Generator]) -> None:
        """Run with `config`, `normaliser` and noise keys from `generator` from now on, as a
        step newly made by make_dp_step would (the same draws for the same generator): the
        optimizer's and the lazy tables' clocks back at 0, nothing drawn before served. Nothing
        is traced again. The model's weights are the caller's to reset."""
        self._restart(config, normaliser, generator)


def make_dp_step(model: tf.keras.Model, loss: tf.keras.losses.Loss, features: tf.Tensor,
                 labels: tf.Tensor, config: DPSGDConfig, normaliser: float,
                 generator: Optional[tf.random.Generator],
                 lazy_noise: bool = True) -> DPStep:
    """A compiled DP-SGD step: step(rows, weights) -> (weighted loss sum, weight sum), with
    lazy noise on the embedding tables where it is exact (module docstring): call
    step.materialise() before reading the model (run_steps does).
    lazy_noise=False: every parameter noised at every step (the same law; other draws).

    Traced once. The settings (learning rate, normaliser, clip norm, noise) are variables the
    compiled functions read, or the NoiseBuffer's, not constants traced into them, so that
    step.restart starts a run with other settings on the same model without a new trace
    (DPTuner's trials: a trace per run would leave a count of the runs in the process). The
    variables are float32 like the constants they stand for: the same bits. The compiled
    functions are called as concrete functions, which TensorFlow's retracing detector does not
    count (it counts calls per Python function, across every step made in the process, and its
    warning quotes the count)."""
    require_legacy_keras()
    clipping.public_ids_only(model)
    # lr ((sum + noise) / normaliser) as (lr / normaliser) (sum + noise): one pass over the
    # parameters fewer (the normaliser is public, see the module docstring). Plain SGD
    # (momentum 0), which lazy noise needs; its learning rate is a variable.
    optimizer = tf.keras.optimizers.SGD(config.learning_rate / normaliser)
    learning_rate = optimizer.learning_rate
    per_example = with_reduction(loss, tf.keras.losses.Reduction.NONE)
    clip = tf.Variable(config.l2_norm_clip, dtype=tf.float32, trainable=False)
    trainable = model.trainable_variables
    lazy = lazy_tables(model, features) if lazy_noise else []
    lazy_index = {entry.table.ref(): index for index, entry in enumerate(lazy)}
    eager = [variable for variable in trainable if variable.ref() not in lazy_index]
    sizes = [variable.shape.num_elements() for variable in eager]
    widths = [entry.table.shape[1] for entry in lazy]
    counts = [entry.table.shape.num_elements() for entry in lazy]
    steps_taken = tf.Variable(0, dtype=tf.int64, trainable=False)
    noise_draws = NoiseBuffer(generator, config.noise_multiplier * config.l2_norm_clip)

    def clipped_sum(rows, weights):
        batch_features, batch_labels = gather_rows(features, rows), tf.gather(labels, rows)
        # One forward and one backward pass give the per-example norms and, for any
        # coefficients, the clipped sum (clipping.py); the overflow guard sits between them.
        gradients = clipping.OnePass(model, trainable, per_example, batch_features,
                                     batch_labels, weights)
        kept = kept_rows(gradients.losses, gradients.norms)
        factors = clip / tf.maximum(clip, gradients.norms)  # |factor_i * g_i| <= C
        losses = gradients.losses * weights
        return (gradients.clipped_sum(factors, kept),
                tf.reduce_sum(tf.where(kept, losses, 0.0)),
                tf.reduce_sum(tf.where(kept, weights, 0.0)))

    def add_pending_noise(entry: LazyTable, rows: tf.Tensor, draws: tf.Tensor) -> None:
        """Rows `rows` of the table get the noise of their pending steps: lr s sqrt(k) Z' for
        k = steps_taken - noised_through (draws: N(0, s^2) per entry, [len(rows), d])."""
        pending = steps_taken - tf.gather(entry.noised_through, rows)
        scale = learning_rate * pending_noise_scale(pending)
        entry.table.scatter_sub(tf.IndexedSlices(draws * scale[:, None], rows))
        entry.noised_through.scatter_update(
            tf.IndexedSlices(tf.fill(tf.shape(rows), steps_taken), rows))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32),
                                  tf.TensorSpec([None], tf.float32)])
    def step(rows, weights):
        # The pending noise of each lazy table's rows this batch gathers, taken and added
        # before the forward pass reads them (automatic control dependencies order the table's
        # scatter before clipped_sum's gather); then the eager variables' noise, added to their
        # clipped sums in one op. Every draw is a fresh N(0, noise_std^2), read once.
        if lazy:
            touched = [entry.touched(gather_rows(features, rows)) for entry in lazy]
            lazy_sizes = [tf.size(rows_read) * width for rows_read, width in zip(touched, widths)]
            for entry, rows_read, draws, width in zip(
                    lazy, touched, tf.split(noise_draws.take(sum(lazy_sizes)), lazy_sizes),
                    widths):
                add_pending_noise(entry, rows_read, tf.reshape(draws, [-1, width]))
        clipped, loss_sum, weight_sum = clipped_sum(rows, weights)
        eager_noisy = iter(noise_draws.add_to(
            [tf.convert_to_tensor(gradient) for gradient, variable in zip(clipped, trainable)
             if variable.ref() not in lazy_index]))
        noisy = []
        for gradient, variable in zip(clipped, trainable):
            if variable.ref() not in lazy_index:
                noisy.append(next(eager_noisy))
            elif isinstance(gradient, tf.IndexedSlices):  # the rows the batch gathers
                noisy.append(gradient)
            else:  # the rows read; every other row's clipped sum is exactly 0
                rows_read = touched[lazy_index[variable.ref()]]
                noisy.append(tf.IndexedSlices(tf.gather(gradient, rows_read), rows_read,
                                              tf.shape(variable, out_type=rows_read.dtype)))
        optimizer.apply_gradients(zip(noisy, trainable))
        if lazy:  # the lazy tables' clock (add_pending_noise); nothing else reads it
            steps_taken.assign_add(1)
        return loss_sum, weight_sum

    compiled_step = step.get_concrete_function()

    def reserved_step(rows: tf.Tensor, weights: tf.Tensor):
        batch_rows = rows.shape[0]
        noise_draws.reserve(sum(sizes) + sum(entry.most_touched(batch_rows) * width
                                             for entry, width in zip(lazy, widths)))
        return compiled_step(rows, weights)

    @tf.function
    def materialise():
        # Every row of every lazy table: one take for them all.
        noise = tf.split(noise_draws.take(sum(counts)), counts)
        for entry, draws, width in zip(lazy, noise, widths):
            every_row = tf.range(entry.table.shape[0], dtype=tf.int64)
            add_pending_noise(entry, every_row, tf.reshape(draws, [-1, width]))

    compiled_materialise = materialise.get_concrete_function() if lazy else None

    def reserved_materialise():
        noise_draws.reserve(sum(counts))
        compiled_materialise()

    def restart(new_config: DPSGDConfig, new_normaliser: float,
                new_generator: Optional[tf.random.Generator]) -> None:
        optimizer.learning_rate = new_config.learning_rate / new_normaliser
        optimizer.iterations.assign(0)  # plain SGD's only state (momentum 0: no slots)
        clip.assign(new_config.l2_norm_clip)
        steps_taken.assign(0)
        for entry in lazy:
            entry.noised_through.assign(tf.zeros_like(entry.noised_through))
        noise_draws.restart(new_generator,
                            new_config.noise_multiplier * new_config.l2_norm_clip)

    return DPStep(reserved_step, reserved_materialise if lazy else None, noise_draws.settle,
                  restart)


def kept_rows(losses: tf.Tensor, gradient_norms: tf.Tensor) -> tf.Tensor:
    """Rows whose per-example loss and gradient norm are finite; the others are dropped."""
    return tf.math.is_finite(losses) & tf.math.is_finite(gradient_norms)


def make_nondp_step(model: tf.keras.Model, loss: tf.keras.losses.Loss, features: tf.Tensor,
                    labels: tf.Tensor, learning_rate: float, normaliser: float) -> TrainingStep:
    """The non-private reference (no clipping, no noise) with the same interface, plan,
    normaliser and compilation, for benchmarks and the accuracy table; never used on granted
    data."""
    optimizer = tf.keras.optimizers.SGD(learning_rate)
    per_example = with_reduction(loss, tf.keras.losses.Reduction.NONE)

    def gradient(rows, weights):
        batch_features, batch_labels = gather_rows(features, rows), tf.gather(labels, rows)
        with tf.GradientTape() as tape:
            losses = per_example(batch_labels, model(batch_features, training=True)) * weights
            objective = tf.reduce_sum(losses) / normaliser
        return (tape.gradient(objective, model.trainable_variables), tf.reduce_sum(losses),
                tf.reduce_sum(weights))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32),
                                  tf.TensorSpec([None], tf.float32)])
    def step(rows, weights):
        gradients, loss_sum, weight_sum = gradient(rows, weights)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss_sum, weight_sum

    return TrainingStep(step)


def run_steps(step: TrainingStep, plan: StepPlan,
              on_epoch: Optional[Callable[[int, float], None]] = None,
              on_step: Optional[Callable[[int], None]] = None,
              progress: Optional[Callable[[int], None]] = None) -> int:
    """Run every step of `plan` in order; after each step, on_step(steps run so far); after
    each epoch, on_epoch(epoch, mean training loss) (1-based epoch; the loss is not DP, see the
    module docstring). The model is materialised (no pending lazy noise) before each callback,
    on return and on an exception. progress(steps run so far) is called after each step
    WITHOUT materialising (materialising every row at every step would undo lazy noise): it is
    for counting only and must not read the model. Returns the number of steps that ran."""
    steps_per_epoch = plan.steps // plan.epochs
    ran = 0
    try:
        for epoch in range(plan.epochs):
            # Summed as tensors: converting each step's loss would wait for every step.
            loss_sums, weight_sums = [], []
            for index in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch):
                batch_loss, batch_weight = step(tf.constant(plan.rows[index]),
                                                tf.constant(plan.weights[index]))
                ran += 1
                if progress is not None:
                    progress(ran)
                if on_step is not None:
                    step.materialise()
                    on_step(ran)
                loss_sums.append(batch_loss)
                weight_sums.append(batch_weight)
            if on_epoch is not None:
                step.materialise()
                on_epoch(epoch + 1,
                         float(tf.add_n(loss_sums)) / max(float(tf.add_n(weight_sums)), 1.0))
    finally:
        step.materialise()
    return ran


def train(model: tf.keras.Model, loss: tf.keras.losses.Loss, features: tf.Tensor,
          labels: tf.Tensor, plan: StepPlan, config: DPSGDConfig, seed: Optional[int] = None,
          on_epoch: Optional[Callable[[int, float], None]] = None,
          on_step: Optional[Callable[[int], None]] = None,
          progress: Optional[Callable[[int], None]] = None) -> int:
    """DP-SGD: every step of `plan`, in order (see run_steps). Returns the steps that ran."""
    _check_on_stand_ins(model, loss, features, labels)
    return run_steps(make_dp_step(model, loss, features, labels, config, plan.normaliser,
                                  noise_generator(seed)), plan, on_epoch, on_step, progress)


def _check_on_stand_ins(model: tf.keras.Model, loss: tf.keras.losses.Loss,
                        features: tf.Tensor, labels: tf.Tensor) -> None:
    """Again here for models the preflight could not check (no declared inputs): after the
    charge, but before any step, on public stand-in batches of the inputs' and labels' specs
    (stand_in.py), so the outcome depends on no record."""
    from sage_tfx.components.dp_trainer import stand_in  # it builds on this module

    stand_in.check_model_on_specs(model, loss, example_spec(features),
                                  tf.TensorSpec(labels.shape[1:], labels.dtype))


class RepeatedTraining:
    """`train` run again and again on one model and one dataset (DPTuner's trials): each run
    starts from the weights the model had when given, with its own plan, settings and noise,
    and computes what `train` on a model built with those weights would, draw for draw. The
    model is checked and the step traced once, on the first run; later runs reset the weights
    and restart the step (DPStep.restart), so a run adds no trace, no Keras object (no layer
    or model name) and no count to the process: what the process keeps after several runs is
    what it keeps after one."""

    def __init__(self, model: tf.keras.Model, loss: tf.keras.losses.Loss,
                 features: tf.Tensor, labels: tf.Tensor):
        _check_on_stand_ins(model, loss, features, labels)
        self._model, self._loss, self._features, self._labels = model, loss, features, labels
        self._initial_weights = model.get_weights()
        self._step: Optional[DPStep] = None  # made on the first run

    def train(self, plan: StepPlan, config: DPSGDConfig, seed: Optional[int] = None) -> int:
        """One run of `train` from the initial weights. Returns the steps that ran."""
        generator = noise_generator(seed)
        if self._step is None:
            self._step = make_dp_step(self._model, self._loss, self._features, self._labels,
                                     config, plan.normaliser, generator)
        else:
            self._model.set_weights(self._initial_weights)
            self._step.restart(config, plan.normaliser, generator)
        return run_steps(self._step, plan)
