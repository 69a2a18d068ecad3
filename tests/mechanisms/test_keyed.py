"""Keyed Gaussian noise: reproducible under its key, independent across keys, N(0, 1)."""
import hashlib

import numpy as np
import pytest
from scipy import stats

from sage_tfx.mechanisms.keyed import KeyedGaussian


def test_same_key_and_counter_give_the_same_value_and_keys_differ():
    key = bytes(range(32))
    a = KeyedGaussian(key).normals(np.uint64(3), np.arange(100, dtype=np.uint64))
    b = KeyedGaussian(key).normals(np.full(100, 3, np.uint64), np.arange(100, dtype=np.uint64))
    np.testing.assert_array_equal(a, b)
    other = KeyedGaussian(bytes(32)).normals(np.uint64(3), np.arange(100, dtype=np.uint64))
    assert not np.allclose(a, other)
    assert KeyedGaussian.fresh().key != KeyedGaussian.fresh().key


def test_bad_key_is_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        KeyedGaussian(b"short")


def test_noise_is_standard_normal():
    # KS against N(0, 1) on 200,000 values: p < 1e-6 happens with probability 1e-6 when the
    # law is right; the mean and sd bounds are 5.4 and 6.3 standard errors (false failure
    # < 1e-7 each). Broken variants are rejected: a uniform with the same variance (KS) and a
    # normal with sd 1.02 (the sd bound).
    z = KeyedGaussian(bytes(range(32))).normals(np.uint64(0), np.arange(200_000, dtype=np.uint64))
    assert stats.kstest(z, "norm").pvalue > 1e-6
    assert abs(z.mean()) < 0.012 and abs(z.std() - 1) < 0.01
    broken = np.sqrt(3) * (2 * stats.norm.cdf(z) - 1)
    assert stats.kstest(broken, "norm").pvalue < 1e-6
    assert abs((1.02 * z).std() - 1) >= 0.01


def test_rows_are_the_same_values_as_single_counters():
    noise = KeyedGaussian(bytes(range(32)))
    rows = noise.normal_rows([4, 9], [6, 0], 5)
    expected = np.stack([noise.normals(np.uint64(4), np.arange(6, 11, dtype=np.uint64)),
                         noise.normals(np.uint64(9), np.arange(0, 5, dtype=np.uint64))])
    np.testing.assert_allclose(rows, expected, rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError, match="even"):
        noise.normal_rows([1], [3], 2)


def test_the_two_halves_of_a_pair_are_independent():
    # 100,000 pairs: the sample correlation of independent normals (and of their squares) has
    # sd ~0.003 (0.0045 for squares); 0.02 is > 4.4 sd (false failure < 1e-5 each). The
    # broken variant "second half = first half" has correlation 1.
    z = KeyedGaussian(bytes(range(32))).normals(np.uint64(7), np.arange(200_000, dtype=np.uint64))
    assert abs(np.corrcoef(z[0::2], z[1::2])[0, 1]) < 0.02
    assert abs(np.corrcoef(z[0::2] ** 2, z[1::2] ** 2)[0, 1]) < 0.02
    assert np.corrcoef(z[0::2], z[0::2])[0, 1] > 0.99


def test_the_values_are_pinned_bits():
    """The PRF's outputs are part of every keyed release (a crashed micro-batch recomputes its
    noise; test_release_bits.py pins the releases): a faster implementation must give the same
    bits. 64,000 values with every polar retry path up to attempt 7, and rows at counters
    near the 2^48 level shift and at stream ids near 2^56; digests of the code before the
    throughput work on keyed noise (main at 022462d)."""
    noise = KeyedGaussian(bytes(range(32)))
    grid = noise.normals(np.arange(1000, dtype=np.uint64)[:, None],
                         np.arange(64, dtype=np.uint64)[None, :])
    assert hashlib.sha256(grid.tobytes()).hexdigest() == (
        "540e0840f3956cd05d3d8fac192092fa1f1327e07666e4d20867911c7269c257")
    rows = noise.normal_rows(np.array([5, 2 ** 55, 77]), np.array([0, 10, 2 ** 48]), 1001)
    assert hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest() == (
        "e6116c6a74b975994694b1eadec22f9077a322ed55f9721c8a4cbb0afffeba5d")


def test_segments_are_the_rows_of_each_segment():
    noise = KeyedGaussian(bytes(range(32)))
    streams = np.array([3, 8, 1 << 40], np.uint64)
    segments = [(np.array([0, 4, 100], np.uint64), 7), (np.array([1 << 48, 2, 0], np.uint64), 1),
                (np.zeros(3, np.uint64), 0)]
    for (first, count), values in zip(segments, noise.normal_segments(streams, segments)):
        np.testing.assert_array_equal(values, noise.normal_rows(streams, first, count))
        assert values.shape == (3, count)


def test_ragged_rows_are_each_streams_rows():
    noise = KeyedGaussian(bytes(range(32)))
    streams = np.array([3, 8, 1 << 40, 9, 12], np.uint64)
    first = np.array([0, 4, 1 << 48, 2, 10], np.uint64)
    counts = np.array([7, 0, 1, 64, 2])
    values, starts = noise.normal_ragged(streams, first, counts)
    for stream, start, count, offset in zip(streams, first, counts, starts):
        np.testing.assert_array_equal(values[offset:offset + count],
                                      noise.normal_rows([stream], [start], count)[0])
    with pytest.raises(ValueError, match="even"):
        noise.normal_ragged(streams, first + np.uint64(1), counts)
    with pytest.raises(ValueError, match="count >= 0 per stream"):
        noise.normal_ragged(streams, first, counts[:4])
    with pytest.raises(ValueError, match="count >= 0 per stream"):
        noise.normal_ragged(streams, first, counts - 1)
    assert noise.normal_ragged([], [], [])[0].shape == (0,)
