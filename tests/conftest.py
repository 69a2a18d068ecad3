import os

import pytest

import sage_tfx  # noqa: F401  (sets TF_USE_LEGACY_KERAS before anything imports TensorFlow)

from support.seeded_noise import seeded_measurement

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "ledger.sqlite")


@pytest.fixture
def seeded_noise(monkeypatch):
    """Every sage_tfx.mechanisms release in this test draws from numpy seeded with 0, with the
    law, scale and privacy accounting of the OpenDP measurement it replaces."""
    from sage_tfx.mechanisms import additive

    monkeypatch.setattr(additive, "_measurement", seeded_measurement())


@pytest.fixture(scope="session")
def portable_runner():
    """Beam's portable runner with 2 SDK workers per job, each a separate process (the job
    service and the worker pool are started once per session; tests/support/portable_runner.py).
    Yields the PortableRunner; ``portable_runner.options()`` are the pipeline arguments."""
    from support.portable_runner import PortableRunner

    with PortableRunner(workers=2) as runner:
        yield runner
