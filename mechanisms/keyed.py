"""Keyed Gaussian noise: node noise of DP trees that can be recomputed instead of stored.

The streaming operator (dp_statistics/continual) adds Gaussian noise to every node of one binary
tree per key, over up to T micro-batches. It must be able to evaluate a tree's future without new
data (empty-key release prediction), to recompute a micro-batch lost in a crash with exactly the
same noise (a second, fresh noisy release of the same data would spend budget twice), and to feed
the same noise to a reference implementation in tests. Storing every node's noise for 10^5 keys x
2T nodes does not fit in memory; a pseudorandom function of (tree, node) does all three.

The function is AES-256 in counter mode: block = (stream id, counter) as two little-endian 64-bit
words, encrypted under a 32-byte secret key from the OS CSPRNG (`secrets`). AES is a pseudorandom
permutation; on distinct inputs it is indistinguishable from a random function (PRP/PRF switching),
so the noise is as good as independent to anyone without the key. The key lives only in the
operator's private state, beside the raw data it protects. One block gives two 52-bit uniforms and,
by Marsaglia's polar method, a pair of standard normals: counters 2j and 2j + 1 are pair j (a
rejected draw is redrawn from the block (stream | attempt << 56, j)). One instance per thread:
it keeps one encryptor.

Floating point: this is continuous Gaussian noise in float64, not OpenDP's lattice sampler
(mechanisms/__init__.py explains why the additive mechanisms use OpenDP). Callers release only
thresholding decisions (booleans) and values rounded to a grid far coarser than the float spacing
(continual/tree.py `round_to_grid`), which removes the low-order bits Mironov's attack reads.

Every CPU: a value is a function of (key, stream, counter) alone on every x86-64 and aarch64
machine (IEEE basic operations only, no SIMD-dispatched logarithm; polar_kernel.py), since a
recomputed value that differed from the published one would be a second noisy copy.
"""
from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

# Compiled (numba) when this module is imported, so that no draw compiles, or fails, after a
# charge.
from sage_tfx.mechanisms import polar_kernel
from sage_tfx.randomness import secret_key

KEY_BYTES = 32
_WORD = np.dtype("<u8")
_ATTEMPT_SHIFT = 56  # a polar draw's attempt number, in the top byte of the stream word


class KeyedGaussian:
    """Standard normal noise as a pure function of (secret key, stream id, counter)."""

    def __init__(self, key: bytes):
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"the noise key must be {KEY_BYTES} bytes")
        self._key = bytes(key)
        # ECB keeps no state between full blocks, so one encryptor serves every call.
        self._encryptor = Cipher(algorithms.AES(self._key), modes.ECB()).encryptor()

    @classmethod
    def fresh(cls) -> "KeyedGaussian":
        """A new secret key from the OS CSPRNG (the only mode outside tests)."""
        return cls(secret_key(KEY_BYTES))

    @property
    def key(self) -> bytes:
        """The secret key, for the operator's durable (private) state."""
        return self._key

    def _encrypt(self, blocks: np.ndarray) -> np.ndarray:
        """AES of each (stream, pair) row of `blocks` ((n, 2) little-endian 64-bit words, C
        order) into a new (n, 2) array: written in place by update_into (no bytes object, no
        tobytes copy), which asks for one block of slack past the output."""
        out = np.empty(2 * len(blocks) + 2, dtype=_WORD)
        self._encryptor.update_into(blocks.view(np.uint8), out.view(np.uint8))
        return out[:2 * len(blocks)].reshape(-1, 2)

    def _pairs(self, blocks: np.ndarray) -> np.ndarray:
        """Two independent N(0, 1) per (stream, pair) row of `blocks` ((n, 2) words), as an
        (n, 2) array, by Marsaglia's polar method: (u, v) uniform in the square from one AES
        block, kept if 0 < u^2 + v^2 < 1 (probability pi / 4), else redrawn from the block of
        the next attempt (attempt number in the stream word's top byte); (u, v) * sqrt(-2 ln s
        / s) is then a normal pair, exact up to the 52-bit grid and float rounding. 256
        attempts all rejected (probability 0.215^256, about 1e-171) is an error, not a silent
        fallback. No trigonometry. The arithmetic is polar_kernel.py's (compiled: one loop per
        pass; IEEE basic operations only, so the same bits on every CPU)."""

        if len(blocks) and int(blocks[:, 0].max()) >= 1 << _ATTEMPT_SHIFT:
            raise ValueError("noise stream ids must be below 2^56")
        words = self._encrypt(blocks)
        radius = np.empty(len(words))
        rejected = polar_kernel.uniform_square(words, radius)
        pairs = words.view(np.float64)
        attempt = 1
        while len(rejected):
            if attempt == 1 << (64 - _ATTEMPT_SHIFT):
                raise RuntimeError("keyed noise: 256 polar draws rejected in a row")
            again = polar_kernel.retry_blocks(blocks, rejected,
                                              np.uint64(attempt << _ATTEMPT_SHIFT))
            rejected = polar_kernel.accept_retries(self._encrypt(again), rejected, pairs,
                                                   radius)
            attempt += 1
        polar_kernel.polar_scale(pairs, radius)
        return pairs

    def normals(self, streams, counters) -> np.ndarray:
        """N(0, 1) for each (stream, counter) pair (broadcast); the same pair, the same value.
        Counters 2j and 2j + 1 are the two halves of one polar pair."""
        streams, counters = np.broadcast_arrays(np.asarray(streams, dtype=np.uint64),
                                                np.asarray(counters, dtype=np.uint64))
        blocks = np.empty((streams.size, 2), dtype=_WORD)
        blocks[:, 0] = streams.ravel()
        blocks[:, 1] = counters.ravel() >> np.uint64(1)
        pairs = self._pairs(blocks)
        odd = (counters.ravel() & np.uint64(1)).astype(np.intp)
        return pairs[np.arange(len(pairs)), odd].reshape(streams.shape)

    def normal_rows(self, streams, first, count: int) -> np.ndarray:
        """The same values as `normals` for counters first[i] .. first[i] + count - 1 of stream
        i, as (len(streams), count); `first` must be even (one pair per two values)."""
        streams = np.asarray(streams, dtype=np.uint64).ravel()
        first = np.broadcast_to(np.asarray(first, dtype=np.uint64).ravel(), streams.shape)
        values, _ = self.normal_ragged(streams, first, np.full(len(streams), count))
        # Each stream's (count + 1) // 2 pairs, stream after stream: rows of the output.
        return values.reshape(len(streams), -1)[:, :count]

    def normal_segments(self, streams, segments) -> list[np.ndarray]:
        """`normal_rows(streams, first, count)` for each (first, count) of `segments`, from one
        pass of AES and polar draws over all of them (the per-call cost is paid once)."""
        streams = np.asarray(streams, dtype=np.uint64).ravel()
        firsts = [np.broadcast_to(np.asarray(first, dtype=np.uint64).ravel(), streams.shape)
                  for first, _ in segments]
        if any((first & np.uint64(1)).any() for first in firsts):
            raise ValueError("normal_rows and normal_segments need even first counters")
        counts = [count for _, count in segments]
        values, _ = self.normal_ragged(np.tile(streams, len(segments)),
                                       np.concatenate(firsts or [np.empty(0, np.uint64)]),
                                       np.repeat(counts, len(streams)))
        # Segment after segment, stream after stream, each stream's (count + 1) // 2 pairs.
        ends = np.cumsum([0] + [len(streams) * 2 * ((count + 1) // 2) for count in counts])
        return [values[start:end].reshape(len(streams), 2 * ((count + 1) // 2))[:, :count]
                for count, start, end in zip(counts, ends[:-1], ends[1:])]

    def normal_ragged(self, streams, first, counts) -> tuple[np.ndarray, np.ndarray]:
        """normal_rows(streams[i], first[i], counts[i]) of each stream, its own count each, from
        one pass of AES and polar draws over all of them: (values, starts), the values of
        stream i at values[starts[i]:starts[i] + counts[i]]. `first` must be even."""
        streams = np.ascontiguousarray(streams, dtype=np.uint64).ravel()
        first = np.ascontiguousarray(first, dtype=np.uint64).ravel()
        counts = np.ascontiguousarray(counts, dtype=np.int64).ravel()
        if (first & np.uint64(1)).any():
            raise ValueError("normal_ragged needs even first counters")
        if not streams.shape == first.shape == counts.shape or (len(counts) and
                                                                counts.min() < 0):
            raise ValueError("normal_ragged needs a first counter and a count >= 0 per stream")
        widths = (counts + 1) // 2  # pairs per stream
        blocks = polar_kernel.ragged_blocks(streams, first >> np.uint64(1), widths)
        return self._pairs(blocks).reshape(-1), 2 * (np.cumsum(widths) - widths)
