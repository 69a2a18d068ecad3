"""DP analyzers for a tensorflow_transform `preprocessing_fn`, run by the DPTransform component.

A user's preprocessing_fn calls these instead of TFT's analyzers (Sage Listing 1):

    from sage_tfx.components.dp_transform import analyzers as dp

    def preprocessing_fn(inputs):
        speed = dp.scale_with_bounds(inputs["speed"], 0.0, 100.0)           # no budget: public bounds
        hour_speed = dp.dp_group_by_mean(inputs["hour"], speed, num_keys=24,
                                         value_range=(0.0, 1.0), budget_share=0.8)
        trips = dp.dp_count(inputs["hour"], budget_share=0.2)
        return {"hour_speed": hour_speed, ...}

Each analyzer spends `budget_share` of the epsilon that the grant allots to the transform step;
DPTransform refuses a preprocessing_fn whose shares sum above 1, or that uses any analyzer not
defined here or in tft.py (tft's names, DP; an analyzer there without budget_share takes an
equal part of what the explicit shares leave: TransformPlan). TFT's own analyzers publish exact
statistics of the data in the TransformGraph.

Guarantees (add-or-remove-one neighbours, the ledger's relation; pure epsilon-DP, no delta).
The unit is the record: each analyzer takes exactly one value per record (a `[batch]` or
`[batch, 1]` tensor) and refuses anything wider when the preprocessing_fn is traced, because a
`FixedLenFeature([k])` would give one record k contributions while the noise is for one.

* Bad values. A value that is NaN or infinite is replaced by the midpoint of value_range BEFORE
  clamping (a data-independent default; `np.clip` keeps NaN, so without this one record could
  make the whole release NaN). Records reach the preprocessing_fn through the record rule
  (components/record_rule.py), so a missing or non-finite feature already holds its public
  default; this mapping covers non-finite values the preprocessing_fn itself computes (0 / 0).
* dp_count: the number of records, plus discrete Laplace noise at epsilon (one record changes
  the count by 1; mechanisms.discrete_laplace).
* dp_group_by_mean over public keys 0..K-1: each record's value is mapped as above, clamped to
  [lo, hi] and centred on the midpoint c = (lo + hi) / 2, and adds (1, v - c) to its key's
  (count, sum); a record whose key is outside 0..K-1 adds nothing. Adding or removing one record
  changes one key's count by 1 and its sum by at most (hi - lo) / 2, whatever the signs of lo and
  hi, and no other key (parallel composition across keys), so Laplace at eps/2 on the count
  vector (L1 sensitivity 1) and at eps/2 on the sum vector (L1 sensitivity (hi - lo) / 2) give
  eps (mechanisms.laplace_count_and_sum). Listing 1 writes the sum's scale as value_range·2/eps
  on unclipped values; centring halves it and holds for negative lower bounds too (an
  uncentred sum would need max(|lo|, |hi|), not hi). The released per-key mean is
  c + dp_sum / max(dp_count, 1) clamped to [lo, hi] (post-processing); keys must be public,
  which is why num_keys is a parameter and not read from the data.
* dp_mean: dp_group_by_mean with one key.
All noise is drawn once, after the whole dataset is aggregated, by sage_tfx.mechanisms (an
exact, floating-point-safe sampler seeded by the OS; it cannot be seeded).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import apache_beam as beam
import numpy as np
import tensorflow as tf
import tensorflow_transform as tft

from sage_tfx import mechanisms
from sage_tfx.components.dp_transform.calls import features_by_tensor


class DPTransformError(ValueError):
    """A preprocessing_fn DPTransform cannot run under its budget."""


@dataclass(frozen=True)
class Spend:
    """One DP analyzer call of a traced preprocessing_fn: `call` names it as the user wrote it
    ("scale_to_z_score(fare)"); `share` is its explicit budget_share (None: an equal part of
    what the explicit shares leave); `uses_delta`: it spends delta (partition selection);
    `planner(epsilon, delta)` runs its release on a public stand-in of its aggregate (no record
    is read) and returns the mechanisms.Release, whose event and additional_delta are then the
    ones the release on the data runs (the same code with the same public parameters)."""
    call: str
    share: Optional[float]
    uses_delta: bool = False
    planner: Optional[Callable[[float, float], mechanisms.Release]] = field(
        default=None, compare=False)


@dataclass(frozen=True)
class TransformPlan:
    """What a preprocessing_fn's DP analyzers spend of the transform step's (epsilon, delta),
    made from its trace alone (no data): each analyzer's resolved share, its (epsilon, delta)
    and its planned release.

    Budget split. Analyzers with an explicit budget_share take it; the others split what is
    left equally (`default_share`). The analyzers' epsilons then sum to at most the step's:
    each analyzer is epsilon_i-DP (delta_i) and, by basic composition, the step is
    (sum epsilon_i, sum delta_i)-DP. Only partition selection spends delta (`uses_delta`): the
    step's delta is split equally among those analyzers, as Release.additional_delta.
    `event` composes every analyzer's event (what an rdp ledger charges), `additional_delta`
    sums their deltas spent outside events (which an rdp ledger refuses)."""
    epsilon: float
    delta: float
    default_share: Optional[float]
    delta_each: float
    spends: tuple[Spend, ...]
    releases: tuple[mechanisms.Release, ...] = ()

    def share_of(self, spend: Spend) -> float:
        return self.default_share if spend.share is None else spend.share

    @property
    def shares(self) -> list[tuple[str, float]]:
        return [(spend.call, self.share_of(spend)) for spend in self.spends]

    @property
    def event(self):
        from dp_accounting import dp_event
        return dp_event.ComposedDpEvent([release.event for release in self.releases])

    @property
    def additional_delta(self) -> float:
        return sum(release.additional_delta for release in self.releases)

    def describe(self) -> str:
        """The split, as printed before the analysis runs (public: the module and the grant)."""
        if not self.spends:
            return "no DP analyzer"
        return "; ".join(
            f"{spend.call}: share {self.share_of(spend):.4g} (epsilon "
            f"{self.epsilon * self.share_of(spend):.4g}"
            + (f", delta {self.delta_each:.3g})" if spend.uses_delta else ")")
            for spend in self.spends)


@dataclass
class _TransformBudget:
    """The transform step's (epsilon, delta) while a preprocessing_fn is traced.

    TFT traces a preprocessing_fn more than once (analysis, then the saved transform graph), so
    spends are recorded per trace: every trace must spend the same. The first trace of an
    audit runs without a plan (`plan` None): it only records the calls, and the values it
    hands out are never run; `resolve` then fixes the split, and DPTransform runs the
    analysis under a budget holding that plan.
    """
    epsilon: float
    delta: float = 0.0
    plan: Optional[TransformPlan] = None
    traces: list = field(default_factory=list)
    # Per trace: the raw features by tensor (to name the user's calls) and the module's
    # CLAMP_BOUNDS (public bounds by raw feature, tft.py).
    features: dict = field(default_factory=dict)
    declared_bounds: dict = field(default_factory=dict)

    def spend(self, analyzer: str, share: Optional[float], uses_delta: bool = False,
              planner: Optional[Callable] = None) -> tuple[float, float]:
        """(epsilon, delta) of this analyzer call."""
        if share is not None:
            share = float(share)
            if not (math.isfinite(share) and 0 < share <= 1):
                raise DPTransformError(f"{analyzer}: budget_share must be in (0, 1], got "
                                       f"{share!r}")
        current = self.traces[-1]
        spend = Spend(analyzer, share, uses_delta, planner)
        current.append(spend)
        total = sum(s.share for s in current if s.share is not None)
        if total > 1 + 1e-9:
            raise DPTransformError(
                f"the preprocessing_fn's DP analyzers spend {total:g} of the transform budget "
                f"(shares {[s.share for s in current if s.share is not None]}); they must sum "
                "to at most 1")
        if self.plan is None:  # the audit's trace: what it hands out is never run
            return self.epsilon * (1.0 if share is None else share), self.delta
        return (self.epsilon * self.plan.share_of(spend),
                self.plan.delta_each if uses_delta else 0.0)

    def wrap(self, preprocessing_fn: Callable) -> Callable:
        declared = getattr(preprocessing_fn, "__globals__", {}).get("CLAMP_BOUNDS", {})

        def traced(inputs):
            self.traces.append([])
            self.features = features_by_tensor(inputs)
            self.declared_bounds = declared
            return preprocessing_fn(inputs)
        return traced

    def spends(self) -> list[Spend]:
        if not self.traces:
            return []
        if any(trace != self.traces[0] for trace in self.traces):
            raise DPTransformError("the preprocessing_fn spent different shares on different "
                                   "traces; its DP analyzers must not depend on tracing state")
        return list(self.traces[0])

    def spent_shares(self) -> list[tuple[str, float]]:
        spends = self.spends()
        if self.plan is None:
            return [(spend.call, spend.share) for spend in spends]
        return [(spend.call, self.plan.share_of(spend)) for spend in spends]

    def resolve(self) -> TransformPlan:
        """The plan of the traced calls (the class docstring of TransformPlan): the equal split,
        each analyzer's planned release, refusals of a split that leaves an analyzer nothing or
        of a delta-spending analyzer without delta."""
        spends = tuple(self.spends())
        explicit = sum(spend.share for spend in spends if spend.share is not None)
        implicit = [spend for spend in spends if spend.share is None]
        default_share = None
        if implicit:
            default_share = (1.0 - explicit) / len(implicit)
            if default_share <= 1e-12:
                raise DPTransformError(
                    f"the explicit budget_shares use the whole transform budget, leaving "
                    f"nothing for {', '.join(spend.call for spend in implicit)}")
        delta_users = [spend for spend in spends if spend.uses_delta]
        if delta_users and not self.delta > 0:
            raise DPTransformError(
                f"{', '.join(spend.call for spend in delta_users)} selects which values to "
                "publish (DP partition selection), which spends delta; the grant's transform "
                "step has delta 0: grant the pipeline a delta")
        delta_each = self.delta / len(delta_users) if delta_users else 0.0
        plan = TransformPlan(self.epsilon, self.delta, default_share, delta_each, spends)
        releases = tuple(
            spend.planner(self.epsilon * plan.share_of(spend),
                          delta_each if spend.uses_delta else 0.0)
            for spend in spends)
        return dataclasses.replace(plan, releases=releases)


_active: list[_TransformBudget] = []


@contextlib.contextmanager
def transform_budget(epsilon: float, delta: float = 0.0,
                     plan: Optional[TransformPlan] = None) -> Iterator[_TransformBudget]:
    """DPTransform's executor runs the preprocessing_fn inside this (with the plan its audit
    made, so that each analyzer gets its resolved share)."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise DPTransformError(f"the transform budget must be a positive epsilon, got {epsilon!r}")
    if not (math.isfinite(delta) and 0 <= delta < 1):
        raise DPTransformError(f"the transform delta must be in [0, 1), got {delta!r}")
    budget = _TransformBudget(epsilon, delta, plan)
    _active.append(budget)
    try:
        yield budget
    finally:
        _active.pop()


def active_budget(analyzer: str) -> _TransformBudget:
    if not _active:
        raise DPTransformError(f"{analyzer} runs only inside DPTransform, which holds the grant")
    return _active[-1]


class DPRelease(beam.PTransform):
    """A DP analyzer's PTransform: batches of one value per record -> the DP release. Its math
    is `release(aggregate)` on the summed aggregate, and `stand_in()` is the aggregate of no
    records (public): `planner` runs the release on it, so the plan's event is the one the
    release on the data runs."""

    def stand_in(self):
        raise NotImplementedError

    def release(self, aggregate) -> mechanisms.Release:
        raise NotImplementedError


def planner(make: Callable[[float, float], DPRelease]) -> Callable[[float, float],
                                                                   mechanisms.Release]:
    """Spend.planner of the analyzer `make(epsilon, delta)` builds."""
    def planned(epsilon: float, delta: float) -> mechanisms.Release:
        transform = make(epsilon, delta)
        return transform.release(transform.stand_in())
    return planned


def _spend(analyzer: str, share: float, make: Callable[[float, float], DPRelease]) -> float:
    return active_budget(analyzer).spend(analyzer, float(share), planner=planner(make))[0]


class _NoisyGroupSums(DPRelease):
    """Batches of (keys, values) -> one array [K] of DP means (or one DP count, if count_only)."""

    def __init__(self, num_keys: int, lower: float, upper: float, epsilon: float,
                 count_only: bool = False):
        super().__init__()
        self.num_keys, self.lower, self.upper = num_keys, lower, upper
        self.epsilon, self.count_only = epsilon, count_only

    @property
    def midpoint(self) -> float:
        return (self.lower + self.upper) / 2.0

    def _batch_sums(self, batch) -> np.ndarray:
        """[2, K]: per key, the number of records and the sum of their centred values."""
        keys, values = (np.ravel(column) for column in batch)
        inside = (keys >= 0) & (keys < self.num_keys)
        keys = keys[inside].astype(np.int64)
        values = values[inside].astype(np.float64)
        values = mechanisms.bounded(values, self.lower, self.upper) - self.midpoint
        return np.stack([np.bincount(keys, minlength=self.num_keys),
                         np.bincount(keys, weights=values, minlength=self.num_keys)])

    def stand_in(self):
        return np.zeros((2, self.num_keys))

    def release(self, sums) -> mechanisms.Release:
        """The DP output (means [K], or the count) from the summed [2, K] array, with its event."""
        counts, centred_sums = sums if np.ndim(sums) == 2 else np.zeros((2, self.num_keys))
        if self.count_only:
            count = mechanisms.discrete_laplace(np.int64(round(counts.sum())), l1_sensitivity=1,
                                                epsilon=self.epsilon)
            return mechanisms.Release(np.float32(count.value), count.event)
        noisy = mechanisms.laplace_count_and_sum(counts, centred_sums,
                                                 value_bound=(self.upper - self.lower) / 2.0,
                                                 epsilon=self.epsilon)
        dp_counts, dp_sums = noisy.value
        means = np.clip(self.midpoint + dp_sums / np.maximum(dp_counts, 1.0),
                        self.lower, self.upper)
        return mechanisms.Release(means.astype(np.float32), noisy.event)

    def expand(self, batches):
        return (batches
                | "SumPerKey" >> beam.Map(self._batch_sums)
                | "Total" >> beam.CombineGlobally(_ArraySum())
                | "AddNoise" >> beam.Map(lambda sums: self.release(sums).value))


class _ArraySum(beam.CombineFn):
    def create_accumulator(self):
        return 0

    def add_input(self, total, array):
        return total + array

    def merge_accumulators(self, totals):
        return sum(totals, 0)

    def extract_output(self, total):
        return total


def _check_range(analyzer: str, lower: float, upper: float,
                 what: str = "value_range") -> tuple[float, float]:
    lower, upper = float(lower), float(upper)
    if not (math.isfinite(lower) and math.isfinite(upper) and lower < upper):
        raise DPTransformError(f"{analyzer}: {what} must be finite with lower < upper, "
                               f"got ({lower}, {upper})")
    return lower, upper


def _per_record(analyzer: str, argument: str, tensor, dtype=None) -> tf.Tensor:
    """The [batch] tensor of one value per record; refuses wider inputs at trace time (one
    record's whole contribution is what the noise is calibrated for)."""
    shape = getattr(tensor, "shape", None)
    if (not isinstance(tensor, tf.Tensor) or shape.rank not in (1, 2)
            or (shape.rank == 2 and shape[1] != 1)):
        raise DPTransformError(
            f"{analyzer}: {argument} must hold one value per record (shape [batch] or [batch, 1]),"
            f" got {type(tensor).__name__} of shape {shape}; the noise is calibrated for one "
            "value per record, so reduce each record to one value (or declare a scalar feature)")
    return tf.reshape(tensor if dtype is None else tf.cast(tensor, dtype), [-1])


def dp_group_by_mean(key: tf.Tensor, value: tf.Tensor, num_keys: int,
                     value_range: tuple[float, float], budget_share: float,
                     name: Optional[str] = None) -> tf.Tensor:
    """Per record, the DP mean of `value` over the records sharing its integer `key`
    (0..num_keys-1; other keys get the range's midpoint). See the module docstring."""
    if not (isinstance(num_keys, int) and num_keys >= 1):
        raise DPTransformError(f"dp_group_by_mean: num_keys must be a positive int, got {num_keys!r}")
    lower, upper = _check_range("dp_group_by_mean", *value_range)
    keys = _per_record("dp_group_by_mean", "key", key, tf.int64)
    values = _per_record("dp_group_by_mean", "value", value, tf.float32)
    epsilon = _spend("dp_group_by_mean", float(budget_share),
                     lambda eps, _: _NoisyGroupSums(num_keys, lower, upper, eps))
    [means] = tft.experimental.ptransform_analyzer(
        inputs=[keys, values],
        ptransform=_NoisyGroupSums(num_keys, lower, upper, epsilon),
        output_dtypes=[tf.float32], output_shapes=[[num_keys]], name=name or "dp_group_by_mean")
    inside = (keys >= 0) & (keys < num_keys)
    per_record = tf.gather(means, tf.clip_by_value(keys, 0, num_keys - 1))
    return tf.where(inside, per_record, tf.constant((lower + upper) / 2, tf.float32))


def dp_mean(value: tf.Tensor, value_range: tuple[float, float], budget_share: float,
            name: Optional[str] = None) -> tf.Tensor:
    """A scalar: the DP mean of `value` clipped to value_range (one key of dp_group_by_mean)."""
    lower, upper = _check_range("dp_mean", *value_range)
    values = _per_record("dp_mean", "value", value, tf.float32)
    epsilon = _spend("dp_mean", float(budget_share),
                     lambda eps, _: _NoisyGroupSums(1, lower, upper, eps))
    return mean_release(values, lower, upper, epsilon, name or "dp_mean")


def mean_release(values: tf.Tensor, lower: float, upper: float, epsilon: float,
                 name: str) -> tf.Tensor:
    """The scalar DP mean of the [batch] `values` (one key of _NoisyGroupSums) at epsilon."""
    [means] = tft.experimental.ptransform_analyzer(
        inputs=[tf.zeros_like(values, tf.int64), values],
        ptransform=_NoisyGroupSums(1, lower, upper, epsilon),
        output_dtypes=[tf.float32], output_shapes=[[1]], name=name)
    return means[0]


def dp_count(value: tf.Tensor, budget_share: float, name: Optional[str] = None) -> tf.Tensor:
    """A scalar: the DP number of records (one per row of `value`)."""
    epsilon = _spend("dp_count", float(budget_share),
                     lambda eps, _: _NoisyGroupSums(1, 0.0, 1.0, eps, count_only=True))
    return count_release(value, epsilon, name or "dp_count")


def count_release(value: tf.Tensor, epsilon: float, name: str) -> tf.Tensor:
    """The scalar DP number of rows of `value` (float32) at epsilon."""
    rows = tf.zeros([tf.shape(value)[0]], tf.int64)
    [count] = tft.experimental.ptransform_analyzer(
        inputs=[rows, tf.zeros([tf.shape(value)[0]], tf.float32)],
        ptransform=_NoisyGroupSums(1, 0.0, 1.0, epsilon, count_only=True),
        output_dtypes=[tf.float32], output_shapes=[[]], name=name)
    return count


def scale_with_bounds(value: tf.Tensor, lower: float, upper: float) -> tf.Tensor:
    """(clip(value, lower, upper) - lower) / (upper - lower): scaling to [0, 1] with public
    bounds, so no statistic of the data is computed or spent."""
    lower, upper = _check_range("scale_with_bounds", lower, upper)
    clipped = tf.clip_by_value(tf.cast(value, tf.float32), lower, upper)
    return (clipped - lower) / (upper - lower)


def is_dp_analyzer(operation_def) -> bool:
    """True for the analyzer nodes this module creates (the executor refuses any other)."""
    from tensorflow_transform import analyzer_nodes
    return (isinstance(operation_def, analyzer_nodes.PTransform)
            and isinstance(operation_def.ptransform, DPRelease))
