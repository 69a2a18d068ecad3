"""tensorflow_transform's analyzers, differentially private: a module converts by its import.

    from sage_tfx.components.dp_transform import tft      # was: import tensorflow_transform as tft

    CLAMP_BOUNDS = {"fare": (0.0, 200.0), "trip_miles": (0.0, 50.0)}   # public, per raw feature

    def preprocessing_fn(inputs):
        return {"fare_z": tft.scale_to_z_score(inputs["fare"]),
                "company": tft.compute_and_apply_vocabulary(inputs["company"], top_k=100,
                                                            num_oov_buckets=1),
                "miles_bucket": tft.bucketize(inputs["trip_miles"], 10)}

The functions below have tft's names and arguments; what they compute from the data is a DP
release inside DPTransform's grant. Anything else (`tft.apply_buckets`, `tft.apply_vocabulary`,
`tft.TFTransformOutput`, ...) is tensorflow_transform's own, passed through: a non-analyzer
publishes nothing, and should one call a TFT analyzer, DPTransform's audit refuses it by the
user's call before any charge (executor.audit).

Budget. Each call is one analyzer and spends a share of the transform step: `budget_share=`
when given, else an equal part of what the explicit shares leave (analyzers.TransformPlan;
DPTransform prints the split). Vocabularies also spend the step's delta (equal parts).

Bounds. A statistic of unbounded values has unbounded sensitivity, so each analyzer below but
`size` and the vocabularies needs public clamping bounds [L, U]: `clamp=(L, U)` on the call, or
`CLAMP_BOUNDS = {feature: (L, U)}` in the module for a raw feature read as it is (through
casts and reshapes only; calls.same_values_as_feature). Missing bounds are refused when the
preprocessing_fn is traced, before the charge, naming the call: "scale_to_z_score(fare) needs
clamp bounds". Values are clamped into [L, U] (a NaN or infinity counts as the midpoint,
mechanisms.bounded) before they are aggregated; the transform itself applies the released
constants to each record's own value.

Unit: the record, add-or-remove-one (the ledger's relation). Each analyzer reads one value per
record (a [batch] or [batch, 1] tensor; wider inputs are refused at trace time), so one record
changes each aggregate below by the stated sensitivity. Derivations (h = (U - L) / 2, the
half-width; mid = (L + U) / 2; d = clamp(x) - mid in [-h, h]):

* size: the number of records + discrete Laplace at epsilon (sensitivity 1; analyzers.dp_count).
* mean: analyzers.dp_mean: noisy count (sensitivity 1) and centred sum of d (sensitivity h),
  Laplace at epsilon / 2 each; mean = mid + S / max(N, 1), clamped to [L, U].
* var, scale_to_z_score (_NoisyMoments): per record (1, d, d^2 - h^2 / 2). The third term lies
  in [-h^2 / 2, h^2 / 2] (centring it halves the sensitivity of d^2 in [0, h^2]): one record
  moves the three sums by 1, h and h^2 / 2. Laplace at epsilon / 3 on each (count and sum by
  mechanisms.laplace_count_and_sum at 2 epsilon / 3, squares by mechanisms.laplace at epsilon / 3):
  epsilon-DP by basic composition. Post-processing: N' = max(N, 1), mean_d = S / N',
  var = Q / N' + h^2 / 2 - mean_d^2 (the population variance, as tft's), clamped to [0, h^2];
  mean = mid + mean_d clamped to [L, U]. z = (x - mean) / sqrt(var) (x - mean where var = 0,
  as tft).
* min, max, scale_to_0_1, scale_by_min_max (_NoisyExtremes): a histogram of B = 1024 equal
  buckets over [L, U]; one record is in one bucket (L1 sensitivity 1): Laplace(1 / epsilon)
  per bucket. Post-processing: the buckets whose noisy count exceeds
  t = ln(B / (2 beta)) / epsilon, beta = 1e-3 (an empty bucket passes with probability
  e^(-t epsilon) / 2 = beta / B, so none does with probability >= 1 - beta, as DP SQL's bounds,
  dp_statistics.aggregation.aggregators.bounds_from_histogram), min = the lower edge of the
  first, max = the upper edge of the last; none: (L, U). Stated accuracy: with probability
  >= 1 - 2 beta, min lies in [exact min - w, the lower edge of the first bucket holding at least
  2 t records] (w = (U - L) / B; 2 t records pass when their noise is above -t, probability
  >= 1 - beta over all buckets), max symmetrically. scale_to_0_1 / scale_by_min_max clamp x to
  [min, max] and map it affinely (the midpoint of the output range when min = max).
* quantiles, bucketize (_NoisyQuantileTree): DP SQL's quantile tree
  (dp_statistics/aggregation/aggregators.py): counts over QUANTILE_LEVELS levels of
  QUANTILE_BRANCHING-way buckets of [L, U]; one record adds 1 at each level: L1 sensitivity
  QUANTILE_LEVELS; Laplace at epsilon on every node; the boundaries are descents of the noisy
  tree at q = i / num_buckets (aggregators.quantile_from_tree), sorted (post-processing). tft's
  own `epsilon` argument (its sketch's approximation error) is accepted and unused: the tree's
  resolution is (U - L) / QUANTILE_BRANCHING^QUANTILE_LEVELS.
* vocabulary, compute_and_apply_vocabulary (_NoisyVocabulary): each record holds one value, a
  partition; per distinct value the number of records (a record is in one partition: C = 1).
  mechanisms.laplace_threshold keeps a value when its count + discrete Laplace(1 / epsilon)
  reaches tau: epsilon-DP for the counts of the values present in both neighbours, and a value
  only the added record holds is kept with probability <= delta (its additional_delta; the
  composition argument is in mechanisms/selection.py). frequency_threshold and top_k read the
  noisy counts of the kept values (post-processing: value order by noisy count, ties by value).
  The vocabulary file is written in tft's text format; compute_and_apply_vocabulary applies it
  with tft.apply_vocabulary. The empty value and a value containing a line break cannot be a
  line of that file and are dropped before the selection, as tft drops them (a rule on the
  value alone).
"""
from __future__ import annotations

import builtins
import math
import os
from typing import Optional

import apache_beam as beam
import numpy as np
import tensorflow as tf
import tensorflow_transform as _tft
from tensorflow_transform.beam.experimental import analyzer_impls as _experimental

from sage_tfx import mechanisms
from sage_tfx.components.dp_transform.analyzers import (DPRelease, DPTransformError, _ArraySum,
                                                        _NoisyGroupSums, _check_range,
                                                        _per_record, active_budget,
                                                        count_release, mean_release, planner)
from sage_tfx.components.dp_transform.calls import feature_name, same_values_as_feature
from sage_tfx.dp_statistics.aggregation.aggregators import (QUANTILE_TREE_NODES,
                                                            quantile_from_tree, tree_nodes)
from sage_tfx.dp_statistics.aggregation.spec import QUANTILE_LEVELS

# The DP versions defined here; every other name is tensorflow_transform's (__getattr__).
DP_ANALYZERS = ("size", "mean", "var", "min", "max", "scale_to_z_score", "scale_to_0_1",
                "scale_by_min_max", "quantiles", "bucketize", "vocabulary",
                "compute_and_apply_vocabulary")
MIN_MAX_BUCKETS = 1024
# An empty bucket of the min/max histogram passes its threshold with probability beta / B.
EMPTY_BUCKETS_PASS = 1e-3


def __getattr__(name: str):
    return getattr(_tft, name)


# --- the releases (numpy on the summed aggregate; noise from sage_tfx.mechanisms only) ----

class _NoisyMoments(DPRelease):
    """Batches of values -> [DP mean, DP population variance] (module docstring)."""

    def __init__(self, lower: float, upper: float, epsilon: float):
        super().__init__()
        self.lower, self.upper, self.epsilon = lower, upper, epsilon
        self.mid, self.half = (lower + upper) / 2.0, (upper - lower) / 2.0

    def _batch_sums(self, batch) -> np.ndarray:
        centred = mechanisms.bounded(np.ravel(batch[0]), self.lower, self.upper) - self.mid
        return np.array([centred.size, centred.sum(),
                         (centred ** 2 - self.half ** 2 / 2.0).sum()])

    def stand_in(self):
        return np.zeros(3)

    def release(self, sums) -> mechanisms.Release:
        count, centred_sum, centred_squares = np.broadcast_to(sums, (3,))
        noisy = mechanisms.laplace_count_and_sum(np.array([count]), np.array([centred_sum]),
                                                 value_bound=self.half,
                                                 epsilon=2.0 * self.epsilon / 3.0)
        squares = mechanisms.laplace(np.array([centred_squares]),
                                     l1_sensitivity=self.half ** 2 / 2.0,
                                     epsilon=self.epsilon / 3.0)
        rows = builtins.max(float(noisy.value[0][0]), 1.0)
        mean_d = float(noisy.value[1][0]) / rows
        variance = float(np.clip(squares.value[0] / rows + self.half ** 2 / 2.0 - mean_d ** 2,
                                 0.0, self.half ** 2))
        mean = float(np.clip(self.mid + mean_d, self.lower, self.upper))
        from dp_accounting import dp_event
        return mechanisms.Release(np.array([mean, variance], np.float32),
                                  dp_event.ComposedDpEvent([noisy.event, squares.event]))

    def expand(self, batches):
        return (batches | "Moments" >> beam.Map(self._batch_sums)
                | "Total" >> beam.CombineGlobally(_ArraySum())
                | "AddNoise" >> beam.Map(lambda sums: self.release(sums).value))


class _NoisyExtremes(DPRelease):
    """Batches of values -> [DP min, DP max] from a thresholded histogram (module docstring)."""

    def __init__(self, lower: float, upper: float, epsilon: float):
        super().__init__()
        self.lower, self.upper, self.epsilon = lower, upper, epsilon
        self.width = (upper - lower) / MIN_MAX_BUCKETS

    @property
    def threshold(self) -> float:
        return math.log(MIN_MAX_BUCKETS / (2.0 * EMPTY_BUCKETS_PASS)) / self.epsilon

    def _batch_counts(self, batch) -> np.ndarray:
        values = mechanisms.bounded(np.ravel(batch[0]), self.lower, self.upper)
        buckets = np.clip(np.floor((values - self.lower) / self.width), 0,
                          MIN_MAX_BUCKETS - 1).astype(np.int64)
        return np.bincount(buckets, minlength=MIN_MAX_BUCKETS).astype(np.float64)

    def stand_in(self):
        return np.zeros(MIN_MAX_BUCKETS)

    def release(self, counts) -> mechanisms.Release:
        counts = np.array(np.broadcast_to(np.asarray(counts, np.float64), (MIN_MAX_BUCKETS,)))
        noisy = mechanisms.laplace(counts, l1_sensitivity=1.0, epsilon=self.epsilon)
        passing = np.flatnonzero(noisy.value > self.threshold)
        if passing.size == 0:  # too few records to tell: the public bounds
            extremes = [self.lower, self.upper]
        else:
            extremes = [self.lower + passing[0] * self.width,
                        builtins.min(self.lower + (passing[-1] + 1) * self.width,
                                     self.upper)]
        return mechanisms.Release(np.array(extremes, np.float32), noisy.event)

    def expand(self, batches):
        return (batches | "Histogram" >> beam.Map(self._batch_counts)
                | "Total" >> beam.CombineGlobally(_ArraySum())
                | "AddNoise" >> beam.Map(lambda counts: self.release(counts).value))


class _NoisyQuantileTree(DPRelease):
    """Batches of values -> num_buckets - 1 DP quantile boundaries (module docstring)."""

    def __init__(self, lower: float, upper: float, epsilon: float, num_buckets: int):
        super().__init__()
        self.lower, self.upper, self.epsilon = lower, upper, epsilon
        self.fractions = np.arange(1, num_buckets) / num_buckets

    def _batch_counts(self, batch) -> np.ndarray:
        values = mechanisms.bounded(np.ravel(batch[0]), self.lower, self.upper)
        return np.bincount(tree_nodes(values, self.lower, self.upper).ravel(),
                           minlength=QUANTILE_TREE_NODES).astype(np.float64)

    def stand_in(self):
        return np.zeros(QUANTILE_TREE_NODES)

    def release(self, counts) -> mechanisms.Release:
        counts = np.array(np.broadcast_to(np.asarray(counts, np.float64),
                                           (QUANTILE_TREE_NODES,)))
        noisy = mechanisms.laplace(counts, l1_sensitivity=float(QUANTILE_LEVELS),
                                   epsilon=self.epsilon)
        tree = noisy.value[None, :]
        boundaries = np.sort([quantile_from_tree(tree, q, self.lower, self.upper)[0]
                              for q in self.fractions])
        return mechanisms.Release(boundaries.astype(np.float32)[None, :], noisy.event)

    def expand(self, batches):
        return (batches | "TreeCounts" >> beam.Map(self._batch_counts)
                | "Total" >> beam.CombineGlobally(_ArraySum())
                | "AddNoise" >> beam.Map(lambda counts: self.release(counts).value))


class _NoisyVocabulary(DPRelease, _experimental.PTransformAnalyzer):
    """Batches of values -> the path of a DP vocabulary file (module docstring). TFT sets
    base_temp_dir (PTransformAnalyzer), where the file is written."""

    def __init__(self, epsilon: float, delta: float, top_k: Optional[int],
                 frequency_threshold: Optional[float], filename: str,
                 dtype: tf.dtypes.DType = tf.string):
        DPRelease.__init__(self)
        _experimental.PTransformAnalyzer.__init__(self)
        self.epsilon, self.delta, self.dtype = epsilon, delta, dtype
        self.top_k, self.frequency_threshold, self.filename = top_k, frequency_threshold, filename

    def stand_in(self):
        return []

    def release(self, value_counts) -> mechanisms.Release:
        """The kept values in vocabulary order, from [(value bytes, count)]."""
        # tft's filter (its _EMPTY_STRING_OR_NEWLINE_CHARS_REGEX): the empty value and values
        # holding a line break are no line of the text file (an empty line fails the table
        # that reads it). A rule on the value alone, applied before the selection.
        value_counts = [(value, count) for value, count in value_counts
                        if value and b"\n" not in value and b"\r" not in value]
        values = [value for value, _ in value_counts]
        counts = np.array([count for _, count in value_counts], dtype=np.int64)
        selected = mechanisms.laplace_threshold(counts, max_partitions_per_unit=1,
                                                epsilon=self.epsilon, delta=self.delta)
        kept = [(float(noisy), value) for value, noisy in
                zip((v for v, keep in zip(values, selected.value.keep) if keep),
                    selected.value.noisy_unit_counts)]
        if self.frequency_threshold is not None:
            kept = [(noisy, value) for noisy, value in kept if noisy >= self.frequency_threshold]
        kept.sort(key=lambda pair: (-pair[0], pair[1]))
        if self.top_k is not None:
            kept = kept[:self.top_k]
        return mechanisms.Release([value for _, value in kept], selected.event,
                                  additional_delta=selected.additional_delta)

    def _write(self, value_counts) -> np.ndarray:
        vocabulary = self.release(value_counts).value
        if not vocabulary:  # TFT's tables cannot be built from an empty file: tft's filler
            vocabulary = [_tft.analyzers.get_empy_vocabulary_dummy_value(self.dtype)[1]]
        tf.io.gfile.makedirs(self.base_temp_dir)
        path = os.path.join(self.base_temp_dir, self.filename)
        with tf.io.gfile.GFile(path, "wb") as handle:
            handle.write(b"".join(value + b"\n" for value in vocabulary))
        return np.array(path.encode())

    def expand(self, batches):
        return (batches
                | "Values" >> beam.FlatMap(lambda batch: [_as_bytes(v)
                                                          for v in np.ravel(batch[0])])
                | "CountPerValue" >> beam.combiners.Count.PerElement()
                | "All" >> beam.combiners.ToList()
                | "Select" >> beam.Map(self._write))


def _as_bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


# --- the user's calls -------------------------------------------------------------------

def _call(function: str, x) -> str:
    return f"{function}({feature_name(x, active_budget(function).features)})"


def _refuse_options(call: str, **options) -> None:
    """tft arguments without a DP version here, given a non-default value: refused by name."""
    given = sorted(name for name, value in options.items() if value not in (None, False))
    if given:
        raise DPTransformError(f"{call}: {', '.join(given)} is not supported by DPTransform's "
                               "DP analyzers")


def _per_record_reduced(call: str, x, reduce_instance_dims: bool) -> tf.Tensor:
    if not reduce_instance_dims:
        _refuse_options(call, **{"reduce_instance_dims=False (elementwise statistics)": True})
    return _per_record(call, "x", x, tf.float32)


def _bounds(call: str, x, clamp) -> tuple[float, float]:
    """Public clamping bounds: the call's `clamp`, else the module's CLAMP_BOUNDS for the raw
    feature `x` holds; refused (at trace time, before any charge) if neither is given."""
    budget = active_budget(call)
    if clamp is not None:
        return _check_range(call, *clamp, what="clamp")
    feature = same_values_as_feature(x, budget.features)
    if feature is not None and feature in budget.declared_bounds:
        return _check_range(call, *budget.declared_bounds[feature], what="CLAMP_BOUNDS")
    key = feature or "<feature>"
    raise DPTransformError(
        f"{call} needs clamp bounds: pass clamp=(lower, upper) to the call, or declare "
        f"CLAMP_BOUNDS = {{{key!r}: (lower, upper)}} in the module (for a raw feature read as it "
        "is). The bounds must be public, chosen without looking at the data: each value is "
        "clamped into them before the DP statistic, whose noise they scale")


def _spend(call: str, budget_share, make, uses_delta: bool = False) -> tuple[float, float]:
    return active_budget(call).spend(call, budget_share, uses_delta, planner(make))


def _analyze(transform: DPRelease, values: tf.Tensor, dtype, shape, name: str):
    [result] = _tft.experimental.ptransform_analyzer(
        inputs=[values], ptransform=transform, output_dtypes=[dtype], output_shapes=[shape],
        name=name)
    return result


def size(x, reduce_instance_dims: bool = True, name: Optional[str] = None, *,
         budget_share: Optional[float] = None) -> tf.Tensor:
    """The DP number of records (tft.size counts values; one per record here)."""
    call = _call("size", x)
    values = _per_record_reduced(call, x, reduce_instance_dims)
    epsilon, _ = _spend(call, budget_share,
                        lambda eps, _: _NoisyGroupSums(1, 0.0, 1.0, eps, count_only=True))
    with tf.compat.v1.name_scope(name, "size"):
        return tf.cast(count_release(values, epsilon, "dp_size"), tf.int64)


def mean(x, reduce_instance_dims: bool = True, name: Optional[str] = None,
         output_dtype=None, *, clamp=None, budget_share: Optional[float] = None) -> tf.Tensor:
    """The DP mean of x clamped to its bounds."""
    call = _call("mean", x)
    lower, upper = _bounds(call, x, clamp)
    values = _per_record_reduced(call, x, reduce_instance_dims)
    epsilon, _ = _spend(call, budget_share, lambda eps, _: _NoisyGroupSums(1, lower, upper, eps))
    with tf.compat.v1.name_scope(name, "mean"):
        return tf.cast(mean_release(values, lower, upper, epsilon, "dp_mean"),
                       output_dtype or tf.float32)


def _moments(function: str, x, clamp, budget_share, reduce_instance_dims=True) -> tf.Tensor:
    """[DP mean, DP variance] of x (one analyzer)."""
    call = _call(function, x)
    lower, upper = _bounds(call, x, clamp)
    values = _per_record_reduced(call, x, reduce_instance_dims)
    epsilon, _ = _spend(call, budget_share, lambda eps, _: _NoisyMoments(lower, upper, eps))
    return _analyze(_NoisyMoments(lower, upper, epsilon), values, tf.float32, [2], "dp_moments")


def var(x, reduce_instance_dims: bool = True, name: Optional[str] = None, output_dtype=None,
        *, clamp=None, budget_share: Optional[float] = None) -> tf.Tensor:
    """The DP population variance of x clamped to its bounds."""
    with tf.compat.v1.name_scope(name, "var"):
        return tf.cast(_moments("var", x, clamp, budget_share, reduce_instance_dims)[1],
                       output_dtype or tf.float32)


def scale_to_z_score(x, elementwise: bool = False, name: Optional[str] = None,
                     output_dtype=None, *, clamp=None,
                     budget_share: Optional[float] = None) -> tf.Tensor:
    """(x - mean) / std with the DP mean and variance of one release (x - mean if std = 0)."""
    with tf.compat.v1.name_scope(name, "scale_to_z_score"):
        moments = _moments("scale_to_z_score", x, clamp, budget_share, not elementwise)
        centred = tf.cast(x, tf.float32) - moments[0]
        std = tf.sqrt(moments[1])
        scaled = tf.where(std > 0, centred / tf.where(std > 0, std, 1.0), centred)
        return tf.cast(scaled, output_dtype or tf.float32)


def _extremes(function: str, x, clamp, budget_share, reduce_instance_dims=True) -> tf.Tensor:
    """[DP min, DP max] of x (one analyzer)."""
    call = _call(function, x)
    lower, upper = _bounds(call, x, clamp)
    values = _per_record_reduced(call, x, reduce_instance_dims)
    epsilon, _ = _spend(call, budget_share, lambda eps, _: _NoisyExtremes(lower, upper, eps))
    return _analyze(_NoisyExtremes(lower, upper, epsilon), values, tf.float32, [2],
                    "dp_extremes")


def min(x, reduce_instance_dims: bool = True, name: Optional[str] = None, *,  # noqa: A001
        clamp=None, budget_share: Optional[float] = None) -> tf.Tensor:
    """The DP minimum of x clamped to its bounds (module docstring: its stated accuracy)."""
    with tf.compat.v1.name_scope(name, "min"):
        return tf.cast(_extremes("min", x, clamp, budget_share, reduce_instance_dims)[0],
                       x.dtype)


def max(x, reduce_instance_dims: bool = True, name: Optional[str] = None, *,  # noqa: A001
        clamp=None, budget_share: Optional[float] = None) -> tf.Tensor:
    """The DP maximum of x clamped to its bounds."""
    with tf.compat.v1.name_scope(name, "max"):
        return tf.cast(_extremes("max", x, clamp, budget_share, reduce_instance_dims)[1],
                       x.dtype)


def scale_by_min_max(x, output_min: float = 0.0, output_max: float = 1.0,
                     elementwise: bool = False, name: Optional[str] = None, *, clamp=None,
                     budget_share: Optional[float] = None) -> tf.Tensor:
    """x clamped to [DP min, DP max], mapped affinely onto [output_min, output_max]."""
    if output_min >= output_max:
        raise DPTransformError(f"scale_by_min_max: output_min {output_min} must be below "
                               f"output_max {output_max}")
    with tf.compat.v1.name_scope(name, "scale_by_min_max"):
        extremes = _extremes("scale_by_min_max", x, clamp, budget_share, not elementwise)
        return _min_max_scaled(x, extremes, output_min, output_max)


def scale_to_0_1(x, elementwise: bool = False, name: Optional[str] = None, *, clamp=None,
                 budget_share: Optional[float] = None) -> tf.Tensor:
    """x clamped to [DP min, DP max], mapped affinely onto [0, 1]."""
    with tf.compat.v1.name_scope(name, "scale_to_0_1"):
        extremes = _extremes("scale_to_0_1", x, clamp, budget_share, not elementwise)
        return _min_max_scaled(x, extremes, 0.0, 1.0)


def _min_max_scaled(x, extremes, output_min: float, output_max: float) -> tf.Tensor:
    low, high = extremes[0], extremes[1]
    span = high - low
    fraction = tf.where(span > 0, (tf.clip_by_value(tf.cast(x, tf.float32), low, high) - low)
                        / tf.where(span > 0, span, 1.0), 0.5)
    return output_min + fraction * (output_max - output_min)


def quantiles(x, num_buckets: int, epsilon: Optional[float] = None, weights=None,
              reduce_instance_dims: bool = True, name: Optional[str] = None, *, clamp=None,
              budget_share: Optional[float] = None) -> tf.Tensor:
    """[1, num_buckets - 1] DP quantile boundaries of x clamped to its bounds (tft's shape)."""
    call = _call("quantiles", x)
    return _quantiles(call, x, num_buckets, weights, reduce_instance_dims, name, clamp,
                      budget_share)


def _quantiles(call, x, num_buckets, weights, reduce_instance_dims, name, clamp, budget_share):
    _refuse_options(call, weights=weights is not None)
    if not (isinstance(num_buckets, int) and num_buckets >= 2):
        raise DPTransformError(f"{call}: num_buckets must be an int >= 2, got {num_buckets!r}")
    lower, upper = _bounds(call, x, clamp)
    values = _per_record_reduced(call, x, reduce_instance_dims)
    epsilon, _ = _spend(call, budget_share,
                        lambda eps, _: _NoisyQuantileTree(lower, upper, eps, num_buckets))
    with tf.compat.v1.name_scope(name, "quantiles"):
        return _analyze(_NoisyQuantileTree(lower, upper, epsilon, num_buckets), values,
                        tf.float32, [1, num_buckets - 1], "dp_quantiles")


def bucketize(x, num_buckets: int, epsilon: Optional[float] = None, weights=None,
              elementwise: bool = False, name: Optional[str] = None, *, clamp=None,
              budget_share: Optional[float] = None) -> tf.Tensor:
    """tft.apply_buckets of x on its DP quantile boundaries (bucket ids 0..num_buckets-1)."""
    call = _call("bucketize", x)
    with tf.compat.v1.name_scope(name, "bucketize"):
        boundaries = _quantiles(call, x, num_buckets, weights, not elementwise, None, clamp,
                                budget_share)
        return apply_buckets(x, boundaries)


def apply_buckets(x, bucket_boundaries, name: Optional[str] = None) -> tf.Tensor:
    """tft.apply_buckets (a mapper, no analyzer): x's bucket, the number of boundaries <= x
    (tft's Side.RIGHT), as int64. The same values as tft's, computed per record: tft's
    tf.searchsorted reshapes the batch onto axis 1, which row_audit.py cannot prove keeps the
    records apart, so the comparison here is x[:, None] >= boundaries, summed along axis 1."""
    with tf.compat.v1.name_scope(name, "apply_buckets"):
        boundaries = tf.reshape(tf.convert_to_tensor(bucket_boundaries), [1, -1])
        values = tf.cast(x, boundaries.dtype) if boundaries.dtype.is_floating else x
        buckets = tf.reduce_sum(tf.cast(tf.expand_dims(values, -1) >= boundaries, tf.int64),
                                axis=-1)
        _tft.schema_inference.set_tensor_schema_override(
            buckets, tf.constant(0, tf.int64), tf.shape(boundaries, out_type=tf.int64)[1])
        return buckets


def vocabulary(x, top_k: Optional[int] = None, frequency_threshold: Optional[float] = None,
               vocab_filename: Optional[str] = None, store_frequency: bool = False,
               reserved_tokens=None, weights=None, labels=None, use_adjusted_mutual_info=False,
               min_diff_from_avg=None, coverage_top_k=None, coverage_frequency_threshold=None,
               key_fn=None, fingerprint_shuffle=False, file_format="text",
               name: Optional[str] = None, *, budget_share: Optional[float] = None):
    """The path of a DP vocabulary file (values kept by DP partition selection; tft's text
    format, most frequent first by noisy count); pass it to tft.apply_vocabulary."""
    call = _call("vocabulary", x)
    return _vocabulary(call, x, top_k, frequency_threshold, vocab_filename, name, budget_share,
                       store_frequency=store_frequency, reserved_tokens=reserved_tokens,
                       weights=weights, labels=labels,
                       use_adjusted_mutual_info=use_adjusted_mutual_info,
                       min_diff_from_avg=min_diff_from_avg, coverage_top_k=coverage_top_k,
                       coverage_frequency_threshold=coverage_frequency_threshold,
                       key_fn=key_fn, fingerprint_shuffle=fingerprint_shuffle,
                       file_format=None if file_format == "text" else file_format)


def _vocabulary(call, x, top_k, frequency_threshold, vocab_filename, name, budget_share,
                **unsupported):
    _refuse_options(call, **{key: value is not None and value is not False
                             for key, value in unsupported.items()})
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
        raise DPTransformError(f"{call}: top_k must be a positive int, got {top_k!r}")
    if x.dtype != tf.string and not x.dtype.is_integer:
        raise DPTransformError(f"{call}: a vocabulary of {x.dtype.name} values; give strings "
                               "or integers")
    values = _per_record(call, "x", x)
    epsilon, delta = _spend(call, budget_share, lambda eps, dlt: _NoisyVocabulary(
        eps, dlt, top_k, frequency_threshold, "dp_vocabulary"), uses_delta=True)
    with tf.compat.v1.name_scope(name, "vocabulary"):
        filename = _tft.analyzers.sanitized_vocab_filename(
            vocab_filename, prefix=None if vocab_filename else "vocab_")
        transform = _NoisyVocabulary(epsilon, delta, top_k, frequency_threshold, filename,
                                     tf.string if x.dtype == tf.string else tf.int64)
        [path] = _tft.experimental.ptransform_analyzer(
            inputs=[values], ptransform=transform, output_dtypes=[tf.string],
            output_shapes=[[]], output_asset_default_values=[b""], name="dp_vocabulary")
        return path


def compute_and_apply_vocabulary(x, default_value=-1, top_k: Optional[int] = None,
                                 frequency_threshold: Optional[float] = None,
                                 num_oov_buckets: int = 0, vocab_filename: Optional[str] = None,
                                 weights=None, labels=None, use_adjusted_mutual_info=False,
                                 min_diff_from_avg=0.0, coverage_top_k=None,
                                 coverage_frequency_threshold=None, key_fn=None,
                                 fingerprint_shuffle=False, file_format="text",
                                 store_frequency=False, reserved_tokens=None,
                                 name: Optional[str] = None, *,
                                 budget_share: Optional[float] = None) -> tf.Tensor:
    """x's index in its DP vocabulary (default_value, or an OOV bucket, for the others)."""
    call = _call("compute_and_apply_vocabulary", x)
    with tf.compat.v1.name_scope(name, "compute_and_apply_vocabulary"):
        path = _vocabulary(call, x, top_k, frequency_threshold, vocab_filename, None,
                           budget_share, weights=weights, labels=labels,
                           use_adjusted_mutual_info=use_adjusted_mutual_info,
                           min_diff_from_avg=min_diff_from_avg or None,
                           coverage_top_k=coverage_top_k,
                           coverage_frequency_threshold=coverage_frequency_threshold,
                           key_fn=key_fn, fingerprint_shuffle=fingerprint_shuffle,
                           file_format=None if file_format == "text" else file_format,
                           store_frequency=store_frequency, reserved_tokens=reserved_tokens)
        return _tft.apply_vocabulary(x, path, default_value=default_value,
                                     num_oov_buckets=num_oov_buckets)
