"""STAND-IN until s19core (mechanisms/keyed.py, continual/tree.py, continual/budget.py) lands in
main: a copy of the lead's work in progress, deleted after `git merge main`."""
# flake8: noqa
from __future__ import annotations

import secrets

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_BYTES = 32
_WORD = np.dtype("<u8")


class KeyedGaussian:
    """Standard normal noise as a pure function of (secret key, stream id, counter)."""

    def __init__(self, key: bytes):
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"the noise key must be {KEY_BYTES} bytes")
        self._key = bytes(key)
        self._cipher = Cipher(algorithms.AES(self._key), modes.ECB())

    @classmethod
    def fresh(cls) -> "KeyedGaussian":
        """A new secret key from the OS CSPRNG (the only mode outside tests)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @property
    def key(self) -> bytes:
        """The secret key, for the operator's durable (private) state."""
        return self._key

    def normals(self, streams, counters) -> np.ndarray:
        """N(0, 1) for each (stream, counter) pair (broadcast); the same pair, the same value."""
        streams, counters = np.broadcast_arrays(np.asarray(streams, dtype=np.uint64),
                                                np.asarray(counters, dtype=np.uint64))
        shape = streams.shape
        blocks = np.empty((streams.size, 2), dtype=_WORD)
        blocks[:, 0] = streams.ravel()
        blocks[:, 1] = counters.ravel()
        encryptor = self._cipher.encryptor()
        words = np.frombuffer(encryptor.update(blocks.tobytes()) + encryptor.finalize(),
                              dtype=_WORD).reshape(-1, 2)
        # u1 in (0, 1] (log is finite), u2 in [0, 1): 53 random bits each.
        u1 = ((words[:, 0] >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53
        u2 = (words[:, 1] >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).reshape(shape)
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np


NEVER = 0  # "no release predicted" as a leaf/step number (leaves and steps start at 1)
BLOCK = 32  # leaves per stored block
_BLOCK_LEVELS = BLOCK.bit_length() - 1  # node levels strictly inside a block
_LEVEL_SHIFT = np.uint64(48)  # node counter = level << 48 | index at that level
_MAX_CELLS = 1 << 22  # cells of Z computed at once when building an index


def levels(length: int) -> int:
    """Levels of a tree over `length` leaves; also the number of nodes a leaf is in,
    ceil(log2(length + 1)), as dp-accounting's SingleEpochTreeAggregationDpEvent counts."""
    return max(int(length), 1).bit_length()


def honaker_variances(sigma: float, n_levels: int) -> np.ndarray:
    """var_h of a level-h node's Honaker estimate, h = 0..n_levels-1."""
    variances = np.empty(n_levels)
    variances[0] = sigma ** 2
    for h in range(1, n_levels):
        variances[h] = 1.0 / (1.0 / sigma ** 2 + 1.0 / (2.0 * variances[h - 1]))
    return variances


def prefix_std(length: int, sigma: float) -> np.ndarray:
    """lambda_l, the standard deviation of Z(l), for l = 1..length."""
    variances = honaker_variances(sigma, levels(length))
    ells = np.arange(1, length + 1)
    total = np.zeros(length)
    for h, variance in enumerate(variances):
        total += ((ells >> h) & 1) * variance
    return np.sqrt(total)


def _level_noise(noise: KeyedGaussian, tree_ids: np.ndarray, first_leaf: np.ndarray,
                 width: int, n_levels: int, sigma: float) -> list[np.ndarray]:
    """nu of the nodes inside leaves [first_leaf, first_leaf + width) (0-based, aligned to
    2^(n_levels-1)) of each tree: level h as an array (trees, width >> h)."""
    variances = honaker_variances(sigma, n_levels)
    nus: list[np.ndarray] = []
    for h in range(n_levels):
        count = width >> h
        index = (first_leaf[:, None] >> h) + np.arange(count, dtype=np.uint64)[None, :]
        own = sigma * noise.normals(tree_ids[:, None],
                                    (np.uint64(h) << _LEVEL_SHIFT) | index.astype(np.uint64))
        if h == 0:
            nus.append(own)
            continue
        below = nus[h - 1]
        weight = variances[h] / sigma ** 2
        nus.append(weight * own + (1.0 - weight) * (below[:, 0:2 * count:2]
                                                    + below[:, 1:2 * count:2]))
    return nus


def _decomposition_sum(nus: list[np.ndarray], ells: np.ndarray) -> np.ndarray:
    """Sum of nu over the dyadic decomposition of [1, l] for each l in `ells` (relative to the
    first leaf the levels were computed from): (trees, len(ells))."""
    total = np.zeros((nus[0].shape[0], len(ells)))
    for h, nu in enumerate(nus):
        has = ((ells >> h) & 1).astype(bool)
        if has.any():
            total[:, has] += nu[:, (ells[has] >> h) - 1]
    return total


def prefix_noise(noise: KeyedGaussian, tree_ids, length: int, sigma: float) -> np.ndarray:
    """Z(l) for l = 1..length of each tree: (len(tree_ids), length)."""
    tree_ids = np.asarray(tree_ids, dtype=np.uint64)
    nus = _level_noise(noise, tree_ids, np.zeros(len(tree_ids), dtype=np.uint64), length,
                       levels(length), sigma)
    return _decomposition_sum(nus, np.arange(1, length + 1))


@dataclass
class TreeIndex:
    """Per-tree block summaries of Z (and of R = tau - Z when `thresholds` are given), growable.

    Rows are trees; `tree_ids[row]` keys its noise, `lengths[row]` is its number of leaves.
    """
    sigma: float
    thresholds: Optional[np.ndarray]  # tau_l at index l - 1 (selection trees), else None
    n_blocks: int
    tree_ids: np.ndarray
    lengths: np.ndarray
    bases: np.ndarray  # (rows, n_blocks + 1): Z at leaves 0, BLOCK, 2 BLOCK, ... (0 at leaf 0)
    minima: Optional[np.ndarray]  # (rows, n_blocks): min of R over each block, +inf past the end
    size: int = 0

    @classmethod
    def empty(cls, sigma: float, max_length: int,
              thresholds: Optional[np.ndarray] = None) -> "TreeIndex":
        n_blocks = -(-max_length // BLOCK)
        return cls(sigma, None if thresholds is None else np.asarray(thresholds, float), n_blocks,
                   np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros((0, n_blocks + 1)),
                   None if thresholds is None else np.zeros((0, n_blocks)))

    def _reserve(self, extra: int) -> None:
        needed = self.size + extra
        if needed <= len(self.tree_ids):
            return
        capacity = max(needed, 2 * len(self.tree_ids), 1024)

        def grown(array: np.ndarray, fill) -> np.ndarray:
            out = np.full((capacity,) + array.shape[1:], fill, dtype=array.dtype)
            out[:self.size] = array[:self.size]
            return out
        self.tree_ids = grown(self.tree_ids, 0)
        self.lengths = grown(self.lengths, 0)
        self.bases = grown(self.bases, np.nan)
        if self.minima is not None:
            self.minima = grown(self.minima, np.inf)

    def add(self, noise: KeyedGaussian, tree_ids, lengths) -> np.ndarray:
        """Index new trees (computing their Z once); returns their rows."""
        tree_ids = np.asarray(tree_ids, dtype=np.uint64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(tree_ids) == 0:
            return np.zeros(0, np.int64)
        if lengths.min() < 1 or lengths.max() > self.n_blocks * BLOCK:
            raise ValueError("tree lengths must be between 1 and the window's micro-batches")
        self._reserve(len(tree_ids))
        rows = np.arange(self.size, self.size + len(tree_ids))
        self.size += len(tree_ids)
        self.tree_ids[rows], self.lengths[rows] = tree_ids, lengths
        longest = int(lengths.max())
        chunk = max(1, _MAX_CELLS // longest)
        for start in range(0, len(rows), chunk):
            part = slice(start, start + chunk)
            self._summarise(noise, rows[part], tree_ids[part], lengths[part], longest)
        return rows

    def _summarise(self, noise, rows, tree_ids, lengths, longest) -> None:
        # Z inside blocks is computed exactly as _block_noise recomputes it later (same node
        # noises, same order of additions), so the stored minima agree bit for bit with a scan.
        n_blocks = -(-longest // BLOCK)
        width = n_blocks * BLOCK
        nus = _level_noise(noise, tree_ids, np.zeros(len(rows), dtype=np.uint64), width,
                           levels(width), self.sigma)
        bases = np.full((len(rows), self.n_blocks + 1), np.nan)
        bases[:, 0] = 0.0
        boundaries = np.arange(BLOCK, width + 1, BLOCK)
        bases[:, 1:1 + n_blocks] = np.where(boundaries[None, :] > lengths[:, None], np.nan,
                                            _decomposition_sum(nus, boundaries))
        self.bases[rows] = bases
        if self.minima is None:
            return
        per_block = [nu.reshape(len(rows) * n_blocks, -1) for nu in nus[:_BLOCK_LEVELS]]
        inside = _decomposition_sum(per_block, np.arange(1, BLOCK)).reshape(
            len(rows), n_blocks, BLOCK - 1)
        z = np.concatenate([bases[:, :n_blocks, None] + inside,
                            bases[:, 1:n_blocks + 1, None]], axis=2).reshape(len(rows), width)
        leaves = np.arange(1, width + 1)[None, :]
        taus = self.thresholds[np.minimum(leaves, len(self.thresholds)) - 1]
        required = np.where(leaves > lengths[:, None], np.inf, taus - np.nan_to_num(z))
        self.minima[rows] = np.inf
        self.minima[rows, :n_blocks] = required.reshape(len(rows), n_blocks, BLOCK).min(axis=2)

    def _block_noise(self, noise, rows, blocks) -> np.ndarray:
        """Z(b * BLOCK + r) for r = 1..BLOCK of block b of each row: (len(rows), BLOCK)."""
        first_leaf = (blocks * BLOCK).astype(np.uint64)
        nus = _level_noise(noise, self.tree_ids[rows], first_leaf, BLOCK, _BLOCK_LEVELS,
                           self.sigma)
        inside = _decomposition_sum(nus, np.arange(1, BLOCK))
        out = np.empty((len(rows), BLOCK))
        out[:, :BLOCK - 1] = self.bases[rows, blocks][:, None] + inside
        out[:, BLOCK - 1] = self.bases[rows, blocks + 1]
        return out

    def noise_at(self, noise: KeyedGaussian, rows, leaves) -> np.ndarray:
        """Z(leaves[i]) of tree rows[i] (1 <= leaf <= its length)."""
        rows, leaves = np.asarray(rows, np.int64), np.asarray(leaves, np.int64)
        if len(rows) == 0:
            return np.zeros(0)
        if (leaves < 1).any() or (leaves > self.lengths[rows]).any():
            raise ValueError("a leaf outside its tree")
        blocks = (leaves - 1) // BLOCK
        values = self._block_noise(noise, rows, blocks)
        return values[np.arange(len(rows)), leaves - 1 - blocks * BLOCK]

    def _required(self, noise, rows, blocks) -> np.ndarray:
        """R over block b of each row, +inf past the tree's end: (len(rows), BLOCK)."""
        leaves = blocks[:, None] * BLOCK + np.arange(1, BLOCK + 1)[None, :]
        inside = leaves <= self.lengths[rows][:, None]
        taus = self.thresholds[np.minimum(leaves, len(self.thresholds)) - 1]
        z = self._block_noise(noise, rows, blocks)
        return np.where(inside, taus - np.nan_to_num(z), np.inf)

    def first_crossing(self, noise: KeyedGaussian, rows, after, counts) -> np.ndarray:
        """The first leaf l > after[i] of tree rows[i] with counts[i] > R(l), i.e. where the
        noisy count with no further data would pass the threshold; NEVER if none."""
        if self.minima is None:
            raise ValueError("this index has no thresholds")
        rows = np.asarray(rows, np.int64)
        after = np.asarray(after, np.int64)
        counts = np.asarray(counts, np.float64)
        result = np.full(len(rows), NEVER, dtype=np.int64)
        first_open = after // BLOCK  # the block holding leaf after + 1
        block_numbers = np.arange(self.n_blocks)[None, :]
        candidates = ((self.minima[rows] < counts[:, None])
                      & (block_numbers >= first_open[:, None]))
        # At most two exact scans: the first candidate block may cross only at leaves <= after.
        for _ in range(2):
            todo = np.flatnonzero(candidates.any(axis=1) & (result == NEVER))
            if len(todo) == 0:
                break
            blocks = candidates[todo].argmax(axis=1)
            required = self._required(noise, rows[todo], blocks)
            leaves = blocks[:, None] * BLOCK + np.arange(1, BLOCK + 1)[None, :]
            crossing = (counts[todo][:, None] > required) & (leaves > after[todo][:, None])
            found = crossing.any(axis=1)
            result[todo[found]] = leaves[found, crossing[found].argmax(axis=1)]
            candidates[todo, blocks] = False
        return result

    def to_arrays(self) -> dict[str, np.ndarray]:
        arrays = {"tree_ids": self.tree_ids[:self.size], "lengths": self.lengths[:self.size],
                  "bases": self.bases[:self.size]}
        if self.minima is not None:
            arrays["minima"] = self.minima[:self.size]
        return arrays

    @classmethod
    def from_arrays(cls, sigma: float, max_length: int, thresholds: Optional[np.ndarray],
                    arrays: dict[str, np.ndarray]) -> "TreeIndex":
        index = cls.empty(sigma, max_length, thresholds)
        size = len(arrays["tree_ids"])
        index.tree_ids = np.array(arrays["tree_ids"], dtype=np.uint64)
        index.lengths = np.array(arrays["lengths"], dtype=np.int64)
        index.bases = np.array(arrays["bases"], dtype=np.float64).reshape(size, -1)
        if thresholds is not None:
            index.minima = np.array(arrays["minima"], dtype=np.float64).reshape(size, -1)
        index.size = size
        return index


def value_grid(value_sigma: float) -> float:
    """The power of two released values are rounded to: about sigma / 1024, so rounding costs
    nothing in accuracy, and data (rounded per record to the grid) plus noise rounded to the grid
    is computed exactly in float64: the release is x + grid * round(Z / grid), a shifted lattice
    with no data-dependent low-order bits (keyed.py, "Floating point")."""
    return 2.0 ** math.floor(math.log2(value_sigma) - 10)


def round_to_grid(values, grid: float) -> np.ndarray:
    return np.round(np.asarray(values, dtype=np.float64) / grid) * grid
import math
from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event, mechanism_calibration
from dp_accounting.rdp import RdpAccountant
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy.stats import norm


CONVERSION_DELTA_SHARE = 2.0 / 3.0  # of delta for the zCDP -> (eps, delta) conversion


def _accountant() -> RdpAccountant:
    """dp-accounting accounts tree aggregation only under REPLACE_SPECIAL (one record replaced
    by a record that contributes zero). Removing a unit from the stream is exactly that here:
    its leaf contributions become zero while the trees' shape and the trigger times are public,
    so add-or-remove-one-unit (the ledger's relation) gets the same bound."""
    return RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)


@dataclass(frozen=True)
class StreamBudget:
    """Everything the operator needs to spend one window's (epsilon, delta)."""
    epsilon: float
    delta: float
    micro_batches: int
    contribution_limit: int
    value_bound: float
    selection_share: float
    selection_sigma: float
    value_sigma: float
    beta: float

    @property
    def conversion_delta(self) -> float:
        return self.delta * CONVERSION_DELTA_SHARE

    @property
    def additional_delta(self) -> float:
        """The delta thresholding spends outside the DpEvent: (e^eps + 1) C beta."""
        return (math.exp(self.epsilon) + 1.0) * self.contribution_limit * self.beta

    @property
    def event(self) -> dp_event.DpEvent:
        return _events(self.micro_batches, self.contribution_limit, self.value_bound,
                       self.selection_sigma, self.value_sigma)

    @property
    def value_grid(self) -> float:
        return value_grid(self.value_sigma)

    def thresholds(self) -> np.ndarray:
        """tau_l for l = 1..T (index l - 1): P(Z(l) > tau_l) = beta / T."""
        return (prefix_std(self.micro_batches, self.selection_sigma)
                * norm.isf(self.beta / self.micro_batches))

    def achieved_epsilon(self) -> float:
        """Epsilon of the event at the conversion delta, from dp-accounting."""
        return _accountant().compose(self.event).get_epsilon(self.conversion_delta)


def _events(micro_batches: int, contribution_limit: int, value_bound: float,
            selection_sigma: float, value_sigma: float) -> dp_event.DpEvent:
    selection = dp_event.SelfComposedDpEvent(
        dp_event.SingleEpochTreeAggregationDpEvent(selection_sigma, micro_batches),
        contribution_limit)
    values = dp_event.SingleEpochTreeAggregationDpEvent(
        value_sigma / (contribution_limit * value_bound), micro_batches)
    return dp_event.ComposedDpEvent([selection, values])


def _check(epsilon, delta, micro_batches, contribution_limit, value_bound,
           selection_share) -> None:
    problems = []
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        problems.append(f"epsilon must be a positive number, got {epsilon!r}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        problems.append(f"delta must be in (0, 1), got {delta!r}")
    if not (isinstance(micro_batches, int) and micro_batches >= 1):
        problems.append(f"micro_batches must be a positive integer, got {micro_batches!r}")
    if not (isinstance(contribution_limit, int) and contribution_limit >= 1):
        problems.append(f"contribution_limit must be a positive integer, got "
                        f"{contribution_limit!r}")
    if not (isinstance(value_bound, (int, float)) and math.isfinite(value_bound)
            and value_bound > 0):
        problems.append(f"value_bound must be a positive number, got {value_bound!r}")
    if not (isinstance(selection_share, float) and 0 < selection_share < 1):
        problems.append(f"selection_share must be a float in (0, 1), got {selection_share!r}")
    if problems:
        raise ValueError("; ".join(problems))


def plan(epsilon: float, delta: float, micro_batches: int, contribution_limit: int,
         value_bound: float = 1.0, selection_share: float = 0.5) -> StreamBudget:
    """Calibrate both trees' noise to (epsilon, delta) for a window of `micro_batches` triggers."""
    _check(epsilon, delta, micro_batches, contribution_limit, value_bound, selection_share)
    depth = levels(micro_batches)
    # With scale k: rho_s = share / k^2 and rho_v = (1 - share) / k^2, so rho = 1 / k^2.
    selection_unit = math.sqrt(contribution_limit * depth / (2.0 * selection_share))
    value_unit = contribution_limit * value_bound * math.sqrt(
        depth / (2.0 * (1.0 - selection_share)))

    def event(scale: float) -> dp_event.DpEvent:
        return _events(micro_batches, contribution_limit, value_bound,
                       scale * selection_unit, scale * value_unit)

    conversion_delta = delta * CONVERSION_DELTA_SHARE
    scale = mechanism_calibration.calibrate_dp_mechanism(
        _accountant, event, epsilon, conversion_delta,
        mechanism_calibration.LowerEndpointAndGuess(1e-6, 1.0), tol=1e-9)
    # brentq returns a root within tol; step up until the event provably meets epsilon.
    while _accountant().compose(event(scale)).get_epsilon(conversion_delta) > epsilon:
        scale *= 1.0 + 1e-9
    beta = delta * (1.0 - CONVERSION_DELTA_SHARE) / (
        (math.exp(epsilon) + 1.0) * contribution_limit)
    return StreamBudget(float(epsilon), float(delta), micro_batches, contribution_limit,
                        float(value_bound), selection_share, scale * selection_unit,
                        scale * value_unit, beta)
