"""Oblivious routing in the style of the Melbourne shuffle (Ohrimenko et al., ICALP 2014), with
numpy, one bucket at a time. The oblivious shuffle and both samplers are instances of it.

Threat model (the paper's §2). Records live in external memory; an adversary sees which
positions are read and written and in what order, not the (encrypted) contents. The algorithm
has a private memory of one input bucket (s_in = ceil(n_in / B) records) plus one block of
B * c slots, where any access pattern is allowed. Guarantee: the sequence of external positions
read and written depends only on public parameters (n_in, n_out, B, c), never on the secret
routing or on the data. A CPU is not an enclave: we claim the external-memory
pattern, which `AccessTrace` records, and not the cache behaviour of numpy's kernels
inside a bucket. Why not a sorting network: a bitonic network moves every record O(log^2 n)
times (210 passes at n = 10^6). Here each record is moved twice.

`route(records, source_of_slot, plan)` produces output[slot] = records[source_of_slot[slot]]
for n_out slots. A record may feed several slots (that is how samplers replicate) or none; a
slot whose source is EMPTY receives a null record from private memory and routes no copy (a
Poisson dummy). The input may hold fewer rows than the plan's n_in: rows past its end are
null records held in private memory (padding to a public size without copying the data). It
runs in two phases over an intermediate array of B blocks of B chunks of c slots each:

1. distribute: for each input bucket a, read it in full; put a copy of each record into the
   chunk of block a that belongs to each output bucket needing it. Every chunk has the same
   public size c and is padded with dummies. Write block a in full.
2. collect: for each output bucket b, read chunk b of every block (B * c slots), keep the
   real copies, put them in slot order, and write output bucket b in full.
The blocks are laid out chunk-major (chunk b of every block is one run of B * c positions),
so each collect step reads one run and then frees it: the blocks drain while the output fills.

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
pairs). Poisson samples route only their members (RoutePlan.for_poisson): every (record,
sample) pair is a member independently with probability gamma (a truncated sample keeps a
uniform subset of its members, which only lowers counts), and at most u = ceil(s_out / w) + 1
units of width w overlap output bucket b, so the count is dominated by Binomial(s_in * u, gamma).

If a chunk does overflow, we raise `RouteOverflow`. The caller's trace would then differ from
every other run, so this event can leak; it has probability at most 2^-40 per pass, under every
dataset, and the sampling accountant adds it to delta (accounting.py). It is never retried
silently, and its message holds no count or chunk size (c depends on the exact n in the cut
pass).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from sage_tfx.components.oblivious_sample_gen.access_trace import (AccessTrace, ExternalArray,
                                                                   null_rows, read,
                                                                   write_gathered)
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


EMPTY = -1  # source of a slot that receives a null record and routes no copy


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
    def _sized(cls, n_in: int, n_out: int, buckets: int):
        if n_in <= 0 or n_out <= 0:
            raise ValueError(f"cannot route {n_in} records to {n_out} slots; need at least one")
        buckets = max(1, min(buckets, math.isqrt(min(n_in, n_out))))
        return buckets, -(-n_in // buckets), -(-n_out // buckets)

    @classmethod
    def for_sizes(cls, n_in: int, n_out: int, buckets: int = DEFAULT_BUCKETS) -> "RoutePlan":
        """For slots in independent groups of distinct uniform sources (module docstring)."""
        buckets, in_bucket, out_bucket = cls._sized(n_in, n_out, buckets)
        p = in_bucket / n_in
        chunk = out_bucket
        if buckets > 1 and p < 1.0:
            chunk = chernoff_threshold(out_bucket, p,
                                       math.log(OVERFLOW_PROBABILITY / buckets ** 2),
                                       math.ceil(out_bucket * p))
        return cls(n_in, n_out, buckets, in_bucket, out_bucket, min(out_bucket, chunk))

    @classmethod
    def for_poisson(cls, n_in: int, n_out: int, width: int, gamma: float,
                    buckets: int = DEFAULT_BUCKETS) -> "RoutePlan":
        """For Poisson samples in units of `width` slots whose non-member slots are EMPTY."""
        buckets, in_bucket, out_bucket = cls._sized(n_in, n_out, buckets)
        chunk = out_bucket
        if buckets > 1 and gamma < 1.0:
            trials = in_bucket * (-(-out_bucket // width) + 1)
            chunk = chernoff_threshold(trials, gamma,
                                       math.log(OVERFLOW_PROBABILITY / buckets ** 2),
                                       math.ceil(trials * gamma))
        return cls(n_in, n_out, buckets, in_bucket, out_bucket, min(out_bucket, chunk))

    @property
    def padded_out(self) -> int:
        return self.buckets * self.out_bucket

    @property
    def block_slots(self) -> int:
        return self.buckets * self.buckets * self.chunk

    def block_positions(self, block: int) -> np.ndarray:
        """Positions of block `block` in the chunk-major intermediate array: its chunk b is at
        b * B * c + block * c. A function of the plan only."""
        buckets, c = self.buckets, self.chunk
        return (np.arange(buckets)[:, None] * (buckets * c) + block * c
                + np.arange(c)[None, :]).ravel()


def _route_maps(plan: RoutePlan, source_of_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Private-memory bookkeeping of one pass: for each block, which row of its input bucket
    each of its slots copies (in_bucket: the private null row, for a dummy), and for each
    output bucket, which row of its collected chunks each slot takes (B * c: the null row)."""
    buckets, c = plan.buckets, plan.chunk
    source = np.asarray(source_of_slot, dtype=np.int64)
    filled = np.flatnonzero(source != EMPTY)  # padding slots past n_out are EMPTY too
    source = source[filled]
    in_bucket = (source // plan.in_bucket).astype(np.int32)
    out_bucket = (filled // plan.out_bucket).astype(np.int32)
    pair = in_bucket * buckets + out_bucket
    del out_bucket
    counts = np.bincount(pair, minlength=buckets * buckets)
    if counts.max(initial=0) > c:
        # No counts or chunk size in the message: c is a function of the exact n in the cut
        # pass. The stop itself is paid for in delta (accounting.py).
        raise RouteOverflow("a routing chunk overflowed (probability <= 2^-40 per pass, "
                            "accounted in delta); the run stops and is not retried")
    # Fewer than 2^16 bucket pairs: numpy's stable sort is then a radix sort.
    order = np.argsort(pair.astype(np.uint16 if buckets <= 256 else np.int64), kind="stable")
    first_of_pair = np.concatenate(([0], np.cumsum(counts)[:-1]))
    offset = np.empty(pair.size, dtype=np.int32)
    offset[order] = np.arange(pair.size) - first_of_pair[pair[order]]
    del order
    # Block a, slot b * c + i: chunk b (for output bucket b), row i.
    block_source = np.full((buckets, buckets * c), plan.in_bucket, dtype=np.int32)
    block_source[in_bucket, (pair - in_bucket * buckets) * c + offset] = (
        source - in_bucket.astype(np.int64) * plan.in_bucket)
    # Collected rows of output bucket b: chunk b of block 0, of block 1, ...
    collected_index = np.full(plan.padded_out, buckets * c, dtype=np.int32)
    collected_index[filled] = in_bucket * c + offset
    return block_source, collected_index.reshape(buckets, plan.out_bucket)


def route(records, source_of_slot: np.ndarray, plan: RoutePlan,
          trace: Optional[AccessTrace] = None,
          names: tuple[str, str, str] = ("input", "blocks", "output"),
          out: Optional[np.ndarray] = None, out_piece_rows: Optional[int] = None,
          release_input: bool = False):
    """output[slot] = records[source_of_slot[slot]] (a null record where the source is EMPTY or
    past the end of `records`), through the two oblivious phases, written into `out` (n_out
    rows) or a new array, which is returned; with `out_piece_rows`, a new ExternalArray in
    pieces of that many rows instead, which a later pass can free as it reads them.

    `records` is an array or the ExternalArray of an earlier pass (named by itself, not by
    names[0]). release_input: free each of its pieces, one per input bucket, once distributed,
    so the input shrinks while the blocks grow (the records are not needed afterwards).

    External memory (the input, the blocks, the output) is touched only through
    access_trace.read/write/write_gathered, at positions computed from the plan and
    len(records) alone. Everything indexed by the secret routing happens in private memory:
    the per-bucket gathers of one input bucket or one output bucket's chunks. A dummy slot
    copies a null row of private memory, never a record. `source_of_slot` must have the
    randomness described in the module docstring; it never leaves private memory."""
    source, middle, target = names
    external_in = (records if isinstance(records, ExternalArray)
                   else ExternalArray.of(source, np.asarray(records)))
    rows, like = external_in.rows, external_in.row_template
    if rows > plan.n_in:
        raise ValueError(f"{rows} records do not fit a plan for {plan.n_in}")
    if release_input and external_in.piece_rows != plan.in_bucket:
        raise ValueError("release_input needs the input in pieces of one input bucket "
                         f"({plan.in_bucket} rows), not {external_in.piece_rows}")
    buckets, c = plan.buckets, plan.chunk
    block_source, collected_index = _route_maps(plan, source_of_slot)
    blocks = ExternalArray(middle, plan.block_slots, like, piece_rows=buckets * c)
    if out_piece_rows is not None:
        output = ExternalArray(target, plan.n_out, like, piece_rows=out_piece_rows)
    else:
        output = ExternalArray.of(target, null_rows(plan.n_out, like) if out is None else out)
    # Distribute: read input bucket a in full (rows past the records are private nulls),
    # copy its records into the chunks of block a, write block a in full.
    for block in range(buckets):
        start, stop = block * plan.in_bucket, min((block + 1) * plan.in_bucket, rows)
        bucket = (read(trace, external_in, np.arange(start, stop)) if stop > start
                  else null_rows(0, like))
        # Index in_bucket (a dummy) and rows past the bucket's records read as null rows.
        write_gathered(trace, blocks, plan.block_positions(block), bucket, block_source[block])
        del bucket
        if release_input and stop > start:
            external_in.release(block)
    del block_source
    # Collect: for output bucket b read chunk b of every block, put slots in order, write it,
    # and free those chunks.
    for bucket in range(buckets):
        chunks = read(trace, blocks, np.arange(bucket * buckets * c, (bucket + 1) * buckets * c))
        start, stop = bucket * plan.out_bucket, min((bucket + 1) * plan.out_bucket, plan.n_out)
        if stop > start:
            # Index B * c, past the chunks, is the null row.
            write_gathered(trace, output, np.arange(start, stop), chunks,
                           collected_index[bucket, :stop - start])
        del chunks
        blocks.release(bucket)
    return output if out_piece_rows is not None else output.values()


def oblivious_shuffle(records, seed: Optional[int] = None, trace: Optional[AccessTrace] = None,
                      buckets: int = DEFAULT_BUCKETS) -> tuple[np.ndarray, np.ndarray]:
    """Apply a secret uniformly random permutation to the rows of `records` (any n >= 1).

    Returns (shuffled, source) with shuffled[q] = records[source[q]]. The permutation is
    returned for tests and for callers composing passes. It must stay in private memory.
    `seed` is for tests only; by default the OS CSPRNG seeds the generator."""
    records = np.asarray(records)
    n = int(records.shape[0]) if records.ndim else 0
    plan = RoutePlan.for_sizes(n, n, buckets)
    source = secret_rng(seed).permutation(n)
    return route(records, source, plan, trace), source
