import os

import numpy as np
import pytest

import sage_tfx  # noqa: F401  (sets TF_USE_LEGACY_KERAS before anything imports TensorFlow)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture
def store_path(tmp_path):
    """An SQLite ledger store (tests/sage_access overrides this to run on MariaDB too)."""
    return str(tmp_path / "ledger.sqlite")


@pytest.fixture(scope="session")
def mariadb_server(tmp_path_factory):
    """A throwaway MariaDB server for the session (tests/support/mariadb.py); the test skips,
    saying why, where mariadbd is not installed."""
    from support.mariadb import MariaDB, missing_reason

    reason = missing_reason()
    if reason:
        pytest.skip(f"no MariaDB server: {reason}")
    server = MariaDB(tmp_path_factory.mktemp("mariadb")).start()
    yield server
    server.stop()


@pytest.fixture
def mariadb_store(mariadb_server):
    """The `mysql://` spec of a new database (not created yet) on the session's MariaDB."""
    return mariadb_server.store()


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
