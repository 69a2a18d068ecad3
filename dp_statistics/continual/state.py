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
- the noise key (a tree's noise stream is operator.tree_ids of its key's code and round), the
  last committed step and the grant.

Storage (``save``/``load``) is one ``.npz`` written to a temporary file and renamed over the old
one (os.replace is atomic), with the scalars as JSON inside it; no pickle. The selection
streams' summaries are not in it: a pure function of the noise key and each stream's id and
length, they are recomputed on load for the live rounds. Between two saves the
``Journal`` keeps the micro-batches the state took after the saved step and which of them were
committed (local.py), and ``pin_tokens`` the random values the ledger pins per trigger
(release.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import struct
import zipfile
import zlib
from typing import Iterable, Optional, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
from pandas._libs import hashtable

from sage_tfx.dp_statistics.aggregation.spec import QueryError
from sage_tfx.dp_statistics.continual.budget import StreamBudget
from sage_tfx.dp_statistics.continual.tree import NEVER, TreeIndex
from sage_tfx.dp_statistics.continual.spec import StreamQuery
from sage_tfx.mechanisms.keyed import KeyedGaussian
from sage_tfx.private_files import open_private, private_directory

STATE_FILE = "state.npz"
JOURNAL_FILE = "journal.jsonl"
TAKEN_LOG = "taken.log"  # the micro-batches of the steps after the saved one
PIN_TOKENS_FILE = "pin_tokens.json"
_FORMAT = 6  # 2: strings as UTF-8 bytes and offsets; 3: no micro-batch digests; 4: taken.log;
# 5: the selection streams' summaries recomputed on load, not stored; 6: the factorization's
# column-normalised noise (n + 2 states per stream)


class StreamStateError(RuntimeError):
    """The durable state refuses to go on: it names what is inconsistent and what to do."""


class CodeTable:
    """Values (unit ids or keys) -> dense codes 0, 1, ... in order of first appearance.

    Integer values (or integral floats: a column with a missing value is float) go through a C
    hash table (Int64Map), vectorised; any other value switches the table to pandas' C hash
    table of Python objects (the one under factorize: equality as a dict's), vectorised too."""

    def __init__(self, values: Optional[np.ndarray] = None):
        values = np.asarray(values if values is not None else [], dtype=object)
        self._values = values
        self._size = len(values)
        integers = _as_int64(values)
        self._ints: Optional[Int64Map] = Int64Map(integers) if integers is not None else None
        self._objects = None if integers is not None else _object_table(values)

    def __len__(self) -> int:
        return self._size

    @property
    def values(self) -> np.ndarray:
        return self._values[:self._size]

    def encode(self, values) -> np.ndarray:
        """The codes of `values`, adding the ones never seen (in order of first appearance)."""
        inverse, uniques = pd.factorize(np.asarray(values), use_na_sentinel=False)
        uniques = np.asarray(uniques)
        integers = _as_int64(uniques) if self._ints is not None else None
        if self._ints is not None and integers is None and len(uniques):
            self._objects = _object_table(self.values)
            self._ints = None
        if self._ints is not None:
            codes = self._ints.lookup(integers)
            new = np.flatnonzero(codes < 0)
            codes[new] = self._ints.insert(integers[new])
        else:
            uniques = uniques.astype(object)
            codes = self._objects.lookup(uniques)
            new = np.flatnonzero(codes < 0)
            all_strings = pd.api.types.infer_dtype(uniques[new], skipna=False) in (
                "string", "empty") and (not self._size or isinstance(self._values[0], str))
            kinds = {"string"} if all_strings else {_kind(v) for v in uniques[new].tolist()} | (
                {_kind(self._values[0])} if self._size else set())
            if len(kinds) > 1 or kinds - {"number", "string", "bool"}:
                raise QueryError(f"unit and key values must be all numbers, all strings or all "
                                 f"booleans "
                                 f"(they are stored without pickle); this stream mixes "
                                 f"{sorted(kinds)}, e.g. {uniques[new][:3].tolist()}")
            codes[new] = self._objects.get_labels(uniques[new], hashtable.ObjectVector(),
                                                  self._size, -1)
        if len(new):
            # Integers are kept as integers (an integral float key is released as an integer,
            # the same before and after a restart).
            added = integers[new] if self._ints is not None else uniques[new]
            self._values = _grown(self._values, self._size, added.astype(object))
            self._size += len(new)
        return codes[inverse]

    def __reduce__(self):
        """Pickled as its values (the hash table is rebuilt): beam.py keeps tables in Beam
        state, which a runner encodes."""
        return CodeTable, (self.values,)

    def sort_order(self, codes: np.ndarray) -> np.ndarray:
        """The permutation of `codes` that sorts their values, as pd.Index(values).argsort()
        (the values are distinct, so there is one). An integer table sorts its values as
        int64: the same order (integers compare as their int64), 10x faster than pandas'
        argsort of Python objects (70 against 690 us for 3,000 keys, at every step that
        releases a key for the first time)."""
        values = self._values[codes]
        if self._ints is not None:
            return np.argsort(values.astype(np.int64))
        return np.asarray(pd.Index(values).argsort(), dtype=np.int64)

    def to_arrays(self, what: str) -> dict[str, np.ndarray]:
        """The values as pickle-free arrays named `what`_values: integers, floats or booleans
        as such; strings as their UTF-8 bytes (`what`_utf8) and offsets (`what`_offsets,
        n + 1 of them), so every string round-trips exactly. (A fixed-width numpy string array
        would strip trailing NULs, making "u\\x00" a new unit with nothing used after a
        reload, and would take longest-id bytes per entry.)"""
        kind = pd.api.types.infer_dtype(self.values, skipna=False)
        if kind == "string":
            try:  # Arrow's large_string: int64 offsets and the UTF-8 bytes, built in C
                strings = pa.array(self.values, pa.large_string())
            except (pa.ArrowException, UnicodeError) as error:
                raise StreamStateError(f"{what} values must be valid Unicode text to be "
                                       f"stored: {error}") from None
            _, offsets, data = strings.buffers()
            offsets = np.frombuffer(offsets, np.int64, len(strings) + 1)
            return {f"{what}_offsets": offsets.copy(), f"{what}_utf8": np.frombuffer(
                data if data is not None else b"", np.uint8, offsets[-1]).copy()}
        typed = {"empty": np.int64, "integer": np.int64, "floating": np.float64,
                 "mixed-integer-float": np.float64, "boolean": bool}.get(kind)
        if typed is None:
            raise StreamStateError(f"{what} values must be all integers, all numbers or all "
                                   f"strings to be stored; pandas infers {kind!r}")
        return {f"{what}_values": self.values.astype(typed)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], what: str) -> "CodeTable":
        """The table `to_arrays(what)` stored."""
        if f"{what}_values" in arrays:
            return cls(arrays[f"{what}_values"].astype(object))
        offsets = arrays[f"{what}_offsets"]
        strings = pa.LargeStringArray.from_buffers(
            len(offsets) - 1, pa.py_buffer(offsets.tobytes()),
            pa.py_buffer(arrays[f"{what}_utf8"].tobytes()))
        return cls(strings.to_numpy(zero_copy_only=False).astype(object))


def _object_table(values: np.ndarray) -> "hashtable.PyObjectHashTable":
    """pandas' C hash table from each of the distinct `values` to its position."""
    table = hashtable.PyObjectHashTable(max(len(values), 1024))
    table.map_locations(np.asarray(values, dtype=object))
    return table


class Int64Map:
    """int64 -> dense slot (0, 1, ... in insertion order), vectorised: pandas' C hash table
    (khash; the engine under pd.Index and factorize), used directly because pd.Index would have
    to be rebuilt whenever a micro-batch adds entries. pandas is pinned (requirements/lock.txt);
    the continual tests exercise every method used here."""

    def __init__(self, values: Optional[np.ndarray] = None):
        self._table = hashtable.Int64HashTable(1024)
        self._size = 0
        if values is not None and len(values):
            self.insert(np.asarray(values, np.int64))

    def __len__(self) -> int:
        return self._size

    def lookup(self, values: np.ndarray) -> np.ndarray:
        """The slot of each value, -1 if absent."""
        return self._table.lookup(np.ascontiguousarray(values, dtype=np.int64))

    def insert(self, values: np.ndarray) -> np.ndarray:
        """Add distinct values not present; returns their slots."""
        slots = np.arange(self._size, self._size + len(values), dtype=np.int64)
        self._table.map_keys_to_values(np.ascontiguousarray(values, dtype=np.int64), slots)
        self._size += len(values)
        return slots


class PairTable:
    """(unit code, key code) -> the last round the unit was counted for the key: a hash table
    from the pair's code to a slot, and the round of each slot."""

    def __init__(self, codes: Optional[np.ndarray] = None, rounds: Optional[np.ndarray] = None):
        self._slots = Int64Map(codes)
        self._codes = np.array(codes if codes is not None else [], dtype=np.int64)
        self._rounds = np.array(rounds if rounds is not None else [], dtype=np.int32)

    @staticmethod
    def pair_codes(units: np.ndarray, keys: np.ndarray) -> np.ndarray:
        return (units.astype(np.int64) << 32) | keys.astype(np.int64)

    def __len__(self) -> int:
        return len(self._slots)

    def count_once(self, codes: np.ndarray, rounds: np.ndarray) -> np.ndarray:
        """For distinct pair `codes` whose key is in round `rounds`: True where the unit was not
        yet counted for the key in that round; records them all as counted in it."""
        return self.replace(codes, rounds) != rounds

    def replace(self, codes: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Store `values` for the distinct pair `codes`; returns what each held before (-1 for
        a pair never stored). (beam.py's stage 1 stores the last step a unit kept a record of
        a key, where the local engine stores the last round it was counted in.)"""
        slots = self._slots.lookup(codes)
        seen = slots >= 0
        previous = np.full(len(codes), -1, dtype=np.int64)
        previous[seen] = self._rounds[slots[seen]]
        self._rounds[slots[seen]] = values[seen]
        new = ~seen
        if new.any():
            size = len(self._slots)
            self._slots.insert(codes[new])
            self._codes = _grown(self._codes, size, codes[new])
            self._rounds = _grown(self._rounds, size, values[new])
        return previous

    def __reduce__(self):
        """Pickled as its arrays (pandas' hash table is rebuilt): beam.py keeps tables in Beam
        state, which a runner encodes."""
        return PairTable, self.to_arrays()

    def to_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        size = len(self._slots)
        return self._codes[:size], self._rounds[:size]


def _kind(value) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
            value, (bool, np.bool_)):
        return "number"
    return "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__


def _as_int64(values: np.ndarray) -> Optional[np.ndarray]:
    """`values` as int64 if they are all integers (or integral floats), else None."""
    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    if values.dtype.kind in "fO" and len(values):
        try:
            floats = values.astype(np.float64)
        except (TypeError, ValueError):
            return None
        if values.dtype.kind == "O" and not all(isinstance(v, (int, float, np.integer,
                                                              np.floating)) for v in values):
            return None
        if np.all(np.isfinite(floats)) and np.all(floats == np.round(floats)) and np.all(
                np.abs(floats) < 2.0 ** 53):
            return floats.astype(np.int64)
        return None
    return np.zeros(0, np.int64) if len(values) == 0 else None


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique(values) for a 1-d integer array, by a sort and a mask: numpy 2.4's bare
    np.unique (and union1d) of a few thousand int64 takes a hash-table path 7x slower (170
    against 23 us at 2,000 values), called several times per step. (With return_counts it
    sorts, as fast as this.)"""
    values = np.sort(values)
    first = np.empty(len(values), dtype=bool)
    first[:1] = True
    np.not_equal(values[1:], values[:-1], out=first[1:])
    return values[first]


def _grown(array: np.ndarray, size: int, appended: np.ndarray) -> np.ndarray:
    """`array` (its first `size` entries live) with `appended` after them, capacity doubled as
    needed (amortised O(1) per entry)."""
    needed = size + len(appended)
    if needed > len(array):
        grown = np.zeros(max(needed, 2 * len(array), 1024), dtype=array.dtype)
        if array.dtype == object:
            grown[:] = None
        grown[:size] = array[:size]
        array = grown
    array[size:needed] = appended
    return array


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
    step: int = 0                    # the last micro-batch computed into this state
    grant_id: Optional[str] = None
    blocks: tuple = ()
    charge_started: bool = False
    due_index: dict = dataclasses.field(default_factory=dict)  # step -> [key code arrays]
    release_order: Optional[np.ndarray] = None  # released key codes sorted by key (a cache)

    @classmethod
    def fresh(cls, query: StreamQuery, budget: StreamBudget, noise_key: bytes) -> "WindowState":
        check_budget(query, budget)
        return cls(query, budget, bytes(noise_key), CodeTable(), np.zeros(0, np.int32),
                   PairTable(), CodeTable(), key_columns(0), budget.index(selection=True),
                   budget.index(selection=False))

    def guarantee(self, for_tests: bool = False):
        """The Guarantee every release of this window states, with the mechanism that runs;
        `for_tests`: the grant's ledger was created for tests."""
        return self.query.guarantee(self.blocks, self.grant_id, self.budget.statement, for_tests)

    @property
    def n_keys(self) -> int:
        return len(self.keys)

    def column(self, name: str) -> np.ndarray:
        """The live part (one entry per key code) of a per-key column; a view."""
        return self.columns[name][:len(self.keys)]

    def add_keys(self, count: int) -> np.ndarray:
        """Room for `count` keys just coded; returns their codes (columns at their defaults)."""
        first = len(self.keys) - count
        self.columns = grown_key_columns(self.columns, first, len(self.keys))
        return np.arange(first, len(self.keys))

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
        codes = sorted_unique(np.concatenate(entries))
        return codes[self.column("due")[codes] == step]

    # ------------------------------------------------------------------ storage
    def save(self, directory: str) -> None:
        """Write the whole state atomically to `directory`/state.npz (readable by the owner
        only: it holds the noise key and raw counts)."""
        write_state(directory, self.snapshot())

    def snapshot(self) -> dict[str, np.ndarray]:
        """What `save` writes: the state's arrays, copied (no array shares memory with the
        state, so a save may be written while later steps change it: local.py)."""
        pair_codes, pair_rounds = self.pairs.to_arrays()
        meta = {"format": _FORMAT, "query": self.query.to_json(),
                "budget": dataclasses.asdict(self.budget),
                "step": self.step, "grant_id": self.grant_id,
                "blocks": list(self.blocks), "charge_started": self.charge_started}
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                  "noise_key": np.frombuffer(self.noise_key, dtype=np.uint8),
                  "used": self.used[:len(self.units)],
                  **self.units.to_arrays("unit"), **self.keys.to_arrays("key"),
                  "pair_codes": pair_codes, "pair_rounds": pair_rounds}
        arrays.update({f"key_{name}": self.column(name) for name in KEY_COLUMNS})
        # The selection streams' summaries are recomputed on load (TreeIndex.rebuilt): most of
        # the state's bytes (38 of 64 MB at 20,000 keys and T = 1,000), written at every save.
        selection = self.selection.to_arrays()
        arrays.update({f"selection_{n}": selection[n] for n in ("tree_ids", "lengths")})
        arrays.update({f"values_{n}": a for n, a in self.values.to_arrays().items()})
        # (A C-ordered copy of each: the same bytes written, _write_npz.)
        return {name: np.array(array, order="C") for name, array in arrays.items()}

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
        units, keys = CodeTable.from_arrays(arrays, "unit"), CodeTable.from_arrays(arrays, "key")
        n_keys = len(keys)
        columns = key_columns(n_keys)
        for name in KEY_COLUMNS:
            columns[name][:] = arrays[f"key_{name}"]

        noise_key = arrays["noise_key"].tobytes()
        values = budget.index(False, {n[len("values_"):]: a for n, a in arrays.items()
                                      if n.startswith("values_")})
        # Only the live rounds' selection streams are read again (the keys' selection_row).
        live = columns["selection_row"][:n_keys]
        selection = budget.index(True).rebuilt(
            KeyedGaussian(noise_key), arrays["selection_tree_ids"],
            arrays["selection_lengths"], live[live >= 0])
        state = cls(query, budget, noise_key,
                    units, np.array(arrays["used"], np.int32),
                    PairTable(arrays["pair_codes"], arrays["pair_rounds"]), keys, columns,
                    selection, values,
                    step=meta["step"],
                    grant_id=meta["grant_id"], blocks=tuple(meta["blocks"]),
                    charge_started=meta["charge_started"])
        state.schedule(np.arange(n_keys), state.column("due").astype(np.int64))
        return state


def write_state(directory: str, arrays: dict[str, np.ndarray]) -> None:
    """Write a WindowState.snapshot atomically to `directory`/state.npz: a temporary file,
    synced, renamed over the old one, the directory synced."""
    private_directory(directory)
    path = os.path.join(directory, STATE_FILE)
    temporary = f"{path}.tmp-{os.getpid()}"
    with open_private(temporary) as out:
        _write_npz(out, arrays)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
    sync_directory(directory)


def _write_npz(out, arrays: dict[str, np.ndarray]) -> None:
    """np.savez(out, **arrays) without its copy of every array: savez writes a zip member by
    tobytes() chunks (a copy of the state's tens of MB at each save), this writes each array's
    memory as it is. The same bytes for the C-ordered arrays of plain dtypes the state holds
    (a Fortran-ordered one is written C-ordered: other bytes, the same array on load); an
    array of Python objects, which savez would pickle, is refused."""
    with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED,
                         allowZip64=True) as archive:
        for name, array in arrays.items():
            if array.dtype.hasobject:
                raise ValueError(f"state array {name!r} holds Python objects: not saved")
            # (np.ascontiguousarray would make a 0-d array 1-d: other bytes than savez's)
            array = array if array.flags.c_contiguous else array.copy(order="C")
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(
                    member, np.lib.format.header_data_from_array_1_0(array))
                member.write(memoryview(array.reshape(-1)).cast("B"))


def key_columns(capacity: int) -> dict[str, np.ndarray]:
    return {name: np.full(capacity, fill, dtype=dtype)
            for name, (dtype, fill) in KEY_COLUMNS.items()}


def grown_key_columns(columns: dict[str, np.ndarray], size: int,
                      needed: int) -> dict[str, np.ndarray]:
    """`columns` (their first `size` rows live) with room for `needed` rows, the new ones at
    their defaults (capacity doubled as needed)."""
    capacity = len(columns["round"])
    if needed <= capacity:
        return columns
    grown = key_columns(max(needed, 2 * capacity, 1024))
    for name, array in columns.items():
        grown[name][:size] = array[:size]
    return grown


def check_budget(query: StreamQuery, budget: StreamBudget) -> None:
    """The budget must be the plan of this query's parameters (the state pins both)."""
    expected = (query.epsilon, query.delta, query.micro_batches, query.contribution_limit,
                query.value_bound)
    got = (budget.epsilon, budget.delta, budget.micro_batches, budget.contribution_limit,
           budget.value_bound)
    if query.mechanism not in ("auto", budget.mechanism):
        raise StreamStateError(f"the budget was planned for the {budget.mechanism} mechanism, "
                               f"the query says {query.mechanism}")
    if expected != got:
        raise StreamStateError(f"the budget was planned for (epsilon, delta, micro_batches, "
                               f"contribution_limit, value_bound) = {got}, the query says "
                               f"{expected}")


class Journal:
    """What the state took after its saved step (state.npz at step `snapshot`), in two
    append-only files:

    - journal.jsonl: line 1 {"snapshot": s}, then {"commit": t} once step t's release was
      written. A line is one write() of a complete JSON object, so a crash leaves at most a torn
      last line, which is ignored (a commit never made: the restart recomputes and rewrites that
      release from the taken micro-batch, the same bits).
    - taken.log: per step t > s the micro-batch t was computed from, one entry each (a header
      with the step, the length and the CRC-32 of an Arrow IPC stream of the micro-batch, then
      the stream). The micro-batches taken together (local.py takes up to `take_ahead` the
      input already holds) are written after the previous entries with one write() and synced
      once, before the first of them is computed. The entries end at the first header or
      payload that does not check (a torn entry: the process died inside take(), before any
      step of that write was computed), which is cut off when the journal is opened; the
      complete entries before it are taken steps like any other (none was released).

    A step is *taken* once its entry is in taken.log: from then on it is computed from that
    micro-batch only, whatever input a later run brings (records that arrive for it later are
    late data, local.py), so a recomputed step has the same bits. `fsync`: a taken micro-batch
    reaches the disk before its release is written, so even after a power cut no release exists
    whose micro-batch the state does not hold (False survives a crash of the process only).

    Why one log rather than a file per step (the earlier layout): a step then costs one write
    and one fdatasync, where a file per step cost a create, an fsync, a rename and, at the next
    save, an unlink, the last three metadata operations each as slow as the fsync on a loaded
    disk (a 1,000-step window spent 3 s only removing files). The log is extended with zeros
    (synced) ahead of its entries, doubling up to LOG_CHUNK bytes at a time, so an entry
    overwrites allocated blocks and fdatasync has no metadata to commit (measured: 1.4-1.9 ms against 2.6-4 ms for
    an append). A save writes the log afresh with the entries it keeps (at most one per
    save, not per step): overwriting old entries in place instead would leave stale bytes
    after the new ones, and those bytes include records (a record's bytes could read as a
    well-formed entry for a later step). The guarantee is the same: each entry is on the disk
    before its step is computed.
    """

    _HEADER = struct.Struct("<4sqqI")  # magic, step, payload length, CRC-32 of the payload
    _MAGIC = b"TKN1"
    LOG_CHUNK = 1 << 22

    def __init__(self, directory: str, state: WindowState, fsync: bool = True):
        self.directory = directory
        self.path = os.path.join(directory, JOURNAL_FILE)
        self.log_path = os.path.join(directory, TAKEN_LOG)
        self.fsync = fsync
        self.snapshot = state.step
        self.committed = state.step
        lines = _complete_lines(self.path)
        if lines and lines[0]["snapshot"] > state.step:
            raise StreamStateError(f"{self.path} continues a state saved at step "
                                   f"{lines[0]['snapshot']}, but {STATE_FILE} is at step "
                                   f"{state.step}: the state directory was tampered with")
        # A journal older than the saved state (the process died after a save was written and
        # before `saved` started the journal from it: local.py writes saves while later steps
        # run) still tells which later steps were committed: a commit line is written only
        # after its release, and taken.log keeps every entry after the journal's snapshot
        # until `saved` rewrites both (the journal first), so those steps' micro-batches are
        # there.
        if lines:
            self.committed = max([state.step] + [line["commit"] for line in lines[1:]])
        # The saved state holds steps <= state.step: their micro-batches are not needed.
        self._entries = {step: payload for step, payload in self._read_log()
                         if step > state.step}
        missing = [step for step in range(state.step + 1, self.committed + 1)
                   if step not in self._entries]
        if missing:
            raise StreamStateError(f"{self.directory}: step {missing[0]} was released but the "
                                   "micro-batch it was computed from is gone: the state "
                                   "directory was tampered with")
        self._out = None
        self._log = None
        self._rewrite()  # drops a torn last line
        self._rewrite_log()  # drops a torn last entry and the steps the state holds

    def taken(self, step: int) -> Optional[pd.DataFrame]:
        """The micro-batch step `step` was computed from, if this state took it."""
        payload = self._entries.get(step)
        if payload is None:
            return None
        return pa.ipc.open_stream(payload).read_all().to_pandas()

    def take(self, batches: Sequence[tuple[int, pd.DataFrame]]) -> None:
        """Keep each (step, micro-batch) of `batches` as that step's micro-batch: their entries
        appended with one write and, if `fsync`, one sync, before any of them is computed."""
        if not batches:
            return
        payloads = [(step, _ipc_payload(batch)) for step, batch in batches]
        entries = b"".join(self._HEADER.pack(self._MAGIC, step, len(payload),
                                             zlib.crc32(payload)) + payload
                           for step, payload in payloads)
        end = self._log_end + len(entries)
        size = os.fstat(self._log).st_size
        if end > size:
            # Grow geometrically up to LOG_CHUNK at a time: a log written afresh by a save (each
            # step, in a live window saved every step) does not pay LOG_CHUNK of zeros per step.
            grow = max(end - size, min(self.LOG_CHUNK, size))
            os.pwrite(self._log, bytes(grow), size)
            if self.fsync:
                os.fsync(self._log)  # the new size and blocks, once per chunk
        os.pwrite(self._log, entries, self._log_end)
        if self.fsync:
            _sync_data(self._log)
        self._log_end = end
        self._entries.update(payloads)

    def commit(self, step: int) -> None:
        self._out.write(json.dumps({"commit": step}) + "\n")
        self._out.flush()
        self.committed = step

    def saved(self, step: int) -> None:
        """The state was saved at `step` (<= committed): start the journal from there."""
        self.snapshot = step
        self._rewrite()
        # Entries <= step are in the saved state: the log keeps only the later ones.
        self._entries = {taken: payload for taken, payload in self._entries.items()
                         if taken > step}
        self._rewrite_log()

    def _read_log(self) -> list[tuple[int, bytes]]:
        """The complete entries of taken.log, in order (a torn or corrupt tail ends it)."""
        if not os.path.exists(self.log_path):
            return []
        with open(self.log_path, "rb") as source:
            data = source.read()
        entries, offset, size = [], 0, self._HEADER.size
        while offset + size <= len(data):
            magic, step, length, crc = self._HEADER.unpack_from(data, offset)
            payload = data[offset + size:offset + size + length]
            if magic != self._MAGIC or len(payload) != length or zlib.crc32(payload) != crc:
                break
            entries.append((step, payload))
            offset += size + length
        return entries

    def _rewrite_log(self) -> None:
        """Write taken.log afresh (atomically) with the entries kept, and open it to append."""
        self._close_log()
        temporary = f"{self.log_path}.tmp-{os.getpid()}"
        with open_private(temporary) as out:
            for step, payload in sorted(self._entries.items()):
                out.write(self._HEADER.pack(self._MAGIC, step, len(payload),
                                            zlib.crc32(payload)) + payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.log_path)
        sync_directory(self.directory)
        self._log = os.open(self.log_path, os.O_WRONLY)
        self._log_end = os.fstat(self._log).st_size

    def _rewrite(self) -> None:
        self._close_journal()
        lines = [{"snapshot": self.snapshot}] + [
            {"commit": step} for step in range(self.snapshot + 1, self.committed + 1)]
        write_json_lines(self.path, lines)
        self._out = open(self.path, "a")

    def _close_journal(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def _close_log(self) -> None:
        if self._log is not None:
            os.close(self._log)
            self._log = None

    def close(self) -> None:
        self._close_journal()
        self._close_log()


# fdatasync where the platform has it (Linux): the data without the inode's times.
_sync_data = getattr(os, "fdatasync", os.fsync)


def pin_tokens(directory: str, steps: Iterable[int]) -> dict[int, str]:
    """The value the ledger pins for each of `steps` in this state directory (release.py):
    a random 256-bit token drawn the first time the step is asked for and kept here (synced)
    before it is returned, so a restart in this directory pins the same value again, and any
    other copy of the state draws another. Drawn, never computed from the data: a reader of the
    ledger learns nothing from it (not even which micro-batches were empty or equal)."""
    path = os.path.join(directory, PIN_TOKENS_FILE)
    lines = _complete_lines(path)
    tokens = {int(step): token for step, token in (lines[0] if lines else {}).items()}
    missing = [step for step in steps if step not in tokens]
    if missing:
        tokens.update({step: secrets.token_hex(32) for step in missing})
        private_directory(directory)
        write_json_lines(path, [{str(step): token for step, token in sorted(tokens.items())}])
    return {step: tokens[step] for step in steps}


def _ipc_payload(batch: pd.DataFrame) -> bytes:
    """`batch` as an Arrow IPC stream (Journal.taken reads it back). A frame of numpy integer,
    float and boolean columns goes to Arrow column by column, as Table.from_pandas converts
    them (NaN as null) and reads back the same frame, without its per-call overhead (a
    benchmark's micro-batches); any other frame through Table.from_pandas."""
    sink = pa.BufferOutputStream()
    # (Each column's dtype, not batch.dtypes: that builds a Series, 30 us a micro-batch.)
    if batch.columns.is_unique and all(isinstance(name, str) for name in batch.columns) and all(
            isinstance(batch[name].dtype, np.dtype) and batch[name].dtype.kind in "iufb"
            for name in batch.columns):
        table = pa.table({name: pa.array(batch[name].to_numpy(), from_pandas=True)
                          for name in batch.columns})
    else:
        table = pa.Table.from_pandas(batch, preserve_index=False)
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _complete_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as source:
        text = source.read()
    # Only newline-terminated lines were written whole.
    return [json.loads(line) for line in text.split("\n")[:-1]]


def write_json_lines(path: str, lines: list) -> None:
    """Write `path` atomically (temporary file, fsync, rename), readable by the owner only."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open_private(temporary, "w") as out:
        out.write("".join(json.dumps(line) + "\n" for line in lines))
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
    sync_directory(os.path.dirname(path) or ".")


def sync_directory(directory: str) -> None:
    """fsync a directory, so a rename into it is on the disk before what follows: the log's
    in-place writes (fdatasync) commit no metadata, and POSIX does not order an earlier
    rename before them."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
