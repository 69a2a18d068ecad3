import pytest


@pytest.fixture(autouse=True, scope="session")
def _strategy_cache(tmp_path_factory):
    """The matrix tests keep their strategies in a session directory, not the user's ~/.cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("SAGE_TFX_CACHE", str(tmp_path_factory.mktemp("sage-tfx-cache")))
    yield
    patch.undo()
