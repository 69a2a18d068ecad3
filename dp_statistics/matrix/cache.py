"""The durable strategy cache: selected strategies on disk (Eigen-Design, the convex optimum,
OPT_M, OPT_+), one .npz per (workload, options): the arrays a family needs to rebuild its strategy.

Strategy selection reads only the workload (its queries and declared domain, both public) and
the selection options, never a record, so a cached strategy and its file name reveal nothing
about any dataset: caching costs no privacy. A file is trusted only as far as it can be checked
(``load``): the stored fingerprint and options must equal the request's and every entry must be
finite, and the family's own rebuild checks the arrays' shapes against the workload
(strategy.disk_cached); anything else (a truncated, corrupt or foreign file) is recomputed and
overwritten, never used. Even a strategy
that passes these checks but was tampered with cannot weaken the guarantee: the mechanism
calibrates its noise to the loaded strategy's own column norms and refuses a strategy that does
not support the workload (mechanism.answer_workload). Writes are atomic (a temporary file in
the same directory, then os.replace), so a reader never sees half a file and concurrent
writers of the same key leave one whole file.

Directory: the ``directory`` argument, else $SAGE_TFX_CACHE/strategies, else
~/.cache/sage-tfx/strategies. SAGE_TFX_CACHE=off disables the disk cache.
"""
from __future__ import annotations

import dataclasses
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
_FORMAT = 2


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


@dataclasses.dataclass(frozen=True)
class Stored:
    """What a cache file holds: the family's arrays and the strategy's description."""
    arrays: dict
    name: str
    duality_gap: Optional[float]
    selection_seconds: float


def load(directory: str, workload: Workload, options: dict) -> Optional[Stored]:
    """The cached entry, or None when there is no file or it fails a check."""
    key, described = _key(workload, options)
    path = os.path.join(directory, f"{key}.npz")
    try:
        with np.load(path, allow_pickle=False) as stored:
            if str(stored["described"]) != described:
                return None
            arrays = {str(name): np.array(stored[str(name)], dtype=np.float64)
                      for name in stored["array_names"]}
            entry = Stored(arrays, str(stored["name"]), float(stored["duality_gap"]),
                           float(stored["selection_seconds"]))
    except (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile):
        return None
    if not arrays or not all(np.all(np.isfinite(a)) for a in arrays.values()):
        return None
    gap = entry.duality_gap
    return dataclasses.replace(entry, duality_gap=None if np.isnan(gap) else gap)


def store(directory: str, workload: Workload, options: dict, arrays: dict, strategy) -> None:
    """Write ``arrays`` (and ``strategy``'s name and certificate) atomically; a directory that
    cannot be written only costs the cache."""
    key, described = _key(workload, options)
    try:
        os.makedirs(directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{key}.", suffix=".npz", dir=directory)
    except OSError:
        return
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, described=np.array(described), name=np.array(strategy.name),
                     array_names=np.array(sorted(arrays)),
                     duality_gap=np.array(np.nan if strategy.duality_gap is None
                                          else strategy.duality_gap),
                     selection_seconds=np.array(strategy.selection_seconds), **arrays)
        os.replace(temporary, os.path.join(directory, f"{key}.npz"))
    except OSError:
        try:
            os.unlink(temporary)
        except OSError:
            pass
