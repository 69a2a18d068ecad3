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
distinct and uniform, and samples are independent. Poisson dummy slots get independent uniform
keys.

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
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from sage_tfx.components.oblivious_sample_gen.access_trace import AccessTrace
from sage_tfx.components.oblivious_sample_gen.descriptor import SCHEMES, SamplingDescriptor
from sage_tfx.components.oblivious_sample_gen.melbourne import (RoutePlan, chernoff_threshold,
                                                                 route)
from sage_tfx.randomness import secret_rng

# Per epoch, the probability that Poisson samples do not all fit in the padded layout.
# It enters delta through the accountant (accounting.py); 2^-60 keeps that term below 1e-12.
POISSON_TRUNCATION_PROBABILITY = 2.0 ** -60


@dataclass(frozen=True)
class Samples:
    """One or more epochs of samples laid out one after another.

    sample_ids[slot] is the 1-based sample a slot belongs to within its epoch, and 0 for a
    dummy. For Poisson sampling these ids are secret (they reveal the sample boundaries). They
    stay in private memory or are stored encrypted, never in the clear next to the records."""
    records: tf.Tensor
    sample_ids: np.ndarray
    descriptor: SamplingDescriptor

    def batches(self) -> list[tf.Tensor]:
        """The samples in training order (dummies dropped). Only for trusted code and tests."""
        slots = self.descriptor.slots_per_epoch
        batches = []
        for epoch in range(self.descriptor.epochs):
            ids = self.sample_ids[epoch * slots:(epoch + 1) * slots]
            for sample in range(1, self.descriptor.samples_per_epoch + 1):
                where = np.flatnonzero(ids == sample) + epoch * slots
                batches.append(tf.gather(self.records, where))
        return batches


def _as_records(records) -> tf.Tensor:
    records = tf.convert_to_tensor(records)
    if records.shape.rank == 0 or records.shape[0] == 0:
        raise ValueError("cannot sample from an empty dataset")
    return records


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


def _route_samples(records: tf.Tensor, keys: np.ndarray,
                   trace: Optional[AccessTrace]) -> tf.Tensor:
    plan = RoutePlan.for_sizes(int(records.shape[0]), keys.size)
    return route(records, keys, plan, trace, ("records", "blocks", "samples"))


def samples_swo(records, m: int | Sequence[int], seed: Optional[int] = None,
                trace: Optional[AccessTrace] = None, epochs: int = 1) -> Samples:
    """k samples without replacement (Algorithm 1 with Algorithm 3), per epoch.

    With an int m: k = n // m samples of m distinct records each; the n mod m records left
    over are what a drop-remainder batcher would leave. With a sequence m_1..m_k (sum <= n):
    samples of those sizes. Samples are independent of each other."""
    records = _as_records(records)
    n = int(records.shape[0])
    if isinstance(m, (int, np.integer)):
        if not 0 < m <= n:
            raise ValueError(f"sample size m={m} must be in [1, n={n}]")
        sizes = np.full(n // m, int(m), dtype=np.int64)
    else:
        sizes = np.asarray(list(m), dtype=np.int64)
        if sizes.size == 0 or sizes.min() <= 0 or sizes.sum() > n:
            raise ValueError(f"sample sizes must be positive and sum to at most n={n}; "
                             f"got {len(sizes)} sizes summing to {int(sizes.sum())}")
    _check_epochs(epochs)
    rng = secret_rng(seed)
    sample_ids = np.repeat(np.arange(1, sizes.size + 1), sizes)
    parts = [_route_samples(records, _distinct_keys(rng, n, sizes), trace)
             for _ in range(epochs)]
    uniform = bool(np.all(sizes == sizes[0]))
    descriptor = plan("swo", n, epochs, sample_size=int(sizes[0])) if uniform else SamplingDescriptor(
        scheme="swo", n=n, epochs=epochs, samples_per_epoch=int(sizes.size),
        slots_per_epoch=int(sizes.sum()), sample_size=int(sizes.max()))
    return Samples(tf.concat(parts, axis=0), np.tile(sample_ids, epochs), descriptor)


def poisson_layout(n: int, gamma: float) -> tuple[int, int]:
    """(samples per epoch k, slots per epoch L) for Poisson sampling at rate gamma.

    k = floor(1 / gamma) does not depend on n. The k sizes are independent Binomial(n, gamma),
    so their total is Binomial(k n, gamma), with mean k n gamma <= n. L is the smallest length
    >= n with P[total > L] <= POISSON_TRUNCATION_PROBABILITY (Chernoff:
    P[X >= L] <= exp(-k n KL(L / (k n) || gamma))). The paper pads to exactly n and keeps the
    k' samples that fit. But k' depends on the sample sizes, so on whether a given record was
    drawn, and the number of steps the trainer runs would leak it. Here k is fixed and
    truncation is negligible; accounting.py charges for it."""
    samples_per_epoch = max(1, math.floor(1.0 / gamma + 1e-12))
    trials = samples_per_epoch * n
    if gamma >= 1.0:
        return samples_per_epoch, n
    return samples_per_epoch, chernoff_threshold(trials, gamma,
                                                 math.log(POISSON_TRUNCATION_PROBABILITY),
                                                 max(n, math.ceil(trials * gamma)))


def samples_poisson(records, gamma: float, seed: Optional[int] = None,
                    trace: Optional[AccessTrace] = None, epochs: int = 1) -> Samples:
    """Poisson samples (Algorithm 2 with Algorithm 4), per epoch: each of k = floor(1/gamma)
    samples includes each record independently with probability gamma. An epoch is L slots
    (poisson_layout) holding the samples back to back and then dummies (sample id 0). Sample
    sizes, boundaries and the number of samples that fit are never visible in the trace."""
    records = _as_records(records)
    n = int(records.shape[0])
    descriptor = plan("poisson", n, epochs, gamma=gamma)  # also checks gamma and epochs
    samples_per_epoch, slots = descriptor.samples_per_epoch, descriptor.slots_per_epoch
    rng = secret_rng(seed)
    parts, ids = [], []
    for _ in range(epochs):
        # Algorithm 4: a Binomial(n, gamma) size, then a uniform subset of that size, is a
        # Poisson sample. Keep the leading samples that fit (all of them, but for an event
        # of probability <= POISSON_TRUNCATION_PROBABILITY).
        sizes = rng.binomial(n, gamma, size=samples_per_epoch)
        fitting = int(np.searchsorted(np.cumsum(sizes), slots, side="right"))
        sizes = sizes[:fitting]
        keys = _distinct_keys(rng, n, sizes)
        dummies = slots - keys.size
        keys = np.concatenate([keys, rng.integers(0, n, size=dummies)])
        epoch_ids = np.concatenate([np.repeat(np.arange(1, fitting + 1), sizes),
                                    np.zeros(dummies, dtype=np.int64)])
        parts.append(_route_samples(records, keys, trace))
        ids.append(epoch_ids)
    return Samples(tf.concat(parts, axis=0), np.concatenate(ids), descriptor)


def shuffle_and_split(records, m: int, seed: Optional[int] = None,
                      trace: Optional[AccessTrace] = None, epochs: int = 1) -> Samples:
    """The baseline training pipelines use: shuffle with a secret permutation by gathering
    (the positions read ARE the permutation, so the trace reveals it), then cut into
    n // m batches of m. Not oblivious; here for comparison."""
    records = _as_records(records)
    n = int(records.shape[0])
    descriptor = plan("shuffle", n, epochs, sample_size=m)  # also checks m and epochs
    rng = secret_rng(seed)
    k = descriptor.samples_per_epoch
    parts = []
    for _ in range(epochs):
        permutation = rng.permutation(n)[:k * m]
        if trace is not None:
            trace.read("records", permutation)
            trace.write("samples", np.arange(k * m))
        parts.append(tf.gather(records, permutation))
    ids = np.tile(np.repeat(np.arange(1, k + 1), m), epochs)
    return Samples(tf.concat(parts, axis=0), ids, descriptor)


def plan(scheme: str, n: int, epochs: int, sample_size: Optional[int] = None,
         gamma: Optional[float] = None) -> SamplingDescriptor:
    """The descriptor a sampler produces for n records, before it runs: the trainer's
    calibration uses it ahead of sampling, and checks samples against it."""
    if not (isinstance(n, (int, np.integer)) and n >= 1):
        raise ValueError(f"n={n!r} must be a positive integer")
    _check_epochs(epochs)
    if scheme == "poisson":
        if not (isinstance(gamma, (float, int)) and 0.0 < gamma <= 1.0):
            raise ValueError(f"gamma={gamma!r} must be in (0, 1]")
        samples_per_epoch, slots = poisson_layout(n, gamma)
        return SamplingDescriptor(scheme=scheme, n=n, epochs=epochs,
                                  samples_per_epoch=samples_per_epoch, slots_per_epoch=slots,
                                  gamma=float(gamma),
                                  truncation_probability=POISSON_TRUNCATION_PROBABILITY)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown sampling scheme {scheme!r}; use one of {SCHEMES}")
    if not (isinstance(sample_size, (int, np.integer)) and 0 < sample_size <= n):
        raise ValueError(f"sample size {sample_size!r} must be in [1, n={n}]")
    samples_per_epoch = n // sample_size
    return SamplingDescriptor(scheme=scheme, n=n, epochs=epochs, samples_per_epoch=samples_per_epoch,
                              slots_per_epoch=samples_per_epoch * sample_size,
                              sample_size=sample_size)


def _check_epochs(epochs: int) -> None:
    if not (isinstance(epochs, (int, np.integer)) and epochs >= 1):
        raise ValueError(f"epochs={epochs!r} must be a positive integer")
