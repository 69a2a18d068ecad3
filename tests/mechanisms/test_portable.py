"""Exact binary exponents: the grids and buckets every engine and CPU must agree on."""
import math

import numpy as np

from sage_tfx.dp_statistics.aggregation.aggregators import LOG_HISTOGRAM_SIZE, log_histogram
from sage_tfx.mechanisms.portable import floor_log2


def test_floor_log2_is_exact_at_and_beside_powers_of_two():
    below = [math.nextafter(2.0 ** k, 0.0) for k in range(-1000, 1000, 7)]
    assert [floor_log2(v) for v in below] == [k - 1 for k in range(-1000, 1000, 7)]
    assert [floor_log2(2.0 ** k) for k in range(-1074, 1024)] == list(range(-1074, 1024))
    assert floor_log2(3.0) == 1 and floor_log2(0.75) == -1
    values = np.array([math.nextafter(4.0, 0.0), 4.0, 5e-324, 1.5])
    np.testing.assert_array_equal(floor_log2(values), [1, 2, -1074, 0])


def test_a_value_just_below_a_power_of_two_stays_in_its_bucket():
    # Buckets [2^j, 2^(j + 1)): 2 - 2^-52 is in [1, 2), 2 in [2, 4), on every CPU (a log2
    # within an ulp may round the first up to exponent 1).
    counts = log_histogram(np.array([math.nextafter(2.0, 0.0), 2.0, -math.nextafter(1.0, 0.0)]))
    middle = LOG_HISTOGRAM_SIZE // 2
    assert counts[middle + 1 + 10] == 1 and counts[middle + 1 + 11] == 1
    assert counts[middle - 1 - 9] == 1 and counts.sum() == 3
