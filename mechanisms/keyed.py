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
standard normal by Box-Muller (52-bit uniforms).

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

    def normals(self, streams, counters) -> np.ndarray:
        """N(0, 1) for each (stream, counter) pair (broadcast); the same pair, the same value."""
        streams, counters = np.broadcast_arrays(np.asarray(streams, dtype=np.uint64),
                                                np.asarray(counters, dtype=np.uint64))
        shape = streams.shape
        blocks = np.empty((streams.size, 2), dtype=_WORD)
        blocks[:, 0] = streams.ravel()
        blocks[:, 1] = counters.ravel()
        encryptor = self._cipher.encryptor()
        words = np.frombuffer(encryptor.update(blocks.tobytes()) + encryptor.finalize(),
                              dtype=_WORD).reshape(-1, 2)
        # 52 random bits as the mantissa of a double in [1, 2) (bit operations, no int->float
        # conversion): u1 = 2 - x in (0, 1] keeps the log finite, u2 = x - 1 in [0, 1).
        exponent_one = np.uint64(0x3FF0000000000000)
        u1 = ((words[:, 0] >> np.uint64(12)) | exponent_one).view(np.float64)
        np.subtract(2.0, u1, out=u1)
        u2 = ((words[:, 1] >> np.uint64(12)) | exponent_one).view(np.float64)
        u2 -= 1.0
        u2 *= 2.0 * np.pi
        np.cos(u2, out=u2)
        np.log(u1, out=u1)
        u1 *= -2.0
        np.sqrt(u1, out=u1)
        u1 *= u2
        return u1.reshape(shape)
