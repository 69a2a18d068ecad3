"""What DPStatisticsGen's statistics must be within their stated noise, from the true values
(tests of components/dp_statistics_gen). Every bound holds when each Laplace draw the release
makes lies within t = b ln(1 / ALPHA) of 0 (b its scale; P(|Z| > t) = ALPHA for Laplace, at
most ALPHA for the discrete Laplace), so a check fails falsely with probability at most ALPHA
times the number of draws it reads (stated beside each use)."""
import math

import numpy as np

from sage_tfx.dp_statistics.aggregation.aggregators import QUANTILE_RANK_TERMS
from sage_tfx.dp_statistics.aggregation.spec import (QUANTILE_BRANCHING, QUANTILE_LEVELS)

ALPHA = 1e-6


def tail(scale: float) -> float:
    return scale * math.log(1.0 / ALPHA)


def check_common(common, true_present: int, released_examples: int, t_present: float) -> None:
    """The common statistics: the noisy non-missing count within t_present (and rounding) of
    the truth; missing = released examples - non-missing (post-processing, at least 0)."""
    assert abs(common.num_non_missing - true_present) <= t_present + 0.5
    assert common.num_missing == max(0, released_examples - common.num_non_missing)
    assert common.tot_num_values == common.num_non_missing
    assert (common.min_num_values, common.max_num_values) == (1, 1)


def check_numeric(stats, values: np.ndarray, released_examples: int, low: float, high: float,
                  epsilon_each: float) -> None:
    """`stats`: a NumericStatistics; `values`: the feature's true present values;
    `released_examples`: the split's DP number of examples. Draws read: the moments' 3 sums
    and the tree's 84 nodes."""
    values = np.clip(values.astype(np.float64), low, high)
    n = len(values)
    half, mid = (high - low) / 2.0, (high + low) / 2.0
    # STDDEV spends its statistic's epsilon on 3 noisy sums: count, centred sum, centred
    # squares (sensitivity 1, half, half^2 / 2).
    t_n, t_s, t_q = (tail(3.0 * s / epsilon_each) for s in (1.0, half, half * half / 2.0))
    check_common(stats.common_stats, n, released_examples, t_n)
    t_tree = tail(QUANTILE_LEVELS / epsilon_each)
    [histogram] = stats.histograms
    cut_points = [histogram.buckets[0].low_value] + [b.high_value for b in histogram.buckets]
    assert (stats.min, stats.max) == (cut_points[0], cut_points[-1])
    assert low <= stats.mean <= high and 0 <= stats.std_dev <= half
    assert all(low <= c <= high for c in cut_points) and cut_points == sorted(cut_points)
    if n <= 2 * max(t_n, QUANTILE_BRANCHING * t_tree):
        return  # too few values for the noise to say more than the bounds (e.g. 1 value)
    centred = values - mid
    assert abs(stats.mean - values.mean()) <= (t_s + abs(centred.mean()) * t_n) / (n - t_n)
    # Variance Q'/N' + h^2/2 - (S'/N')^2 over the box of noisy sums: its extremes lie at corners
    # (each term is monotone in each sum on the box, N' > 0 there).
    q_sum = np.sum(centred ** 2 - half * half / 2.0)
    corners = [max(0.0, (q_sum + dq) / (n + dn) + half * half / 2.0
                   - ((centred.sum() + ds) / (n + dn)) ** 2)
               for dq in (-t_q, t_q) for ds in (-t_s, t_s) for dn in (-t_n, t_n)]
    # S' / N' = 0 lies inside the box when it straddles 0: (S' / N')^2 is smallest there.
    corners += [max(0.0, (q_sum + dq) / (n + dn) + half * half / 2.0) for dq in (-t_q, t_q)
                for dn in (-t_n, t_n)]
    assert math.sqrt(min(corners)) - 1e-9 <= stats.std_dev <= math.sqrt(max(corners)) + 1e-9
    # Quantiles: the descent's rank at a leaf edge sums QUANTILE_RANK_TERMS node counts and
    # the total the level-1 counts (aggregators.QUANTILE_RANK_TERMS), each within t of its
    # true count (tree sensitivity H = QUANTILE_LEVELS in L1); the leaf width bounds the rest.
    rank = (QUANTILE_RANK_TERMS + QUANTILE_BRANCHING) * t_tree / (n - QUANTILE_BRANCHING * t_tree)
    width = (high - low) / QUANTILE_BRANCHING ** QUANTILE_LEVELS
    fractions = np.linspace(0.0, 1.0, len(cut_points))
    for q, value in zip(fractions, cut_points):
        # MIN and MAX (q = 0, 1) stop at the first (last) positive noisy count: an empty
        # bucket's noise can put them anywhere toward the bound (accuracy.quantile).
        below = low if q == 0 else np.quantile(values, max(0.0, q - rank), method="lower") - width
        above = high if q == 1 else np.quantile(values, min(1.0, q + rank), method="higher") + width
        assert below - 1e-9 <= value <= above + 1e-9, (q, below, value, above)


def check_strings(stats, values, released_examples: int, epsilon_each: float,
                  delta_each: float) -> None:
    """`stats`: a StringStatistics; `values`: the true present values. Draws read: COUNT(s)'s
    Laplace and one discrete Laplace per distinct value (partition selection's, scale
    1 / epsilon)."""
    from sage_tfx.mechanisms.selection import laplace_threshold_tau

    check_common(stats.common_stats, len(values), released_examples, tail(1.0 / epsilon_each))
    distinct, counts = np.unique(np.asarray(values, dtype=object).astype(str),
                                 return_counts=True)
    truth = dict(zip(distinct, counts))
    t = tail(1.0 / epsilon_each)
    released = {b.label: b.sample_count for b in stats.rank_histogram.buckets}
    assert stats.unique == len(released)
    for label, frequency in released.items():
        assert label in truth and abs(frequency - truth[label]) <= t + 1e-9, label
    tau = laplace_threshold_tau(max_partitions_per_unit=1, epsilon=epsilon_each,
                                delta=delta_each)
    assert {v for v, c in truth.items() if c >= tau + t} <= set(released)
    top = [v.value for v in stats.top_values]
    ranked = sorted(released, key=lambda label: (-released[label], label))
    assert top == ranked[:len(top)]
