"""Seeded stand-ins for OpenDP's noise in tests (conftest.py's seeded_noise fixture, and
seeded_tasks/sitecustomize.py for task processes)."""
import numpy as np


class SeededNoise:
    """Stands in for one OpenDP measurement in a test: the same law and scale, drawn from a
    seeded numpy generator so that a pipeline test repeats exactly. (OpenDP's samplers take no
    seed; the product never runs this.)"""

    def __init__(self, noise: str, atom: str, scale: float, rng: np.random.Generator):
        self.noise, self.atom, self.scale, self.rng = noise, atom, scale, rng

    def __call__(self, values: np.ndarray) -> np.ndarray:
        shape = values.shape
        if self.noise == "laplace" and self.atom == "i64":
            p = 1.0 - np.exp(-1.0 / self.scale)  # two-sided geometric, P(z) ~ exp(-|z| / scale)
            return values + self.rng.geometric(p, shape) - self.rng.geometric(p, shape)
        if self.noise == "laplace":
            return values + self.rng.laplace(0.0, self.scale, shape)
        noise = self.rng.normal(0.0, self.scale, shape)
        return values + (np.rint(noise).astype(np.int64) if self.atom == "i64" else noise)


def seeded_measurement(seed: int = 0):
    """A stand-in for sage_tfx.mechanisms.additive._measurement: the same privacy accounting,
    noise from SeededNoise drawn from one numpy generator seeded with `seed`."""
    from sage_tfx.mechanisms import additive

    real = additive._measurement.__wrapped__
    rng = np.random.default_rng(seed)

    def measurement(noise, atom, size, scale, k, sensitivity):
        _, privacy = real(noise, atom, size, scale, k, sensitivity)
        return SeededNoise(noise, atom, scale, rng), privacy
    return measurement
