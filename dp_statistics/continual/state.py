"""The operator's private state for one window, and its durable, atomic storage.

Everything here is private (it holds raw counts and the noise key): only ``operator.step``'s
TriggerRelease leaves the operator. Tables are numpy arrays indexed by dense codes:

- units: the unit code table and, per unit, ``used`` (kept records so far, <= C);
- pairs: per (unit, key) the last round in which the unit was counted for the key;
- keys: the key code table and per key ``round``, ``origin`` (the global step after which the
  round began), ``count`` (distinct units in the round), ``buffer`` (sum of kept values not yet
  released), ``released_true``, ``released_value`` (NaN until first released), ``due`` (the
  predicted step of its next release without new data, or NEVER), ``selection_row`` (its live
  selection tree in ``selection``) and ``value_row`` (its value tree in ``values``, -1 before its
  first release: a key never selected never pays for a value tree);
- the noise key, the next tree id, the last committed step, the grant and the digests of the
  micro-batches the state has consumed.

Storage (``save``/``load``) is one ``.npz`` written to a temporary file and renamed over the old
one (os.replace is atomic), with the scalars as JSON inside it; no pickle. The pending-digest
protocol of the design's "Durability" section is ``write_pending``/``read_pending`` (local.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Optional

import numpy as np
import pandas as pd

from sage_tfx.dp_statistics.continual._standin import NEVER, StreamBudget, TreeIndex
from sage_tfx.dp_statistics.continual.spec import StreamQuery

STATE_FILE = "state.npz"
PENDING_FILE = "pending.json"
_FORMAT = 1


class StreamStateError(RuntimeError):
    """The durable state refuses to go on: it names what is inconsistent and what to do."""


class CodeTable:
    """Values (unit ids or keys) -> dense codes 0, 1, ... in order of first appearance.

    Lookups are vectorised through a pandas Index over the values coded before its last rebuild;
    values coded since go through a dict, and the Index is rebuilt once the dict holds half as
    many (amortised linear in the number of values)."""

    def __init__(self, values: Optional[np.ndarray] = None):
        self._values = np.asarray(values if values is not None else [], dtype=object)
        self._size = len(self._values)
        self._rebuild()

    def _rebuild(self) -> None:
        self._index = pd.Index(self._values[:self._size])
        self._recent: dict = {}

    def __len__(self) -> int:
        return self._size

    @property
    def values(self) -> np.ndarray:
        return self._values[:self._size]

    def encode(self, values) -> np.ndarray:
        """The codes of `values`, adding the ones never seen (in order of first appearance)."""
        inverse, uniques = pd.factorize(np.asarray(values), use_na_sentinel=False)
        uniques = np.asarray(uniques, dtype=object)
        codes = self._index.get_indexer(uniques).astype(np.int64)
        missing = np.flatnonzero(codes < 0)
        if len(missing):
            recent = self._recent
            found = [recent.get(v, -1) for v in uniques[missing].tolist()]
            codes[missing] = found
            new = missing[np.asarray(found, dtype=np.int64) < 0]
            if len(new):
                fresh = np.arange(self._size, self._size + len(new))
                codes[new] = fresh
                self._append(uniques[new])
                recent.update(zip(uniques[new].tolist(), fresh.tolist()))
                if len(recent) > max(4096, len(self._index) // 2):
                    self._rebuild()
        return codes[inverse]

    def _append(self, values: np.ndarray) -> None:
        needed = self._size + len(values)
        if needed > len(self._values):
            grown = np.empty(max(needed, 2 * len(self._values), 1024), dtype=object)
            grown[:self._size] = self._values[:self._size]
            self._values = grown
        self._values[self._size:needed] = values
        self._size = needed

    def to_array(self, what: str) -> np.ndarray:
        """The values as a pickle-free array: integers, floats or strings."""
        kind = pd.api.types.infer_dtype(self.values, skipna=False)
        typed = {"empty": np.int64, "integer": np.int64, "floating": np.float64,
                 "mixed-integer-float": np.float64, "string": str}.get(kind)
        if typed is None:
            raise StreamStateError(f"{what} values must be all integers, all numbers or all "
                                   f"strings to be stored; pandas infers {kind!r}")
        return self.values.astype(typed)


class PairTable:
    """(unit code, key code) -> the last round the unit was counted for the key.

    A log-structured set of sorted runs (each pair lives in exactly one run): a micro-batch's
    pairs are looked up by binary search in every run, updated in place, and the new ones form
    a new run; runs are merged while the newest is at least half the size of the one before
    (binary-counter merging: each pair is re-sorted O(log n) times over the window)."""

    def __init__(self, codes: Optional[np.ndarray] = None, rounds: Optional[np.ndarray] = None):
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []
        if codes is not None and len(codes):
            order = np.argsort(codes, kind="stable")
            self._runs.append((np.asarray(codes, np.int64)[order],
                               np.asarray(rounds, np.int32)[order]))

    @staticmethod
    def pair_codes(units: np.ndarray, keys: np.ndarray) -> np.ndarray:
        return (units.astype(np.int64) << 32) | keys.astype(np.int64)

    def __len__(self) -> int:
        return sum(len(codes) for codes, _ in self._runs)

    def count_once(self, codes: np.ndarray, rounds: np.ndarray) -> np.ndarray:
        """For distinct pair `codes` whose key is in round `rounds`: True where the unit was not
        yet counted for the key in that round; records them all as counted in it."""
        previous = np.full(len(codes), -1, dtype=np.int64)
        seen = np.zeros(len(codes), dtype=bool)
        for run_codes, run_rounds in self._runs:
            at = np.minimum(np.searchsorted(run_codes, codes), len(run_codes) - 1)
            hit = run_codes[at] == codes
            previous[hit] = run_rounds[at[hit]]
            run_rounds[at[hit]] = rounds[hit]
            seen |= hit
        if not seen.all():
            new = ~seen
            order = np.argsort(codes[new], kind="stable")
            self._runs.append((codes[new][order], rounds[new].astype(np.int32)[order]))
            while len(self._runs) > 1 and 2 * len(self._runs[-1][0]) >= len(self._runs[-2][0]):
                (a_codes, a_rounds), (b_codes, b_rounds) = self._runs[-2], self._runs.pop()
                merged = np.concatenate([a_codes, b_codes])
                order = np.argsort(merged, kind="stable")
                self._runs[-1] = (merged[order], np.concatenate([a_rounds, b_rounds])[order])
        return previous != rounds

    def to_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._runs:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        return (np.concatenate([c for c, _ in self._runs]),
                np.concatenate([r for _, r in self._runs]))


# Per-key columns: name -> (dtype, value of a key never seen).
KEY_COLUMNS = {"round": (np.int32, 1), "origin": (np.int32, 0), "count": (np.int64, 0),
               "buffer": (np.float64, 0.0), "released_true": (np.float64, 0.0),
               "released_value": (np.float64, np.nan), "due": (np.int32, NEVER),
               "selection_row": (np.int64, -1), "value_row": (np.int64, -1)}


@dataclasses.dataclass
class WindowState:
    """One window's private operator state (module docstring)."""
    query: StreamQuery
    budget: StreamBudget
    noise_key: bytes
    units: CodeTable
    used: np.ndarray                 # per unit code, kept records (capacity-grown)
    pairs: PairTable
    keys: CodeTable
    columns: dict[str, np.ndarray]   # KEY_COLUMNS, per key code (capacity-grown)
    selection: TreeIndex             # selection trees (with thresholds), rows of live rounds
    values: TreeIndex                # value trees, one per key released at least once
    next_tree: int = 0
    step: int = 0                    # the last micro-batch computed into this state
    digests: list = dataclasses.field(default_factory=list)  # sha256 of micro-batches 1..step
    grant_id: Optional[str] = None
    blocks: tuple = ()
    charge_started: bool = False
    due_index: dict = dataclasses.field(default_factory=dict)  # step -> [key code arrays]

    @classmethod
    def fresh(cls, query: StreamQuery, budget: StreamBudget, noise_key: bytes) -> "WindowState":
        check_budget(query, budget)
        length = query.micro_batches
        return cls(query, budget, bytes(noise_key), CodeTable(), np.zeros(0, np.int32),
                   PairTable(), CodeTable(), _key_columns(0),
                   TreeIndex.empty(budget.selection_sigma, length, budget.thresholds()),
                   TreeIndex.empty(budget.value_sigma, length))

    @property
    def n_keys(self) -> int:
        return len(self.keys)

    def column(self, name: str) -> np.ndarray:
        """The live part (one entry per key code) of a per-key column; a view."""
        return self.columns[name][:len(self.keys)]

    def add_keys(self, count: int) -> np.ndarray:
        """Room for `count` keys just coded; returns their codes (columns at their defaults)."""
        first = len(self.keys) - count
        needed = len(self.keys)
        capacity = len(self.columns["round"])
        if needed > capacity:
            grown = _key_columns(max(needed, 2 * capacity, 1024))
            for name, array in self.columns.items():
                grown[name][:first] = array[:first]
            self.columns = grown
        return np.arange(first, needed)

    def grow_units(self) -> None:
        """Room in ``used`` for every coded unit (new units start at 0)."""
        needed = len(self.units)
        if needed > len(self.used):
            grown = np.zeros(max(needed, 2 * len(self.used), 1024), np.int32)
            grown[:len(self.used)] = self.used
            self.used = grown

    def new_tree_ids(self, count: int) -> np.ndarray:
        ids = np.arange(self.next_tree, self.next_tree + count, dtype=np.uint64)
        self.next_tree += count
        return ids

    def schedule(self, codes: np.ndarray, due: np.ndarray) -> None:
        """Index keys by predicted release step (Algorithm 4's secondary index). Entries are
        never removed: ``take_due`` keeps a key only if its ``due`` still says that step."""
        codes, due = codes[due != NEVER], due[due != NEVER]
        if len(codes) == 0:
            return
        order = np.argsort(due, kind="stable")
        codes, due = codes[order], due[order]
        starts = np.flatnonzero(np.r_[True, due[1:] != due[:-1]])
        for start, end in zip(starts, np.r_[starts[1:], len(due)]):
            self.due_index.setdefault(int(due[start]), []).append(codes[start:end])

    def take_due(self, step: int) -> np.ndarray:
        """The keys whose current prediction is `step`, removed from the index."""
        entries = self.due_index.pop(step, [])
        if not entries:
            return np.zeros(0, np.int64)
        codes = np.unique(np.concatenate(entries))
        return codes[self.column("due")[codes] == step]

    # ------------------------------------------------------------------ storage
    def save(self, directory: str) -> None:
        """Write the whole state atomically to `directory`/state.npz (readable by the owner
        only: it holds the noise key and raw counts)."""
        os.makedirs(directory, exist_ok=True)
        pair_codes, pair_rounds = self.pairs.to_arrays()
        meta = {"format": _FORMAT, "query": self.query.to_json(),
                "budget": dataclasses.asdict(self.budget), "next_tree": self.next_tree,
                "step": self.step, "digests": list(self.digests), "grant_id": self.grant_id,
                "blocks": list(self.blocks), "charge_started": self.charge_started}
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                  "noise_key": np.frombuffer(self.noise_key, dtype=np.uint8),
                  "unit_values": self.units.to_array("unit"),
                  "used": self.used[:len(self.units)],
                  "key_values": self.keys.to_array("key"),
                  "pair_codes": pair_codes, "pair_rounds": pair_rounds}
        arrays.update({f"key_{name}": self.column(name) for name in KEY_COLUMNS})
        arrays.update({f"selection_{n}": a for n, a in self.selection.to_arrays().items()})
        arrays.update({f"values_{n}": a for n, a in self.values.to_arrays().items()})
        path = os.path.join(directory, STATE_FILE)
        temporary = f"{path}.tmp-{os.getpid()}"
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            np.savez(out, **arrays)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)

    @classmethod
    def load(cls, directory: str) -> Optional["WindowState"]:
        """The state saved in `directory`, or None if there is none."""
        path = os.path.join(directory, STATE_FILE)
        if not os.path.exists(path):
            return None
        with np.load(path, allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in stored.files}
        meta = json.loads(arrays["meta"].tobytes().decode())
        if meta.get("format") != _FORMAT:
            raise StreamStateError(f"{path} is state format {meta.get('format')!r}; this "
                                   f"version reads format {_FORMAT}")
        query = StreamQuery.from_json(meta["query"])
        budget = StreamBudget(**meta["budget"])
        n_keys = len(arrays["key_values"])
        columns = _key_columns(n_keys)
        for name in KEY_COLUMNS:
            columns[name][:] = arrays[f"key_{name}"]

        def index(prefix: str, sigma: float, thresholds) -> TreeIndex:
            part = {n[len(prefix):]: a for n, a in arrays.items() if n.startswith(prefix)}
            return TreeIndex.from_arrays(sigma, query.micro_batches, thresholds, part)

        state = cls(query, budget, arrays["noise_key"].tobytes(),
                    CodeTable(arrays["unit_values"].astype(object)),
                    np.array(arrays["used"], np.int32),
                    PairTable(arrays["pair_codes"], arrays["pair_rounds"]),
                    CodeTable(arrays["key_values"].astype(object)), columns,
                    index("selection_", budget.selection_sigma, budget.thresholds()),
                    index("values_", budget.value_sigma, None),
                    next_tree=meta["next_tree"], step=meta["step"], digests=meta["digests"],
                    grant_id=meta["grant_id"], blocks=tuple(meta["blocks"]),
                    charge_started=meta["charge_started"])
        state.schedule(np.arange(n_keys), state.column("due").astype(np.int64))
        return state


def _key_columns(capacity: int) -> dict[str, np.ndarray]:
    return {name: np.full(capacity, fill, dtype=dtype)
            for name, (dtype, fill) in KEY_COLUMNS.items()}


def check_budget(query: StreamQuery, budget: StreamBudget) -> None:
    """The budget must be the plan of this query's parameters (the state pins both)."""
    expected = (query.epsilon, query.delta, query.micro_batches, query.contribution_limit,
                query.value_bound)
    got = (budget.epsilon, budget.delta, budget.micro_batches, budget.contribution_limit,
           budget.value_bound)
    if expected != got:
        raise StreamStateError(f"the budget was planned for (epsilon, delta, micro_batches, "
                               f"contribution_limit, value_bound) = {got}, the query says "
                               f"{expected}")


def batch_digest(batch: pd.DataFrame) -> str:
    """sha256 of a micro-batch's canonical content: column names, dtypes and pandas' 64-bit
    hash of every row in order (a changed row keeps its hash with probability 2^-64). Every
    empty micro-batch has the same digest, whatever its columns' dtypes."""
    digest = hashlib.sha256()
    if len(batch) == 0:
        return hashlib.sha256(b"empty micro-batch").hexdigest()
    digest.update(json.dumps([[str(c), str(t)] for c, t in batch.dtypes.items()]).encode())
    digest.update(pd.util.hash_pandas_object(batch, index=False).to_numpy().tobytes())
    return digest.hexdigest()


def write_pending(directory: str, step: int, digest: str) -> None:
    """Record, before step `step` runs, which micro-batch it is computed from."""
    write_json(os.path.join(directory, PENDING_FILE), {"step": step, "digest": digest})


def read_pending(directory: str) -> Optional[dict]:
    path = os.path.join(directory, PENDING_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as source:
        return json.load(source)


def clear_pending(directory: str) -> None:
    path = os.path.join(directory, PENDING_FILE)
    if os.path.exists(path):
        os.remove(path)


def write_json(path: str, content) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as out:
        json.dump(content, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
