"""Oblivious samplers (paper §4, Algorithms 1-4) and the shuffle-and-split baseline.

Both samplers follow the paper's plan. Private memory draws the samples over keys
(Algorithms 3 and 4: `_distinct_keys`). An oblivious pass then builds the samples one after
another in external memory, without revealing which record went where. We fuse the paper's
steps into one routing pass (melbourne.route), and the reasons are:

* Algorithm 1 shuffles D first, so that its replication scan (which always takes the next
  record read) maps keys to records by a random injection. We copy record `key` itself, so the
  samples are exactly the drawn ones. Algorithm 3's samples are uniform, so no first shuffle is
  needed.
* Replication (lines 4-14) happens inside the distribute phase: a record in private memory is
  copied once for each slot that needs it.
* The second shuffle plus the grouping by decrypted sample id (lines 15-21; Algorithm 2's sort
  by decrypted position) becomes the collect phase. Every slot has a fixed public position, so
  nothing is decrypted and the trace does not vary with the sample ids either.
The adversary therefore sees exactly one routing pass, whose trace depends only on (n, slots).

The distribution the routing needs (melbourne's docstring) holds. Within a sample the keys are
distinct and uniform, and samples are independent. Poisson dummy slots route nothing
(melbourne.EMPTY): each (record, sample) pair is a member independently, which is what
RoutePlan.for_poisson's bound needs.

Drawing m distinct uniform keys (Algorithm 3's "first m of a random permutation", without
materialising n-long permutations): draw m keys uniformly, then redraw every key that repeats
an earlier key of its sample, until none repeat. The procedure treats key values
symmetrically: relabelling [n] by any permutation maps runs to runs with equal probability.
Its output, an ordered tuple of distinct keys, is therefore uniform over all such tuples. Each
sample is a uniform m-subset in uniformly random order, which is what Algorithm 1's final
shuffle provides. A sample larger than n/2 would need many redraws, so it takes a prefix of a
fresh permutation instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from sage_tfx.components.oblivious_sample_gen.access_trace import (AccessTrace, ExternalArray,
                                                                   read, write_gathered)
from sage_tfx.components.oblivious_sample_gen.descriptor import SamplingDescriptor, Scheme
from sage_tfx.components.oblivious_sample_gen.melbourne import (EMPTY, RoutePlan,
                                                                 chernoff_threshold, route)
from sage_tfx.randomness import secret_rng

# Per epoch, the probability that Poisson samples do not all fit in the padded layout.
# It enters delta through the accountant (accounting.py); 2^-60 keeps that term below 1e-12.
POISSON_TRUNCATION_PROBABILITY = 2.0 ** -60
DEFAULT_EPOCHS = 1  # what ObliviousSampleGen samples when no epochs are given


@dataclass(frozen=True)
class Samples:
    """One or more epochs of samples laid out one after another, in fixed-width units: unit j
    of an epoch (slots [j w, (j + 1) w), w = descriptor.slot_width) is sample j + 1.

    records holds one row per slot (a numpy array, one allocation). real[slot] is True where
    the slot holds a record, False for a null record (padding to the public size) or a dummy
    (a Poisson sample's unused width; a null record). sample_ids[slot] is the 1-based sample a
    slot belongs to within its epoch, 0 where real is False. Both are secret for Poisson (they
    reveal sample sizes); they stay in private memory or are stored encrypted."""
    records: np.ndarray
    sample_ids: np.ndarray
    real: np.ndarray
    descriptor: SamplingDescriptor

    def batches(self) -> list[np.ndarray]:
        """The samples in training order (dummies and nulls dropped). For trusted code and
        tests only: the positions gathered are secret."""
        width = self.descriptor.slot_width
        return [self.records[start + np.flatnonzero(self.real[start:start + width])]
                for start in range(0, self.real.size, width)]


def _as_records(records) -> np.ndarray:
    """The records as a numpy array (a tf.Tensor of numbers is viewed, not copied). 0 rows are
    a dataset like any other: to_size pads them to the public size with null rows."""
    records = records.numpy() if hasattr(records, "numpy") else np.asarray(records)
    if records.ndim == 0:
        raise ValueError("the records must be an array of rows, got a scalar")
    return records


def to_size(records: np.ndarray, size: int, rng: np.random.Generator,
            trace: Optional[AccessTrace], piece_rows: Optional[int] = None):
    """The records brought to `size` rows, a public value (accounting.py). Returns (records,
    number of real rows); real rows come first. Fewer rows are padded with null rows at
    positions n..size-1, which are not stored: route() and shuffle_and_split read rows past
    the end of the array as nulls from private memory (no copy of the data). More rows are cut
    to a uniformly random subset of `size`, by an oblivious routing pass whose slots take the
    first `size` entries of a secret permutation (one group of distinct uniform sources, as
    melbourne.route needs). The pass's trace depends on (n, size) only. With `piece_rows`, the
    cut rows are an ExternalArray in pieces of that many rows (the next pass's input buckets),
    which the next pass can free as it reads them (route's release_input)."""
    n = int(records.shape[0])
    if n <= size:
        return records, n
    return route(records, rng.permutation(n)[:size], RoutePlan.for_sizes(n, size), trace,
                 ("records", "subset_blocks", "sized"), out_piece_rows=piece_rows), size


def _distinct_keys(rng: np.random.Generator, n: int, sizes: np.ndarray) -> np.ndarray:
    """Concatenated samples: sizes[i] distinct uniform keys from [n] for each sample i, in
    uniformly random order (see the module docstring)."""
    keys = np.empty(int(sizes.sum()), dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    small = sizes <= n // 2
    for index in np.flatnonzero(~small):
        keys[starts[index]:starts[index] + sizes[index]] = rng.permutation(n)[:sizes[index]]
    small_sizes, small_starts = sizes[small], starts[small]
    if small_sizes.size == 0:
        return keys
    # Small samples as rows of a matrix padded with distinct out-of-range sentinels.
    width = int(small_sizes.max())
    columns = np.arange(width)
    real = columns[None, :] < small_sizes[:, None]
    matrix = np.where(real, rng.integers(0, n, size=(small_sizes.size, width)), n + columns)
    rows = np.arange(small_sizes.size)
    while rows.size:
        # A cheap sort finds the rows with a repeat; only those pay for an argsort.
        ordered = np.sort(matrix[rows], axis=1)
        rows = rows[(ordered[:, 1:] == ordered[:, :-1]).any(axis=1)]
        block = matrix[rows]
        order = np.argsort(block, axis=1, kind="stable")
        ordered = np.take_along_axis(block, order, axis=1)
        # A key equal to its predecessor in (stable) sorted order repeats an earlier draw.
        repeats = np.zeros(block.shape, dtype=bool)
        np.put_along_axis(repeats, order[:, 1:], ordered[:, 1:] == ordered[:, :-1], axis=1)
        block[repeats] = rng.integers(0, n, size=int(repeats.sum()))
        matrix[rows] = block
    keys_of_small = matrix[real]
    slot_of_small = (small_starts[:, None] + columns[None, :])[real]
    keys[slot_of_small] = keys_of_small
    return keys


def _last_use(sized, epoch: int, epochs: int) -> bool:
    """Whether the last epoch's pass may free the cut rows as it reads them: they are the
    sampler's own (an ExternalArray from to_size), not the caller's records."""
    return isinstance(sized, ExternalArray) and epoch == epochs - 1


def _layout(records: np.ndarray, descriptor: SamplingDescriptor) -> np.ndarray:
    """The output of every epoch, allocated once and filled in place epoch by epoch."""
    return np.empty((descriptor.epochs * descriptor.slots_per_epoch,) + records.shape[1:],
                    dtype=records.dtype)


def samples_swo(records, m: int, seed: Optional[int] = None,
                trace: Optional[AccessTrace] = None, epochs: int = 1,
                size: Optional[int] = None) -> Samples:
    """k = size // m samples of m distinct records each, per epoch (Algorithm 1 with
    Algorithm 3), from the records brought to `size` rows (to_size; default: n, for data whose
    size is public). Samples are independent of each other; the size mod m rows left over are
    what a drop-remainder batcher would leave."""
    records = _as_records(records)
    size = int(records.shape[0]) if size is None else size
    descriptor = plan(Scheme.SWO, size, epochs, sample_size=m)  # also checks m, size and epochs
    rng = secret_rng(seed)
    slots = descriptor.slots_per_epoch
    sizes = np.full(descriptor.samples_per_epoch, m, dtype=np.int64)
    route_plan = RoutePlan.for_sizes(size, slots)
    sized, real_rows = to_size(records, size, rng, trace, piece_rows=route_plan.in_bucket)
    output = _layout(records, descriptor)
    real = np.empty(output.shape[0], dtype=bool)
    for epoch in range(epochs):
        keys = _distinct_keys(rng, size, sizes)
        route(sized, keys, route_plan, trace, ("sized", "blocks", "samples"),
              out=output[epoch * slots:(epoch + 1) * slots],
              release_input=_last_use(sized, epoch, epochs))
        real[epoch * slots:(epoch + 1) * slots] = keys < real_rows
    ids = np.tile(np.repeat(np.arange(1, sizes.size + 1, dtype=np.int32), m), epochs)
    return Samples(output, ids * real, real, descriptor)


def poisson_width(size: int, gamma: float, samples_per_epoch: int) -> int:
    """w, the public width of every Poisson sample's unit: the smallest count that none of an
    epoch's samples (each Binomial(size, gamma)) exceeds except with probability
    POISSON_TRUNCATION_PROBABILITY (Chernoff for each, union bound over the epoch's samples).
    The trainer reads w slots per step, so step boundaries and batch widths are public."""
    if gamma >= 1.0:
        return size
    return chernoff_threshold(size, gamma,
                              math.log(POISSON_TRUNCATION_PROBABILITY / samples_per_epoch),
                              max(1, math.ceil(size * gamma)))


def samples_poisson(records, gamma: float, seed: Optional[int] = None,
                    trace: Optional[AccessTrace] = None, epochs: int = 1,
                    size: Optional[int] = None) -> Samples:
    """Poisson samples (Algorithm 2 with Algorithm 4), per epoch: each of k = floor(1/gamma)
    samples includes each record independently with probability gamma. Sample j fills the first
    slots of unit j (width w = poisson_width) and dummies fill the rest, so sample sizes and
    boundaries never show in the trace or in which slots a step reads. Dummies are EMPTY slots
    of the routing: they receive a null record in private memory and route no copy, so the
    routing moves about `size` copies per epoch, not k * w (melbourne, RoutePlan.for_poisson).
    The records are brought to `size` rows first (to_size: null rows are never "included", so
    padding does not change which real records a sample holds; cutting has the probability
    accounting.py charges). A sample larger than w (probability <=
    POISSON_TRUNCATION_PROBABILITY per epoch) keeps its first w records, a uniform subset."""
    records = _as_records(records)
    size = int(records.shape[0]) if size is None else size
    descriptor = plan(Scheme.POISSON, size, epochs, gamma=gamma)  # also checks gamma and epochs
    k, width, slots = descriptor.samples_per_epoch, descriptor.slot_width, descriptor.slots_per_epoch
    rng = secret_rng(seed)
    route_plan = RoutePlan.for_poisson(size, slots, width, gamma)
    sized, real_rows = to_size(records, size, rng, trace, piece_rows=route_plan.in_bucket)
    output = _layout(records, descriptor)
    real = np.empty(output.shape[0], dtype=bool)
    filled = np.arange(width)[None, :]
    for epoch in range(epochs):
        # Algorithm 4: a Binomial(size, gamma) size, then a uniform subset of that size, is a
        # Poisson sample of the `size` rows.
        sizes = np.minimum(rng.binomial(size, gamma, size=k), width)
        member = filled < sizes[:, None]
        keys = np.full((k, width), EMPTY, dtype=np.int64)
        keys[member] = _distinct_keys(rng, size, sizes)
        del member
        keys = keys.ravel()
        route(sized, keys, route_plan, trace, ("sized", "blocks", "samples"),
              out=output[epoch * slots:(epoch + 1) * slots],
              release_input=_last_use(sized, epoch, epochs))
        real[epoch * slots:(epoch + 1) * slots] = (keys != EMPTY) & (keys < real_rows)
    ids = np.tile(np.repeat(np.arange(1, k + 1, dtype=np.int32), width), epochs)
    return Samples(output, ids * real, real, descriptor)


# Rows the baseline moves per gather: a bounded temporary, not a copy of the data.
_BASELINE_CHUNK = 1 << 16


def shuffle_and_split(records, m: int, seed: Optional[int] = None,
                      trace: Optional[AccessTrace] = None, epochs: int = 1,
                      size: Optional[int] = None) -> Samples:
    """The baseline training pipelines use: shuffle the `size` rows (to_size) with a secret
    permutation by gathering (the positions read ARE the permutation, so the trace reveals
    it), then cut into size // m batches of m. Not oblivious; here for comparison."""
    records = _as_records(records)
    size = int(records.shape[0]) if size is None else size
    descriptor = plan(Scheme.SHUFFLE, size, epochs, sample_size=m)  # also checks m and epochs
    rng = secret_rng(seed)
    sized, real_rows = to_size(records, size, rng, trace)
    source = ExternalArray.of("sized", sized)
    output = _layout(records, descriptor)
    samples = ExternalArray.of("samples", output)
    slots = descriptor.slots_per_epoch
    real = np.empty(output.shape[0], dtype=bool)
    for epoch in range(epochs):
        permutation = rng.permutation(size)[:slots]
        real[epoch * slots:(epoch + 1) * slots] = permutation < real_rows
        for start in range(0, slots, _BASELINE_CHUNK):
            wanted = permutation[start:start + _BASELINE_CHUNK]
            present = wanted < real_rows  # positions past the stored rows are null padding
            rows = read(trace, source, wanted[present])
            index = np.full(wanted.size, rows.shape[0])  # past the rows read: a null row
            index[present] = np.arange(rows.shape[0])
            write_gathered(trace, samples, epoch * slots + start + np.arange(wanted.size), rows,
                           index)
    ids = np.tile(np.repeat(np.arange(1, descriptor.samples_per_epoch + 1, dtype=np.int32), m),
                  epochs)
    return Samples(output, ids * real, real, descriptor)


def plan(scheme: str, size: int, epochs: int, sample_size: Optional[int] = None,
         gamma: Optional[float] = None) -> SamplingDescriptor:
    """The descriptor a sampler produces on data brought to `size` rows (a public bound or a
    DP count; never an exact count of private data), before it runs: the trainer's calibration
    uses it ahead of sampling, and checks samples against it."""
    if not (isinstance(size, (int, np.integer)) and size >= 1):
        raise ValueError(f"size={size!r} must be a positive integer")
    _check_epochs(epochs)
    scheme = Scheme.parse(scheme, "sampling scheme")
    if scheme == Scheme.POISSON:
        if not (isinstance(gamma, (float, int)) and 0.0 < gamma <= 1.0):
            raise ValueError(f"gamma={gamma!r} must be in (0, 1]")
        samples_per_epoch = max(1, math.floor(1.0 / gamma + 1e-12))
        width = poisson_width(size, gamma, samples_per_epoch)
        return SamplingDescriptor(scheme=scheme, n=size, epochs=epochs,
                                  samples_per_epoch=samples_per_epoch,
                                  slots_per_epoch=samples_per_epoch * width, gamma=float(gamma),
                                  truncation_probability=POISSON_TRUNCATION_PROBABILITY)
    if not (isinstance(sample_size, (int, np.integer)) and 0 < sample_size <= size):
        raise ValueError(f"sample size m={sample_size!r} must be in [1, size={size}]")
    samples_per_epoch = size // sample_size
    return SamplingDescriptor(scheme=scheme, n=size, epochs=epochs,
                              samples_per_epoch=samples_per_epoch,
                              slots_per_epoch=samples_per_epoch * sample_size,
                              sample_size=sample_size)


def _check_epochs(epochs: int) -> None:
    if not (isinstance(epochs, (int, np.integer)) and epochs >= 1):
        raise ValueError(f"epochs={epochs!r} must be a positive integer")
