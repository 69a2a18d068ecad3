"""Oblivious routing in the style of the Melbourne shuffle (Ohrimenko et al., ICALP 2014), as a
vectorized TensorFlow op. The oblivious shuffle and both samplers are instances of it.

Threat model (the paper's §2). Records live in external memory; an adversary sees which
positions are read and written and in what order, not the (encrypted) contents. The algorithm
has a private memory of one input bucket (s_in = ceil(n_in / B) records) plus one block of
B * c slots, where any access pattern is allowed. Guarantee: the sequence of external positions
read and written depends only on public parameters (n_in, n_out, B, c), never on the secret
routing or on the data. TensorFlow on a CPU is not an enclave: we claim the external-memory
pattern, which `AccessTrace` records, and not the cache behaviour of TensorFlow's kernels
inside a bucket. Why not a sorting network: a bitonic network moves every record O(log^2 n)
times (210 passes at n = 10^6). Here each record is moved twice.

`route(records, source_of_slot)` produces output[slot] = records[source_of_slot[slot]] for
n_out slots. A record may feed several slots (that is how samplers replicate) or none. It
runs in two phases:

1. distribute: for each input bucket a, read it in full; put a copy of each record into the
   chunk of block a that belongs to each output bucket needing it. Every chunk has the same
   public size c and is padded with dummies. Write block a in full.
2. collect: for each output bucket b, read chunk b of every block (B * c slots), keep the
   real copies, put them in slot order, and write output bucket b in full.

When the routing is random enough, no chunk overflows except with tiny probability. Output
slots come in groups: a whole shuffle is one group, each sample is one group. Within a group the
sources are distinct and uniformly random, and groups are independent. Then the number of
copies sent from input bucket a to output bucket b is a sum of independent hypergeometrics,
one per group: group g puts x_g of its slots in bucket b and draws them from n_in positions,
of which at most s_in lie in bucket a. Hoeffding (1963, Thm. 4) shows each hypergeometric's
moment generating function is at most the binomial's. The sum is therefore dominated, in
Chernoff's sense, by Binomial(s_out, p) with p = s_in / n_in, so
    P[count >= c] <= exp(-s_out * KL(c / s_out || p)).
We pick the smallest c with B^2 times that bound <= 2^-40 (a union bound over all bucket
pairs). We add B - 1 slots of slack for padding slots, which are routed deterministically.

If a chunk does overflow, we raise `RouteOverflow`. The caller's trace would then differ from
every other run, so this event can leak; it has probability at most 2^-40 per pass. It is
never retried silently.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tensorflow as tf

from sage_tfx.components.oblivious_sample_gen.access_trace import AccessTrace, read, write
from sage_tfx.randomness import secret_rng

OVERFLOW_PROBABILITY = 2.0 ** -40
# Private memory holds one bucket: 16 buckets keep the dummy overhead near 13% at n = 10^6.
DEFAULT_BUCKETS = 16


class RouteOverflow(RuntimeError):
    """A chunk overflowed (probability <= 2^-40 per pass for the routings used here)."""


def chernoff_threshold(trials: int, p: float, log_probability: float, low: int) -> int:
    """The smallest c >= low (c <= trials) with exp(-trials * KL(c / trials || p)) <=
    exp(log_probability): a count that Binomial(trials, p), or anything it dominates, reaches
    with at most that probability (Chernoff). The bound decreases in c above the mean, so a
    binary search finds it."""
    def log_bound(c: int) -> float:
        q = c / trials
        if q >= 1.0:
            return math.log(p) * trials
        return -trials * (q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p)))

    high = trials
    while low < high:
        middle = (low + high) // 2
        if log_bound(middle) <= log_probability:
            high = middle
        else:
            low = middle + 1
    return low


@dataclass(frozen=True)
class RoutePlan:
    """Public parameters of one routing pass from n_in records to n_out slots."""
    n_in: int
    n_out: int
    buckets: int
    in_bucket: int
    out_bucket: int
    chunk: int

    @classmethod
    def for_sizes(cls, n_in: int, n_out: int, buckets: int = DEFAULT_BUCKETS) -> "RoutePlan":
        if n_in <= 0 or n_out <= 0:
            raise ValueError(f"cannot route {n_in} records to {n_out} slots; need at least one")
        buckets = max(1, min(buckets, math.isqrt(min(n_in, n_out))))
        in_bucket, out_bucket = -(-n_in // buckets), -(-n_out // buckets)
        p = in_bucket / n_in
        chunk = out_bucket
        if buckets > 1 and p < 1.0:
            chunk = chernoff_threshold(out_bucket, p,
                                       math.log(OVERFLOW_PROBABILITY / buckets ** 2),
                                       math.ceil(out_bucket * p))
        return cls(n_in, n_out, buckets, in_bucket, out_bucket,
                   min(out_bucket, chunk + buckets - 1))

    @property
    def padded_out(self) -> int:
        return self.buckets * self.out_bucket

    @property
    def block_slots(self) -> int:
        return self.buckets * self.buckets * self.chunk

    def chunk_positions(self) -> np.ndarray:
        """Block positions the collect phase reads, output bucket after output bucket: chunk b
        of every block. A function of the plan only."""
        buckets, c = self.buckets, self.chunk
        block_starts = np.arange(buckets) * buckets * c
        return (np.arange(buckets)[:, None, None] * c + block_starts[None, :, None]
                + np.arange(c)[None, None, :]).ravel()


def _route_maps(plan: RoutePlan, source_of_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Private-memory bookkeeping of one pass: which input record each block slot copies
    (n_in: the private zero row, for a dummy), and, for each output slot, its position among
    the chunks the collect phase read."""
    buckets, c = plan.buckets, plan.chunk
    padding = np.arange(plan.padded_out - plan.n_out) % plan.n_in
    sources = np.concatenate([source_of_slot, padding]).astype(np.int64)
    slots = np.arange(plan.padded_out)
    in_bucket, out_bucket = sources // plan.in_bucket, slots // plan.out_bucket
    pair = in_bucket * buckets + out_bucket
    # Fewer than 2^16 bucket pairs: numpy's stable sort is then a radix sort.
    order = np.argsort(pair.astype(np.uint16 if buckets <= 256 else np.int64), kind="stable")
    counts = np.bincount(pair, minlength=buckets * buckets)
    if counts.max() > c:
        raise RouteOverflow(f"a chunk received {counts.max()} copies, more than its {c} slots")
    first_of_pair = np.concatenate(([0], np.cumsum(counts)[:-1]))
    sorted_pair = pair[order]
    offset = np.empty(plan.padded_out, dtype=np.int64)
    offset[order] = slots - first_of_pair[sorted_pair]
    block_source = np.full(plan.block_slots, plan.n_in, dtype=np.int64)
    block_source[pair * c + offset] = sources
    # Collected row of output bucket b: chunk b of block 0, of block 1, ... (chunk_positions).
    collected = out_bucket * (buckets * c) + in_bucket * c + offset
    return block_source, collected[:plan.n_out]


def route(records, source_of_slot: np.ndarray, plan: RoutePlan,
          trace: Optional[AccessTrace] = None, names: tuple[str, str, str] = (
              "input", "blocks", "output")) -> tf.Tensor:
    """output[slot] = records[source_of_slot[slot]], through the two oblivious phases.

    External memory (the input, the blocks, the output) is touched only through
    access_trace.read/write, at positions computed from the plan alone. Everything indexed by
    the secret routing happens in private memory: TensorFlow runs the per-bucket work of all
    buckets as one vectorised op, the "private memory" of the module docstring. A dummy block
    slot copies a constant zero row of private memory, never a record.
    `source_of_slot` must have the randomness described in the module docstring; it never
    leaves private memory."""
    records = tf.convert_to_tensor(records)
    source, middle, target = names
    block_source, collected_index = _route_maps(plan, source_of_slot)
    # Distribute: read every input bucket in full, copy records into chunks, write blocks.
    private = read(trace, source, records, np.arange(plan.n_in))
    private = tf.concat([private, tf.zeros_like(private[:1])], axis=0)
    blocks = write(trace, middle, tf.gather(private, block_source), np.arange(plan.block_slots))
    del private
    # Collect: for each output bucket read its chunk of every block, put slots in order, write.
    collected = read(trace, middle, blocks, plan.chunk_positions())
    del blocks
    output = tf.gather(collected, collected_index)
    return write(trace, target, output, np.arange(plan.n_out))


def oblivious_shuffle(records, seed: Optional[int] = None, trace: Optional[AccessTrace] = None,
                      buckets: int = DEFAULT_BUCKETS) -> tuple[tf.Tensor, np.ndarray]:
    """Apply a secret uniformly random permutation to the rows of `records` (any n >= 1).

    Returns (shuffled, source) with shuffled[q] = records[source[q]]. The permutation is
    returned for tests and for callers composing passes. It must stay in private memory.
    `seed` is for tests only; by default the OS CSPRNG seeds the generator."""
    records = tf.convert_to_tensor(records)
    n = int(records.shape[0]) if records.shape.rank else 0
    plan = RoutePlan.for_sizes(n, n, buckets)
    source = secret_rng(seed).permutation(n)
    return route(records, source, plan, trace), source
