import os

import numpy as np
import pytest

import sage_tfx  # noqa: F401  (sets TF_USE_LEGACY_KERAS before anything imports TensorFlow)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "ledger.sqlite")


class _SeededNoise:
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


@pytest.fixture
def seeded_noise(monkeypatch):
    """Every sage_tfx.mechanisms release in this test draws from numpy seeded with 0, with the
    law, scale and privacy accounting of the OpenDP measurement it replaces."""
    from sage_tfx.mechanisms import additive

    real = additive._measurement.__wrapped__
    rng = np.random.default_rng(0)

    def measurement(noise, atom, size, scale, k, sensitivity):
        _, privacy = real(noise, atom, size, scale, k, sensitivity)
        return _SeededNoise(noise, atom, scale, rng), privacy

    monkeypatch.setattr(additive, "_measurement", measurement)


@pytest.fixture(scope="session")
def portable_runner():
    """Beam's portable runner with 2 SDK workers per job, each a separate process (the job
    service and the worker pool are started once per session; tests/support/portable_runner.py).
    Yields the PortableRunner; ``portable_runner.options()`` are the pipeline arguments."""
    from support.portable_runner import PortableRunner

    with PortableRunner(workers=2) as runner:
        yield runner
