import os

import pytest

import sage_tfx  # noqa: F401  (sets TF_USE_LEGACY_KERAS before anything imports TensorFlow)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "ledger.sqlite")
