"""The DP-SGD step's compiled ops (step_kernels.cc): per-example clipping and the noise add,
compiled for this machine's TensorFlow and loaded as TensorFlow ops.

Why compiled: each graph op costs a few microseconds of TensorFlow's executor, a step of a small
model is a fraction of a millisecond, and per-example clipping in graph ops took dozens of them
(norms, clip scaling, masks) plus, for a convolution, the patches of every image: together most
of DP-SGD's overhead over non-private training (docs/measurements.md, issue 35).

The library is compiled once per machine, on first use, with the C++ compiler ($CXX, else g++)
and TensorFlow's own compile and link flags (tf.sysconfig), and cached beside this module
(__pycache__, as numba caches its kernels), else in the user's cache directory, else for the
process alone. The cache key is the source, the flags and TensorFlow's version, so an upgrade
recompiles. Compiling takes 6-10 s; the Docker image compiles it at build.

The ops have CPU kernels only: on a GPU machine TensorFlow places them on the CPU and copies
each step's activations and output gradients there and back (slower than the GPU's own graph
ops would be; the benchmark and the target are CPU). float32 and float64 (other dtypes are
computed in float32; the noise add takes float32, as the noise buffer holds). They hold no state and draw nothing: arithmetic on the step's tensors whose work depends on
shapes only, never on values (a dropped row is masked, not skipped). The privacy argument is
clipping.py's and dp_sgd.py's; the tests check each op against TensorFlow's own arithmetic.
TensorFlow cannot compile them with XLA.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

import tensorflow as tf

SOURCE = Path(__file__).with_name("step_kernels.cc")


def _vector_flags() -> list[str]:
    """AVX2 and FMA where this CPU has them; none elsewhere (the kernels' vector types then
    lower to what the CPU has). Part of the cache key, so a cache is never loaded on a CPU
    without the instructions it was compiled for."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy's private table moved: compile for any CPU
        return []
    return ["-mavx2", "-mfma"] if features.get("AVX2") and features.get("FMA3") else []


def _flags(vector_flags: Sequence[str]) -> list[str]:
    # No -march=native: TensorFlow's Eigen headers do not compile with AVX512-FP16 enabled.
    return ["-shared", "-fPIC", "-O3", *vector_flags, *tf.sysconfig.get_compile_flags(),
            *tf.sysconfig.get_link_flags()]


def _cache_directories() -> list[Path]:
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [SOURCE.parent / "__pycache__", user_cache / "sage-tfx"]


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def compiled_library(vector_flags: Optional[Sequence[str]] = None) -> Path:
    """The path of the library compiled for `vector_flags` (default: this CPU's), compiled
    first if no cache holds it (RuntimeError, naming the command, if that fails). The Docker
    image compiles it for both CPU classes, so a pod on either finds it."""
    flags = _flags(_vector_flags() if vector_flags is None else vector_flags)
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()
                         + tf.__version__.encode()).hexdigest()[:16]
    name = f"step_kernels-{key}.so"
    for directory in _cache_directories():
        if (directory / name).exists():
            return directory / name
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"DP-SGD's step kernels (step_kernels.cc) are compiled on first "
                           f"use with a C++17 compiler, and {compiler!r} was not found: install "
                           "g++ (Debian: apt-get install g++) or set CXX")
    directory = next((d for d in _cache_directories() if _writable(d)), None)
    directory = directory or Path(tempfile.mkdtemp(prefix="sage-tfx-kernels-"))
    # Compiled under a name of its own, then renamed: a concurrent compilation (another
    # process or thread) never loads a half-written library, and whichever rename lands last
    # leaves the same bytes.
    with tempfile.NamedTemporaryFile(dir=directory, prefix=name, suffix=".partial",
                                     delete=False) as partial:
        command = [compiler, str(SOURCE), "-o", partial.name, *flags]
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode != 0:
        os.unlink(partial.name)
        errors = [line for line in built.stderr.splitlines() if ": error:" in line][:5]
        raise RuntimeError(f"compiling DP-SGD's step kernels failed ({' '.join(command)}): "
                           + ("\n".join(errors) or built.stderr[-2000:]))
    os.replace(partial.name, directory / name)
    return directory / name


_loading = threading.Lock()


@functools.cache
def _loaded():
    return tf.load_op_library(str(compiled_library()))


def library():
    """The loaded op library (compiled first if no cache holds it)."""
    with _loading:  # one compilation and one load per process, whichever thread asks first
        return _loaded()


def _computed(values: tf.Tensor) -> tf.Tensor:
    return values if values.dtype in (tf.float32, tf.float64) else tf.cast(values, tf.float32)


def conv_per_example_gradients(layer, inputs: tf.Tensor, output_gradients: tf.Tensor,
                               per_example: bool = True):
    """(squared norms [B], kernel gradients [B, *kernel.shape], bias gradients [B, filters]) of
    a Conv2D call (channels last, "valid" or "same" padding, one group, static height and
    width), per example; with per_example false the kernel gradients are not kept (empty).
    Padding "same" is TensorFlow's: the total padding max((H' - 1) s + (k - 1) d + 1 - H, 0),
    the smaller half before."""
    pad_before = []
    for size, k, s, d, out in zip(inputs.shape[1:3], layer.kernel_size, layer.strides,
                                  layer.dilation_rate, output_gradients.shape[1:3]):
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0) if layer.padding == "same" else 0
        pad_before.append(total // 2)
    return library().conv_per_example_gradients(
        _computed(inputs), _computed(output_gradients), kernel_size=list(layer.kernel_size),
        strides=list(layer.strides), dilations=list(layer.dilation_rate), pad_before=pad_before,
        use_bias=layer.use_bias, per_example=per_example)


def dense_squared_norms(inputs: tf.Tensor, output_gradients: tf.Tensor,
                        use_bias: bool) -> tf.Tensor:
    """(|a_i|^2 + [bias]) |dz_i|^2 [B] for a Dense call with one position (a [B, P], dz
    [B, O])."""
    return library().dense_squared_norms(_computed(inputs), _computed(output_gradients),
                                         use_bias=use_bias)


def clipped_rows(values: Sequence[tf.Tensor], coefficients: tf.Tensor, kept: tf.Tensor,
                 scale: Sequence[bool]) -> list[tf.Tensor]:
    """Row i of each tensor, times coefficients[i] where its `scale` flag is set, where kept[i];
    exactly 0 where not, even where the row holds inf or NaN. A kept row keeps IEEE products
    (inf * 0 is NaN), so an overflow stays visible to the guard that drops rows
    (dp_sgd.kept_rows): zeroing where the coefficient is 0 would hide it."""
    computed = [_computed(v) for v in values]
    return library().clipped_rows(computed, tf.cast(coefficients, computed[0].dtype), kept,
                                  scale=list(scale))


def kept_weighted_sum(values: tf.Tensor, coefficients: tf.Tensor, kept: tf.Tensor) -> tf.Tensor:
    """sum_i coefficients[i] values[i] over the rows where kept[i]; a dropped row adds 0."""
    values = _computed(values)
    return library().kept_weighted_sum(values, tf.cast(coefficients, values.dtype), kept)



def add_noise(gradients: Sequence[tf.Tensor], draws: tf.Tensor, start: tf.Tensor):
    """(gradients[n] + draws[start + o_n : start + o_n + size_n] in its shape, for each n (o_n:
    the sizes of the gradients before it), the first position left unread); OutOfRangeError
    if the draws from `start` are too few."""
    return library().add_noise(gradients, draws, start)
