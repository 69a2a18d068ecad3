"""DP binary trees with Honaker's variance reduction, vectorised over many trees (paper §2.2).

One tree per (key, round) for key selection (Algorithm 2) and one per key for the released values
(Algorithm 3). A tree over leaves l = 1..n (one leaf per micro-batch) has a node for every dyadic
interval ((i * 2^h), (i + 1) * 2^h] inside [1, n]; node (h, i) gets data + N(0, sigma^2), its noise
drawn by mechanisms.keyed from (tree id, node id), so the tree is a pure function of the secret
key and the data.

Bottom-up Honaker estimate of a node (the paper's eq. 1; tensorflow-privacy's
EfficientTreeAggregator):
    var_0 = sigma^2,   var_h = 1 / (1 / sigma^2 + 1 / (2 var_{h-1}))
    est(node) = w_h (data + n) + (1 - w_h) (est(left) + est(right)),   w_h = var_h / sigma^2
est is unbiased with variance var_h, and its noise part
    nu(node) = w_h n + (1 - w_h) (nu(left) + nu(right))
does not depend on the data. The released prefix at leaf l is the sum of the estimates of the
dyadic decomposition of [1, l] (one node per set bit h of l: node (h, (l >> h) - 1)), so
    prefix(l) = true prefix(l) + Z(l),   Z(l) = sum of those nu,
    Var Z(l) = lambda_l^2 = sum of their var_h.
That is what makes Algorithm 4 cheap: a key's future without new data is known from Z alone.

What is stored per tree (TreeIndex): Z at block boundaries (every BLOCK leaves) and, for
selection trees, the minimum over each block of the required count R(l) = tau_l - Z(l); a value
inside a block is recomputed from the block's 2 * BLOCK - 2 keyed node noises. BLOCK is a power of
two, so a block is a tree node and Z(b * BLOCK + r) = Z(b * BLOCK) + (the block's own prefix at r)
for r < BLOCK: nodes above the block level only enter through Z at its start.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from sage_tfx.mechanisms.keyed import KeyedGaussian
from sage_tfx.mechanisms.portable import floor_log2

NEVER = 0  # "no release predicted" as a leaf/step number (leaves and steps start at 1)
BLOCK = 32  # leaves per stored block
_BLOCK_LEVELS = BLOCK.bit_length() - 1  # node levels strictly inside a block
_LEVEL_SHIFT = np.uint64(48)  # node counter = level << 48 | index at that level
_MAX_CELLS = 1 << 16  # cells of Z computed at once when building an index


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
    2^n_levels, so every level starts at an even node) of each tree: level h as an array
    (trees, width >> h). Every level's keyed normals come from one call (one pass of AES)."""
    variances = honaker_variances(sigma, n_levels)
    owns = noise.normal_segments(tree_ids, [
        ((np.uint64(h) << _LEVEL_SHIFT) | (first_leaf >> np.uint64(h)), width >> h)
        for h in range(n_levels)])
    nus: list[np.ndarray] = []
    for h, own in enumerate(owns):
        own *= sigma
        if h:
            # w_h (sigma n) + (1 - w_h) (nu(left) + nu(right)), in place (the same products
            # and sums as written out).
            below = nus[h - 1]
            weight = variances[h] / sigma ** 2
            children = below[:, 0:2 * own.shape[1]:2] + below[:, 1:2 * own.shape[1]:2]
            children *= 1.0 - weight
            own *= weight
            own += children
        nus.append(own)
    return nus


def _decomposition_sum(nus: list[np.ndarray], length: int) -> np.ndarray:
    """Z(l) for l = 0..length-1 (relative to the first leaf the levels were computed from,
    Z(0) = 0): the sum of nu over the dyadic decomposition of [1, l], (trees, length); every
    such l must have its bits and nodes in `nus`. Added level by level from 0 upward, as the
    release's prefix always was (the same bits), each level in one strided add: the leaves l
    with bit h set are the upper halves of the runs of 2^(h + 1) leaves, and all of a half
    takes node (l >> h) - 1, its run's even node."""
    total = np.zeros((len(nus[0]), -(-length >> len(nus)) << len(nus)))
    for h, nu in enumerate(nus):
        halves = total.reshape(len(total), -1, 2, 1 << h)
        evens = nu[:, 0::2]
        halves[:, :evens.shape[1], 1, :] += evens[:, :halves.shape[1], None]
    return total[:, :length]


def prefix_noise(noise: KeyedGaussian, tree_ids, length: int, sigma: float) -> np.ndarray:
    """Z(l) for l = 1..length of each tree: (len(tree_ids), length)."""
    tree_ids = np.asarray(tree_ids, dtype=np.uint64)
    nus = _level_noise(noise, tree_ids, np.zeros(len(tree_ids), dtype=np.uint64), length,
                       levels(length), sigma)
    return _decomposition_sum(nus, length + 1)[:, 1:]


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
    # A cache, not state (never stored): R over the block each row was last scanned at, and
    # that block (-1: none). first_crossing scans a row again and again at the same block (a
    # key whose growing count passed R at a leaf behind it: 74-95% of the scans at T = 1,000),
    # and R, a function of the noise key and the row alone, has not changed.
    scanned_blocks: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    scanned_required: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    # A cache too: the minimum of `minima` over blocks b.. of each row, so first_crossing finds
    # the rows that can cross at all from one number each (most evaluated keys cannot).
    later_minima: Optional[np.ndarray] = field(default=None, repr=False, compare=False)

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
            # (Each part written once: np.full then a copy wrote the live rows twice, 0.16 s of
            # a 1,000-step window's 64 MB of factorization block states.)
            out = np.empty((capacity,) + array.shape[1:], dtype=array.dtype)
            out[:self.size] = array[:self.size]
            out[self.size:] = fill
            return out
        self.tree_ids = grown(self.tree_ids, 0)
        self.lengths = grown(self.lengths, 0)
        self.bases = grown(self.bases, np.nan)
        if self.minima is not None:
            self.minima = grown(self.minima, np.inf)
        if self.later_minima is not None:
            self.later_minima = grown(self.later_minima, np.inf)

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
        self._summarise_rows(noise, rows)
        return rows

    def rebuilt(self, noise: KeyedGaussian, tree_ids, lengths, live) -> "TreeIndex":
        """This (empty) index holding the trees `tree_ids` of `lengths` in the same rows as the
        index they were saved from, the summaries of the rows `live` recomputed and the others
        left unset (never read again: a selection tree of a round that ended). A row's
        summaries are a function of the noise key, its tree id and its length only (not of the
        rows computed with it), so they are the bits `add` computed: the state need not store
        them (WindowState.save)."""
        size = len(tree_ids)
        self._reserve(size)
        self.tree_ids[:size] = np.asarray(tree_ids, dtype=np.uint64)
        self.lengths[:size] = np.asarray(lengths, dtype=np.int64)
        self.size = size
        self._summarise_rows(noise, np.unique(np.asarray(live, np.int64)))
        return self

    def _summarise_rows(self, noise: KeyedGaussian, rows: np.ndarray) -> None:
        if len(rows) == 0:
            return
        longest = int(self.lengths[rows].max())
        # In chunks whose arrays stay in the CPU's cache (64 streams of 1,024 steps: 512 KB per
        # array): the keyed noise and the paths make a dozen passes over each chunk, which
        # took 1.3-1.5x as long from memory at 2^22 cells. Rows are independent, so the
        # chunking changes no bit.
        chunk = max(1, _MAX_CELLS // longest)
        for start in range(0, len(rows), chunk):
            part = rows[start:start + chunk]
            self._summarise(noise, part, self.tree_ids[part], self.lengths[part], longest)

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
        # Block boundaries are multiples of BLOCK: only the levels above the block's enter,
        # as a decomposition over block numbers.
        bases[:, 1:1 + n_blocks] = np.where(boundaries[None, :] > lengths[:, None], np.nan,
                                            _decomposition_sum(nus[_BLOCK_LEVELS:],
                                                               n_blocks + 1)[:, 1:])
        self.bases[rows] = bases
        if self.minima is None:
            return
        per_block = [nu.reshape(len(rows) * n_blocks, -1) for nu in nus[:_BLOCK_LEVELS]]
        inside = _decomposition_sum(per_block, BLOCK).reshape(len(rows), n_blocks, BLOCK)
        required = np.empty((len(rows), n_blocks, BLOCK))  # Z first, then R = tau - Z in place
        np.add(bases[:, :n_blocks, None], inside[:, :, 1:], out=required[:, :, :BLOCK - 1])
        required[:, :, BLOCK - 1] = bases[:, 1:n_blocks + 1]
        leaves = np.arange(1, width + 1)
        taus = self.thresholds[np.minimum(leaves, len(self.thresholds)) - 1]
        np.subtract(taus.reshape(n_blocks, BLOCK), required, out=required)
        # Past a tree's end (where Z is NaN or not the tree's): never crossed.
        np.copyto(required, np.inf, where=(leaves[None, :] > lengths[:, None]).reshape(
            required.shape))
        self._set_minima(rows, required.min(axis=2))

    def _set_minima(self, rows: np.ndarray, minima: np.ndarray) -> None:
        """The minima of R over the first minima.shape[1] blocks of `rows` (+inf after)."""
        self.minima[rows] = np.inf
        self.minima[rows, :minima.shape[1]] = minima
        if self.later_minima is not None:
            self.later_minima[rows] = _later_minima(self.minima[rows])

    def _block_noise(self, noise, rows, blocks, settled) -> np.ndarray:
        """Z(b * BLOCK + r) for r = 1..BLOCK of block b of each row: (len(rows), BLOCK).
        `settled`: the caller will not ask these rows about leaves <= settled again (a hint for
        indexes that keep a cursor, FactorizationIndex; the tree recomputes from its bases)."""
        first_leaf = (blocks * BLOCK).astype(np.uint64)
        nus = _level_noise(noise, self.tree_ids[rows], first_leaf, BLOCK, _BLOCK_LEVELS,
                           self.sigma)
        inside = _decomposition_sum(nus, BLOCK)
        out = np.empty((len(rows), BLOCK))
        np.add(self.bases[rows, blocks][:, None], inside[:, 1:], out=out[:, :BLOCK - 1])
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
        values = self._block_noise(noise, rows, blocks, leaves - 1)
        return values[np.arange(len(rows)), leaves - 1 - blocks * BLOCK]

    def _required(self, noise, rows, blocks, settled) -> np.ndarray:
        """R over block b of each row, +inf past the tree's end: (len(rows), BLOCK); rows
        scanned at that block last time from the cache, the others computed (and cached)."""
        if self.scanned_blocks is None or len(self.scanned_blocks) < self.size:
            capacity = len(self.tree_ids)
            cached = np.full(capacity, -1, np.int64)
            required = np.empty((capacity, BLOCK))
            if self.scanned_blocks is not None:
                cached[:len(self.scanned_blocks)] = self.scanned_blocks
                required[:len(self.scanned_blocks)] = self.scanned_required
            self.scanned_blocks, self.scanned_required = cached, required
        out = np.empty((len(rows), BLOCK))
        hit = self.scanned_blocks[rows] == blocks
        out[hit] = self.scanned_required[rows[hit]]
        miss = np.flatnonzero(~hit)
        if len(miss):
            rows, blocks = rows[miss], blocks[miss]
            leaves = blocks[:, None] * BLOCK + np.arange(1, BLOCK + 1)[None, :]
            inside = leaves <= self.lengths[rows][:, None]
            taus = self.thresholds[np.minimum(leaves, len(self.thresholds)) - 1]
            z = self._block_noise(noise, rows, blocks, settled[miss])
            out[miss] = np.where(inside, taus - np.nan_to_num(z), np.inf)
            self.scanned_blocks[rows] = blocks
            self.scanned_required[rows] = out[miss]
        return out

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
        # Only rows whose count passes some block's minimum from first_open on can cross.
        if self.later_minima is None:
            self.later_minima = _later_minima(self.minima)
        can = np.flatnonzero((first_open < self.n_blocks) & (counts > self.later_minima[
            rows, np.minimum(first_open, self.n_blocks - 1)]))
        found_leaves = self._first_crossing_in_blocks(noise, rows[can], after[can], counts[can],
                                                      first_open[can])
        result[can] = found_leaves
        return result

    def _first_crossing_in_blocks(self, noise, rows, after, counts, first_open) -> np.ndarray:
        """first_crossing for rows that cross in some block from first_open on."""
        result = np.full(len(rows), NEVER, dtype=np.int64)
        block_numbers = np.arange(self.n_blocks)[None, :]
        candidates = ((self.minima[rows] < counts[:, None])
                      & (block_numbers >= first_open[:, None]))
        # At most two exact scans: the first candidate block may cross only at leaves <= after.
        for _ in range(2):
            todo = np.flatnonzero(candidates.any(axis=1) & (result == NEVER))
            if len(todo) == 0:
                break
            blocks = candidates[todo].argmax(axis=1)
            required = self._required(noise, rows[todo], blocks, after[todo])
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
        index.bases = np.array(arrays["bases"], dtype=np.float64).reshape(
            size, index.n_blocks + 1)
        if thresholds is not None:
            index.minima = np.array(arrays["minima"], dtype=np.float64).reshape(
                size, index.n_blocks)
        index.size = size
        return index


def _later_minima(minima: np.ndarray) -> np.ndarray:
    """min(minima[:, b:]) for every block b: (rows, n_blocks)."""
    return np.minimum.accumulate(minima[:, ::-1], axis=1)[:, ::-1]


def value_grid(value_sigma: float) -> float:
    """The power of two released values are rounded to: about sigma / 1024, so rounding costs
    nothing in accuracy, and data (rounded per record to the grid) plus noise rounded to the grid
    is computed exactly in float64: the release is x + grid * round(Z / grid), a shifted lattice
    with no data-dependent low-order bits (keyed.py, "Floating point")."""
    return 2.0 ** (floor_log2(value_sigma) - 10)


def round_to_grid(values, grid: float) -> np.ndarray:
    return np.round(np.asarray(values, dtype=np.float64) / grid) * grid
