"""The one source of randomness for privacy noise and sampling (docs/architecture.md,
"Randomness")."""
from __future__ import annotations

import secrets
from typing import Optional

import numpy as np


def secret_rng(seed: Optional[int] = None) -> np.random.Generator:
    """A generator seeded from the OS CSPRNG; a fixed `seed` exists for tests only."""
    return np.random.Generator(np.random.PCG64DXSM(secrets.randbits(128) if seed is None
                                                   else seed))


def secret_key(length: int = 32) -> bytes:
    """`length` bytes from the OS CSPRNG: a key for a keyed pseudorandom function (AES)."""
    return secrets.token_bytes(length)
