"""One trigger of the DP-SQLP operator (design steps 1-7), vectorised over keys.

``step(state, budget, batch)`` consumes micro-batch t = state.step + 1, a DataFrame with columns
``unit``, ``key`` and (for SUM) ``value`` in arrival order, and returns the TriggerRelease of
trigger t. The per-key math is in functions of arrays (``kept_mask``, ``select_and_predict``,
``released_values``, ``start_rounds``, ``next_evaluation``) so that a Beam DoFn can call them
with one key's or one unit's state; ``step`` is the in-process composition of them over every
key at once.

Privacy (the design's argument, with the code that provides each part):

- Trees or the BLT factorization: the bullets below say "tree" for a key's noisy running sum;
  with StreamBudget.mechanism FACTORIZATION each is a stream of factorization.py's
  FactorizationIndex instead (the same interface: rows, noise_at, first_crossing), its
  sensitivities and thresholds derived in budget.py and factorization.py.
- Contribution bounding (``kept_mask``): a unit's first C records of the window are kept, in
  arrival order, and no other; a unit counts once per (key, round) (``PairTable.count_once``).
  Only kept records make a key appear: a dropped record (its unit past C) changes nothing.
- Selection trees: a unit adds 1 to one leaf of at most C (key, round) trees; with node noise
  sigma_s and H = ceil(log2(T + 1)) nodes per leaf that is rho_s = C H / (2 sigma_s^2)
  (budget.py, SelfComposedDpEvent of SingleEpochTreeAggregationDpEvent).
- Value trees: a unit's <= C records, |v| <= L after clamping (``clean_batch``), land in exactly
  one leaf each (the step of their key's next release): rho_v = H (C L)^2 / (2 sigma_v^2).
  Which leaf depends only on earlier outputs (adaptive composition).
- A key is selected at t iff its round count c > R(t - origin), R(l) = tau_l - Z(l) the round
  tree's data-independent required count; the release is the value tree's true prefix plus its
  Honaker noise Z_v(t) rounded to the grid: post-processing of the noisy trees.
- Thresholding's coupling (paper Thm 3.1): this operator differs from one that tracks a round-1
  tree for every key of the universe from step 1 only if one of a unit's <= C keys crosses its
  threshold before it first appears (probability <= beta each, tau's union over T). Every later
  round is followed from its start by prediction (``select_and_predict``, Algorithm 4), so a key
  without new records is evaluated exactly at its predicted step, as the full scan would.
- The last trigger is the window's final pane: every key released before is woken there
  (``next_evaluation``) and releases its buffer too. Which keys is public, and a
  record still lands in exactly one value-tree leaf, so the accounting is unchanged.
- Floating point: every kept value is a multiple of the grid and at most L
  (``StreamBudget.record_grid``), so the true prefix is exact in float64 and the release is a
  lattice point: no low-order bits carry data (keyed.py, "Floating point").
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import pandas as pd

from sage_tfx.dp_statistics.aggregation.aggregators import stable_argsort
from sage_tfx.dp_statistics.aggregation.local import numeric_column
from sage_tfx.dp_statistics.aggregation.spec import QueryError
from sage_tfx.dp_statistics.continual.budget import StreamBudget
from sage_tfx.dp_statistics.continual.spec import StreamStatistic
from sage_tfx.dp_statistics.continual.state import (CodeTable, PairTable, WindowState,
                                                    sorted_unique)
from sage_tfx.dp_statistics.continual.tree import NEVER, TreeIndex, round_to_grid
from sage_tfx.mechanisms.bounding import bounded
from sage_tfx.mechanisms.keyed import KeyedGaussian

BATCH_COLUMNS = ("unit", "key", "value")  # a micro-batch's columns (value only for SUM)
MAX_TREE_STREAM = 1 << 56  # keyed.KeyedGaussian's stream ids


@dataclasses.dataclass(frozen=True)
class TriggerRelease:
    """What trigger `step` releases: every key selected so far in the window with its latest
    noisy value (a key not released anew keeps its number: no fresh noise), sorted by key;
    `updated` marks the keys released at this step. All of it is DP output; nothing else leaves
    the operator."""
    step: int
    keys: np.ndarray
    values: np.ndarray
    updated: np.ndarray
    guarantee: str

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame({"key": self.keys, "value": self.values, "updated": self.updated})


def clean_batch(batch: pd.DataFrame, statistic: StreamStatistic, grid: float,
                bound: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(units, keys, values) of the records with a unit and a key; each a function of its
    record alone. COUNT: value 1. SUM: NaN/inf -> 0, clamped to [-bound, bound], on the grid."""
    missing = [column for column in BATCH_COLUMNS[:2] + (
        ("value",) if statistic is StreamStatistic.SUM else ()) if column not in batch]
    if missing:
        raise QueryError(f"a micro-batch needs columns {list(BATCH_COLUMNS)}, missing {missing}")
    units, keys = batch["unit"].to_numpy(), batch["key"].to_numpy()
    valid = _present(units) & _present(keys)
    if not valid.all():
        units, keys = units[valid], keys[valid]
    if statistic is StreamStatistic.COUNT:
        return units, keys, np.ones(len(units))
    values = bounded(numeric_column(batch, "value")[valid], -bound, bound)
    return units, keys, np.clip(round_to_grid(values, grid), -bound, bound)


def _present(column: np.ndarray) -> np.ndarray:
    """Which entries are not missing (pandas' notna); an integer or boolean column has none."""
    if column.dtype.kind in "iub":
        return np.ones(len(column), dtype=bool)
    return ~pd.isna(column)


def kept_mask(units: np.ndarray, used: np.ndarray, limit: int) -> np.ndarray:
    """Contribution bounding: which records to keep, given each record's unit (codes, in
    arrival order) and each unit's kept records so far (`used`, indexed by code): a unit's first
    `limit - used` records of this batch."""
    if len(units) == 0:
        return np.zeros(0, dtype=bool)
    order = stable_argsort(units)
    sorted_units = units[order]
    starts = np.r_[0, np.flatnonzero(sorted_units[1:] != sorted_units[:-1]) + 1]
    first_of_group = np.repeat(starts, np.diff(np.r_[starts, len(units)]))
    rank = np.empty(len(units), dtype=np.int64)
    rank[order] = np.arange(len(units)) - first_of_group
    return rank < limit - used[units]


def select_and_predict(selection: TreeIndex, noise: KeyedGaussian, rows: np.ndarray,
                       origins: np.ndarray, step: int,
                       counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Algorithms 2 and 4 for keys evaluated at `step` (their live round trees `rows`, begun
    after global step `origins`, with round counts `counts`): (selected, due), selected[i] iff
    counts > R(step - origin); due[i] the first later global step at which the count would
    cross with no new data (NEVER if none, or if selected: start_rounds predicts the next
    round)."""
    local = step - origins.astype(np.int64)
    first = selection.first_crossing(noise, rows, local - 1, counts)
    selected = first == local
    due = np.where(selected | (first == NEVER), NEVER, origins + first)
    return selected, due.astype(np.int64)


def released_values(values: TreeIndex, noise: KeyedGaussian, rows: np.ndarray, step: int,
                    released_true: np.ndarray, grid: float) -> np.ndarray:
    """Algorithm 3: each value tree's noisy prefix at leaf `step`, the true prefix (a grid
    multiple) plus its Honaker noise rounded to the grid."""
    noise_at = values.noise_at(noise, rows, np.full(len(rows), step, dtype=np.int64))
    return released_true + round_to_grid(noise_at, grid)


def first_rounds(selection: TreeIndex, noise: KeyedGaussian, key_codes: np.ndarray,
                 micro_batches: int) -> np.ndarray:
    """The rows of new keys' round-1 selection trees (over the whole window: it starts at step
    0, before the key's first record)."""
    return selection.add(noise, tree_ids(key_codes, np.ones(len(key_codes)), micro_batches),
                         np.full(len(key_codes), micro_batches))


def start_rounds(selection: TreeIndex, noise: KeyedGaussian, key_codes: np.ndarray,
                 rounds: np.ndarray, step: int,
                 micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
    """New selection rounds `rounds` of keys `key_codes` begun after `step` (one tree each over
    the steps left): their rows and predicted release steps with no data (count 0), NEVER if
    none or the window is over (a key selected at the last step has no next round, and no
    noise stream is named for it: round T + 1 would be key + 1's value stream)."""
    if step >= micro_batches or len(key_codes) == 0:
        return np.full(len(key_codes), -1, np.int64), np.full(len(key_codes), NEVER, np.int64)
    ids = tree_ids(key_codes, rounds, micro_batches)
    rows = selection.add(noise, ids, np.full(len(ids), micro_batches - step))
    first = selection.first_crossing(noise, rows, np.zeros(len(rows), np.int64),
                                     np.zeros(len(rows)))
    return rows, np.where(first == NEVER, NEVER, step + first).astype(np.int64)


def tree_ids(key_codes: np.ndarray, rounds: np.ndarray, micro_batches: int) -> np.ndarray:
    """The noise stream of key `key_codes[i]`'s tree: its value tree for round 0, the selection
    tree of round r >= 1 (r <= T: a round begins at most once per step). Injective, so every
    tree gets its own noise, and a function of the key's code and round alone, so an engine
    that evaluates keys apart (beam.py, one key per DoFn call) draws the same noise as `step`
    without a global tree counter. Key codes are dense, in order of first appearance."""
    key_codes = np.asarray(key_codes, dtype=np.uint64)
    rounds = np.asarray(rounds, dtype=np.uint64)
    if len(rounds) and int(rounds.max()) > micro_batches:
        raise ValueError(f"selection round {int(rounds.max())} of a window of {micro_batches} "
                         "micro-batches: a round begins at most once per step")
    span = np.uint64(micro_batches + 1)
    if len(key_codes) and int(key_codes.max()) >= MAX_TREE_STREAM // (micro_batches + 1):
        raise QueryError(f"more than {MAX_TREE_STREAM // (micro_batches + 1)} keys in one "
                         f"window of {micro_batches} micro-batches (noise streams are 56 bits)")
    return key_codes * span + rounds


def next_evaluation(due: np.ndarray, released: np.ndarray, step: int,
                    micro_batches: int) -> np.ndarray:
    """When to evaluate a key after `step`: its predicted crossing, or, for a key already
    released (a public fact), at the latest the window's last trigger, whose release is the
    window's final pane: every key released before releases its buffered records there too.
    Which keys is public and each record still lands in exactly one value-tree leaf, so the
    value trees' rho is unchanged; it removes the lag of records that arrived after a key's
    last selection."""
    final = released & (due == NEVER) & (step < micro_batches)
    return np.where(final, micro_batches, due).astype(np.int64)


def sum_by_code(codes: np.ndarray, weights: Optional[np.ndarray] = None):
    """(distinct codes, per-code sum of weights or count), codes sorted."""
    if weights is None:
        return np.unique(codes, return_counts=True)
    distinct, inverse = np.unique(codes, return_inverse=True)
    return distinct, np.bincount(inverse, weights=weights, minlength=len(distinct))


def bound_contributions(units: CodeTable, used: np.ndarray, unit_values: np.ndarray,
                        limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Design step 1 on a table of units (all of a window's, or one shard's: beam.py): each
    record's unit code, which records are kept (``kept_mask``: the unit's first C of the
    window, `unit_values` in arrival order) and ``used`` (kept records per unit code,
    capacity-grown) counting them."""
    unit_codes = units.encode(unit_values)
    if len(units) > len(used):
        grown = np.zeros(max(len(units), 2 * len(used), 1024), np.int32)
        grown[:len(used)] = used
        used = grown
    keep = kept_mask(unit_codes, used, limit)
    kept_units, kept_counts = sum_by_code(unit_codes[keep])
    used[kept_units] += kept_counts.astype(np.int32)
    return unit_codes, keep, used


def evaluate_keys(columns: dict[str, np.ndarray], selection: TreeIndex, values: TreeIndex,
                  noise: KeyedGaussian, evaluated: np.ndarray, t: int, micro_batches: int,
                  grid: float, codes: Optional[np.ndarray] = None) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """Design steps 3-6 at trigger `t` for the key rows `evaluated` (sorted, distinct) of
    per-key `columns` (state.KEY_COLUMNS, their `count` and `buffer` already holding step t's
    records) and their trees: selection, release, new rounds and prediction. `codes[row]` is a
    row's key code, the one its noise streams are named by (tree_ids); None: the row is the
    code (the local engine's one table; beam.py's stage 4 holds one shard's keys). Returns the
    rows released at t and each evaluated row's next evaluation step (also in `due`)."""
    def code(rows: np.ndarray) -> np.ndarray:
        return rows if codes is None else codes[rows]

    selected, due = select_and_predict(selection, noise, columns["selection_row"][evaluated],
                                       columns["origin"][evaluated], t,
                                       columns["count"][evaluated])
    chosen = evaluated[selected]
    without_value_tree = chosen[columns["value_row"][chosen] < 0]
    columns["value_row"][without_value_tree] = values.add(
        noise, tree_ids(code(without_value_tree), np.zeros(len(without_value_tree)),
                        micro_batches),
        np.full(len(without_value_tree), micro_batches))
    # The final pane: at the last trigger every key released before releases too
    # (next_evaluation woke them all).
    flushed = (evaluated[~selected & (columns["value_row"][evaluated] >= 0)]
               if t == micro_batches else evaluated[:0])
    releasing = sorted_unique(np.concatenate([chosen, flushed]))
    columns["released_true"][releasing] += columns["buffer"][releasing]
    columns["released_value"][releasing] = released_values(
        values, noise, columns["value_row"][releasing], t,
        columns["released_true"][releasing], grid)
    columns["buffer"][releasing] = 0.0
    columns["round"][chosen] += 1
    columns["origin"][chosen] = t
    columns["count"][chosen] = 0
    rows, due[selected] = start_rounds(selection, noise, code(chosen), columns["round"][chosen],
                                       t, micro_batches)
    columns["selection_row"][chosen] = rows
    due = next_evaluation(due, columns["value_row"][evaluated] >= 0, t, micro_batches)
    columns["due"][evaluated] = due
    return releasing, due


def step(state: WindowState, budget: StreamBudget, batch: pd.DataFrame) -> TriggerRelease:
    """Run micro-batch state.step + 1 (design steps 1-7) and return its release."""
    query = state.query
    if budget != state.budget:
        raise QueryError("the budget is not the one this window's state was planned with")
    t = state.step + 1
    if t > query.micro_batches:
        raise QueryError(f"the window has {query.micro_batches} micro-batches; all have run")
    noise = KeyedGaussian(state.noise_key)
    grid, bound = budget.record_grid
    units, keys, values = clean_batch(batch, query.statistic, grid, bound)

    # 1. Contribution bounding over the window.
    unit_codes, keep, state.used = bound_contributions(state.units, state.used, units,
                                                       query.contribution_limit)
    unit_codes, keys, values = unit_codes[keep], keys[keep], values[keep]

    # 2-3. Only kept records make a key appear; a new key's round-1 tree starts at step 0.
    known = state.n_keys
    key_codes = state.keys.encode(keys)
    new_keys = state.add_keys(state.n_keys - known)
    state.columns["selection_row"][new_keys] = first_rounds(state.selection, noise, new_keys,
                                                            query.micro_batches)
    touched, sums = sum_by_code(key_codes, values)
    state.columns["buffer"][touched] += sums
    pairs = sorted_unique(PairTable.pair_codes(unit_codes, key_codes))
    pair_keys = pairs & 0xFFFFFFFF
    fresh = state.pairs.count_once(pairs, state.columns["round"][pair_keys])
    counted, new_users = sum_by_code(pair_keys[fresh])
    state.columns["count"][counted] += new_users

    # 3-6. Evaluate the keys with kept records and the keys predicted to cross at t.
    evaluated = sorted_unique(np.concatenate([touched, state.take_due(t)]))
    releasing, due = evaluate_keys(state.columns, state.selection, state.values, noise,
                                   evaluated, t, query.micro_batches, grid)
    state.schedule(evaluated, due)
    state.step = t

    # 7. The release: every key selected so far, with its last noisy value, in key order (the
    # code order is the order keys first appeared in: data that one record can change).
    released = np.flatnonzero(~np.isnan(state.column("released_value")))
    if state.release_order is None or len(state.release_order) != len(released):
        # A released key stays released: the sorted order changes only when keys are added.
        state.release_order = released[state.keys.sort_order(released)]
    released = state.release_order
    updated = np.zeros(state.n_keys, dtype=bool)
    updated[releasing] = True
    return TriggerRelease(t, state.keys.values[released],
                          state.column("released_value")[released], updated[released],
                          state.guarantee().sentence())
