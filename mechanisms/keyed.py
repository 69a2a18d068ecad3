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
"""
from __future__ import annotations

import secrets

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_BYTES = 32
_WORD = np.dtype("<u8")
_EXPONENT_ONE = np.uint64(0x3FF0000000000000)  # the bits of 1.0: OR a 52-bit mantissa in
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
        return cls(secrets.token_bytes(KEY_BYTES))

    @property
    def key(self) -> bytes:
        """The secret key, for the operator's durable (private) state."""
        return self._key

    def _blocks(self, streams: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """AES of (stream, pair) blocks: (n, 2) little-endian 64-bit words."""
        blocks = np.empty((streams.size, 2), dtype=_WORD)
        blocks[:, 0] = streams.ravel()
        blocks[:, 1] = pairs.ravel()
        return np.frombuffer(self._encryptor.update(blocks.tobytes()),
                             dtype=_WORD).reshape(-1, 2)

    def _pairs(self, streams: np.ndarray, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Two independent N(0, 1) per (stream, pair) by Marsaglia's polar method: (u, v)
        uniform in the square from one AES block, kept if 0 < u^2 + v^2 < 1 (probability
        pi / 4), else redrawn from the block of the next attempt (attempt number in the
        stream word's top byte); (u, v) * sqrt(-2 ln s / s) is then a normal pair, exact up to
        the 52-bit grid and float rounding. 256 attempts all rejected (probability 0.215^256,
        about 1e-171) is an error, not a silent fallback.
        No trigonometry: about twice as fast as Box-Muller in numpy."""
        if streams.size and int(streams.max()) >= 1 << _ATTEMPT_SHIFT:
            raise ValueError("noise stream ids must be below 2^56")
        u, v, todo = self._uniform_square(streams, pairs, 0)
        attempt = 1
        while len(todo):
            if attempt == 1 << (64 - _ATTEMPT_SHIFT):
                raise RuntimeError("keyed noise: 256 polar draws rejected in a row")
            u_again, v_again, still = self._uniform_square(streams[todo], pairs[todo], attempt)
            u[todo], v[todo] = u_again, v_again
            todo = todo[still]
            attempt += 1
        radius = u * u
        radius += v * v
        factor = np.log(radius)
        factor *= -2.0
        factor /= radius
        np.sqrt(factor, out=factor)
        u *= factor
        v *= factor
        return u, v

    def _uniform_square(self, streams, pairs, attempt: int):
        """(u, v) in [-1, 1)^2 from one block each, and the indices outside the open disc."""
        words = self._blocks(streams | np.uint64(attempt << _ATTEMPT_SHIFT), pairs)
        # 52 random bits as the mantissa of a double in [1, 2), mapped to [-1, 1).
        x = ((words >> np.uint64(12)) | _EXPONENT_ONE).view(np.float64)
        x *= 2.0
        x -= 3.0
        u, v = x[:, 0].copy(), x[:, 1].copy()
        radius = u * u
        radius += v * v
        return u, v, np.flatnonzero((radius <= 0.0) | (radius >= 1.0))

    def normals(self, streams, counters) -> np.ndarray:
        """N(0, 1) for each (stream, counter) pair (broadcast); the same pair, the same value.
        Counters 2j and 2j + 1 are the two halves of one polar pair."""
        streams, counters = np.broadcast_arrays(np.asarray(streams, dtype=np.uint64),
                                                np.asarray(counters, dtype=np.uint64))
        first, second = self._pairs(streams.ravel(), counters.ravel() >> np.uint64(1))
        odd = (counters.ravel() & np.uint64(1)).astype(bool)
        return np.where(odd, second, first).reshape(streams.shape)

    def normal_rows(self, streams, first, count: int) -> np.ndarray:
        """The same values as `normals` for counters first[i] .. first[i] + count - 1 of stream
        i, as (len(streams), count); `first` must be even (one pair per two values)."""
        streams = np.asarray(streams, dtype=np.uint64).ravel()
        first = np.asarray(first, dtype=np.uint64).ravel()
        if (first & np.uint64(1)).any():
            raise ValueError("normal_rows needs even first counters")
        n_pairs = (count + 1) // 2
        pairs = (first >> np.uint64(1))[:, None] + np.arange(n_pairs, dtype=np.uint64)[None, :]
        one, other = self._pairs(np.repeat(streams, n_pairs), pairs.ravel())
        out = np.empty((len(streams), n_pairs, 2))
        out[:, :, 0] = one.reshape(len(streams), n_pairs)
        out[:, :, 1] = other.reshape(len(streams), n_pairs)
        return out.reshape(len(streams), 2 * n_pairs)[:, :count]
