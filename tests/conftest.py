import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "ledger.sqlite")
