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
operator's private state, beside the raw data it protects. Two 53-bit uniforms per block give one
standard normals by Box-Muller (52-bit uniforms): counter 2j is the cosine half, 2j + 1 the
sine half of block j.

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


class KeyedGaussian:
    """Standard normal noise as a pure function of (secret key, stream id, counter)."""

    def __init__(self, key: bytes):
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"the noise key must be {KEY_BYTES} bytes")
        self._key = bytes(key)
        self._cipher = Cipher(algorithms.AES(self._key), modes.ECB())

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
        encryptor = self._cipher.encryptor()
        return np.frombuffer(encryptor.update(blocks.tobytes()) + encryptor.finalize(),
                             dtype=_WORD).reshape(-1, 2)

    @staticmethod
    def _radius_and_angle(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # 52 random bits as the mantissa of a double in [1, 2) (bit operations, no int->float
        # conversion): u1 = 2 - x in (0, 1] keeps the log finite, u2 = x - 1 in [0, 1).
        exponent_one = np.uint64(0x3FF0000000000000)
        radius = ((words[:, 0] >> np.uint64(12)) | exponent_one).view(np.float64)
        np.subtract(2.0, radius, out=radius)
        np.log(radius, out=radius)
        radius *= -2.0
        np.sqrt(radius, out=radius)
        angle = ((words[:, 1] >> np.uint64(12)) | exponent_one).view(np.float64)
        angle -= 1.0
        angle *= 2.0 * np.pi
        return radius, angle

    def normals(self, streams, counters) -> np.ndarray:
        """N(0, 1) for each (stream, counter) pair (broadcast); the same pair, the same value.
        Counters 2j and 2j + 1 are the cosine and sine halves of one Box-Muller pair."""
        streams, counters = np.broadcast_arrays(np.asarray(streams, dtype=np.uint64),
                                                np.asarray(counters, dtype=np.uint64))
        radius, angle = self._radius_and_angle(self._blocks(streams, counters >> np.uint64(1)))
        angle -= (counters.ravel() & np.uint64(1)).astype(np.float64) * (np.pi / 2)
        np.cos(angle, out=angle)
        return (radius * angle).reshape(streams.shape)

    def normal_rows(self, streams, first, count: int) -> np.ndarray:
        """The same values as `normals` for counters first[i] .. first[i] + count - 1 of stream
        i, as (len(streams), count); `first` must be even (one AES block per two values)."""
        streams = np.asarray(streams, dtype=np.uint64).ravel()
        first = np.asarray(first, dtype=np.uint64).ravel()
        if (first & np.uint64(1)).any():
            raise ValueError("normal_rows needs even first counters")
        n_pairs = (count + 1) // 2
        pairs = (first >> np.uint64(1))[:, None] + np.arange(n_pairs, dtype=np.uint64)[None, :]
        radius, angle = self._radius_and_angle(
            self._blocks(np.repeat(streams, n_pairs), pairs))
        out = np.empty((len(streams), n_pairs, 2))
        out[:, :, 0] = (radius * np.cos(angle)).reshape(len(streams), n_pairs)
        out[:, :, 1] = (radius * np.sin(angle)).reshape(len(streams), n_pairs)
        return out.reshape(len(streams), 2 * n_pairs)[:, :count]
