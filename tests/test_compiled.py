"""sage_tfx.compiled.kernel: numba's disk cache where it can be written, else compiled in the
process (a read-only install and home directory)."""
import numba
import pytest
from numba.core import caching

from sage_tfx.compiled import kernel


def halved(x):
    return x / 2.0


def test_a_kernel_compiles_in_the_process_where_numba_has_no_writable_cache(monkeypatch):
    # What numba does when it finds no writable place for its cache (no locator accepts the
    # module): enabling the cache raises, at import, even for a kernel cached before.
    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", [])
    with pytest.raises(RuntimeError, match="no locator available"):
        numba.njit(numba.float64(numba.float64), cache=True)(halved)
    compiled = kernel(numba.float64(numba.float64))(halved)
    assert compiled(3.0) == 1.5
    assert compiled.signatures == [(numba.float64,)]  # compiled at import, not at a call


def test_a_kernel_is_cached_where_numba_can_write():
    compiled = kernel(numba.float64(numba.float64))(halved)
    assert compiled._cache is not None and compiled._cache.cache_path
    assert compiled(5.0) == 2.5
