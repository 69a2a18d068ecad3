"""The DP tree math against tensorflow-privacy's Honaker tree, brute force, and its own law."""
import numpy as np
import pytest

from sage_tfx.dp_statistics.continual import tree
from sage_tfx.mechanisms.keyed import KeyedGaussian

NOISE = KeyedGaussian(bytes(range(32)))  # a fixed key: tests only


def _postorder_noise(tree_id: int, length: int, sigma: float) -> list:
    """Our keyed node noise in the order tensorflow-privacy draws it: each leaf, then the nodes
    it completes, bottom up."""
    order = []
    for leaf in range(1, length + 1):
        order.append((0, leaf - 1))
        h = 1
        while leaf % (1 << h) == 0:
            order.append((h, (leaf >> h) - 1))
            h += 1
    counters = np.array([(h << 48) | i for h, i in order], dtype=np.uint64)
    return list(sigma * NOISE.normals(np.uint64(tree_id), counters))


def test_prefix_noise_equals_tensorflow_privacy_efficient_tree_aggregator():
    import sys
    import tensorflow as tf
    sys.skip_tf_privacy_import = True  # its __init__ imports v1 estimators (STACK.md)
    from tensorflow_privacy.privacy.dp_query import tree_aggregation
    length, sigma = 37, 3.0
    values = iter(_postorder_noise(5, length + 1, sigma))  # it draws one leaf ahead
    aggregator = tree_aggregation.EfficientTreeAggregator(
        lambda: tf.constant(next(values), dtype=tf.float32))
    # Its methods are tf.functions: run them eagerly so each node draws the next value (a
    # traced function would bake the first draw in as a constant).
    tf.config.run_functions_eagerly(True)
    try:
        state = aggregator.init_state()
        oracle = []
        for _ in range(length):
            cumsum, state = aggregator.get_cumsum_and_update(state)
            oracle.append(float(cumsum))
    finally:
        tf.config.run_functions_eagerly(False)
    ours = tree.prefix_noise(NOISE, [5], length, sigma)[0]
    np.testing.assert_allclose(ours, oracle, rtol=1e-5, atol=1e-4)


def test_honaker_matches_tensorflow_privacy_weights():
    # tensorflow-privacy's node estimate is u_h / (2 - 2^-h), u_h = n + (u_l + u_r) / 2, whose
    # variance is sigma^2 2^(d-1) / (2^d - 1) at depth d = h + 1 (its docstring).
    variances = tree.honaker_variances(2.0, 8)
    d = np.arange(1, 9)
    np.testing.assert_allclose(variances, 4.0 * 2.0 ** (d - 1) / (2.0 ** d - 1))


def test_prefix_std_is_the_law_of_the_prefix_noise():
    # 4000 trees; the sample variance of Z(l) over 4000 draws is within 15% of lambda_l^2 with
    # probability > 1 - 1e-9 per leaf (chi-square, 3999 dof: sd of the ratio ~0.022; 15% is
    # 6.7 sd), 23 leaves: false failure < 3e-8.
    length, sigma = 23, 2.5
    z = tree.prefix_noise(NOISE, np.arange(4000), length, sigma)
    ratio = z.var(axis=0) / tree.prefix_std(length, sigma) ** 2
    assert np.all(np.abs(ratio - 1) < 0.15), ratio
    # The broken variant (plain tree noise, no Honaker) is caught: its variance is larger.
    plain = np.array([bin(l).count("1") for l in range(1, length + 1)]) * sigma ** 2
    assert np.any(np.abs(plain / tree.prefix_std(length, sigma) ** 2 - 1) > 0.3)


@pytest.mark.parametrize("length", [1, 31, 32, 33, 100, 200])
def test_index_recomputes_any_leaf_exactly(length):
    ids = np.arange(10, 16, dtype=np.uint64)
    index = tree.TreeIndex.empty(1.7, 200)
    rows = index.add(NOISE, ids, [length] * len(ids))
    full = tree.prefix_noise(NOISE, ids, length, 1.7)
    leaves = np.arange(1, length + 1)
    for row, expected in zip(rows, full):
        got = index.noise_at(NOISE, np.full(length, row), leaves)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9)


def test_first_crossing_is_the_brute_force_answer():
    sigma, max_length = 1.0, 150
    thresholds = np.full(max_length, 2.5)
    index = tree.TreeIndex.empty(sigma, max_length, thresholds)
    rng = np.random.default_rng(0)
    ids = np.arange(200, dtype=np.uint64)
    lengths = rng.integers(1, max_length + 1, size=len(ids))
    rows = index.add(NOISE, ids, lengths)
    after = (rng.random(len(ids)) * lengths).astype(np.int64)
    counts = rng.integers(0, 3, size=len(ids)).astype(float)
    got = index.first_crossing(NOISE, rows, after, counts)
    found = 0
    for i in range(len(ids)):
        z = tree.prefix_noise(NOISE, ids[i:i + 1], lengths[i], sigma)[0]
        required = thresholds[:lengths[i]] - z
        leaves = np.flatnonzero((counts[i] > required) & (np.arange(1, lengths[i] + 1) > after[i]))
        expected = leaves[0] + 1 if len(leaves) else tree.NEVER
        assert got[i] == expected, (i, lengths[i], after[i], counts[i])
        found += expected != tree.NEVER
    assert 20 < found < len(ids) - 20  # both outcomes are exercised


def test_index_round_trips_through_arrays():
    thresholds = np.linspace(1, 3, 64)
    index = tree.TreeIndex.empty(2.0, 64, thresholds)
    rows = index.add(NOISE, [1, 2, 3], [64, 10, 40])
    again = tree.TreeIndex.from_arrays(2.0, 64, thresholds, index.to_arrays())
    args = (NOISE, rows, np.array([0, 3, 20]), np.array([1.0, 2.0, 0.0]))
    np.testing.assert_array_equal(index.first_crossing(*args), again.first_crossing(*args))
    np.testing.assert_array_equal(index.noise_at(NOISE, rows, [64, 10, 33]),
                                  again.noise_at(NOISE, rows, [64, 10, 33]))


def test_an_empty_index_round_trips():
    empty = tree.TreeIndex.empty(2.0, 64, np.ones(64))
    again = tree.TreeIndex.from_arrays(2.0, 64, np.ones(64), empty.to_arrays())
    assert again.size == 0 and again.minima.shape == (0, 2)


def test_grid_rounding_is_exact_on_the_grid():
    grid = tree.value_grid(150.0)
    assert grid == 0.125
    assert tree.round_to_grid([1.06, -2.3], grid).tolist() == [1.0, -2.25]


def test_first_crossing_between_additions_past_the_indexs_capacity():
    """first_crossing keeps the later blocks' minima as a cache: trees added after it was
    built, within the capacity and past it (1,024 rows, then grown), are answered as an
    index holding all of them from the start answers."""
    sigma, max_length = 1.0, 100
    thresholds = np.full(max_length, 2.0)
    rng = np.random.default_rng(5)
    ids = np.arange(1500, dtype=np.uint64)
    lengths = rng.integers(1, max_length + 1, size=len(ids))
    after = (rng.random(len(ids)) * lengths).astype(np.int64)
    counts = rng.integers(0, 3, size=len(ids)).astype(float)
    whole = tree.TreeIndex.empty(sigma, max_length, thresholds)
    expected = whole.first_crossing(NOISE, whole.add(NOISE, ids, lengths), after, counts)
    grown = tree.TreeIndex.empty(sigma, max_length, thresholds)
    for start, end in ((0, 300), (300, 900), (900, 1500)):
        rows = grown.add(NOISE, ids[start:end], lengths[start:end])
        assert np.array_equal(grown.first_crossing(NOISE, rows, after[start:end],
                                                   counts[start:end]), expected[start:end])
        everything = np.arange(end)
        assert np.array_equal(grown.first_crossing(NOISE, everything, after[:end], counts[:end]),
                              expected[:end])
    assert 100 < (expected != tree.NEVER).sum() < 1400
