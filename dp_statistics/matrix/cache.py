"""The durable strategy cache: Eigen-Design results on disk, one .npz per (workload, options).

Strategy selection reads only the workload (its queries and declared domain, both public) and
the selection options, never a record, so a cached strategy and its file name reveal nothing
about any dataset: caching costs no privacy. A file is trusted only as far as it can be checked
(``load``): the stored fingerprint and options must equal the request's, the factors' cell
counts must match the workload's domain, and every entry must be finite; anything else (a
truncated, corrupt or foreign file) is recomputed and overwritten, never used. Even a strategy
that passes these checks but was tampered with cannot weaken the guarantee: the mechanism
calibrates its noise to the loaded strategy's own column norms and refuses a strategy that does
not support the workload (mechanism.answer_workload). Writes are atomic (a temporary file in
the same directory, then os.replace), so a reader never sees half a file and concurrent
writers of the same key leave one whole file.

Directory: the ``directory`` argument, else $SAGE_TFX_CACHE/strategies, else
~/.cache/sage-tfx/strategies. SAGE_TFX_CACHE=off disables the disk cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from typing import Optional

import numpy as np

from sage_tfx.dp_statistics.matrix.workload import Workload

CACHE_ENVIRONMENT_VARIABLE = "SAGE_TFX_CACHE"
# Bump when a change of the selection would make old files wrong for the same key.
_FORMAT = 1


def cache_directory(directory: Optional[str] = None) -> Optional[str]:
    """Where strategies are kept (module docstring); None when the disk cache is off."""
    if directory:
        return directory
    root = os.environ.get(CACHE_ENVIRONMENT_VARIABLE)
    if root == "off":
        return None
    if root:
        return os.path.join(root, "strategies")
    return os.path.join(os.path.expanduser("~"), ".cache", "sage-tfx", "strategies")


def _key(workload: Workload, options: dict) -> tuple[str, str]:
    described = json.dumps({"format": _FORMAT, "workload": workload.fingerprint,
                            "options": options}, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest(), described


def load(directory: str, workload: Workload, options: dict):
    """The cached (factors, name, duality_gap, selection_seconds), or None when there is no
    file or it fails a check."""
    key, described = _key(workload, options)
    path = os.path.join(directory, f"{key}.npz")
    try:
        with np.load(path, allow_pickle=False) as stored:
            if str(stored["described"]) != described:
                return None
            count = int(stored["factor_count"])
            factors = [np.array(stored[f"factor_{i}"], dtype=np.float64) for i in range(count)]
            name = str(stored["name"])
            gap = float(stored["duality_gap"])
            seconds = float(stored["selection_seconds"])
    except (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile):
        return None
    cells = tuple(f.shape[1] if f.ndim == 2 else -1 for f in factors)
    if cells not in (workload.sizes, (workload.cells,)) or not all(
            f.ndim == 2 and f.shape[0] > 0 and np.all(np.isfinite(f)) for f in factors):
        return None
    return factors, name, (None if np.isnan(gap) else gap), seconds


def store(directory: str, workload: Workload, options: dict, strategy) -> None:
    """Write the strategy atomically; a directory that cannot be written only costs the cache."""
    key, described = _key(workload, options)
    try:
        os.makedirs(directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{key}.", suffix=".npz", dir=directory)
    except OSError:
        return
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, described=np.array(described), name=np.array(strategy.name),
                     factor_count=np.array(len(strategy.factors)),
                     duality_gap=np.array(np.nan if strategy.duality_gap is None
                                          else strategy.duality_gap),
                     selection_seconds=np.array(strategy.selection_seconds),
                     **{f"factor_{i}": f for i, f in enumerate(strategy.factors)})
        os.replace(temporary, os.path.join(directory, f"{key}.npz"))
    except OSError:
        try:
            os.unlink(temporary)
        except OSError:
            pass
