import os

import pytest

import sage_tfx  # noqa: F401  (sets TF_USE_LEGACY_KERAS before anything imports TensorFlow)

from support.seeded_noise import seeded_measurement

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture
def umask_022():
    """The usual umask, under which a plain open or makedirs gives 0644 files and 0755
    directories, readable by every user (tests of private writes; support/private.py)."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


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
