"""The empirical auditor (sage_tfx.audit) on the whole aggregation operator: neighbouring inputs
differing in one user's rows in 10 partitions.

False-failure rates: "the bound stays below the claim" runs at confidence 0.9999 (fails for a
correct operator with probability <= 1e-4, audit/bounds.py); "the broken variant is caught" is
power, not coverage: measured bounds 3.4 and 3.9 against the claim 1 at these trials."""
import pytest

from sage_tfx.audit import mechanisms
from sage_tfx.audit.bounds import epsilon_lower_bound

TRIALS = 5_000


def test_the_operator_stays_within_its_epsilon_for_a_user_in_10_partitions():
    first, second = mechanisms.aggregation_outputs(TRIALS, seed=0)
    bound = epsilon_lower_bound(first, second, delta=0.0, confidence=0.9999)
    assert bound <= mechanisms.AGGREGATION_EPSILON


def test_the_operator_without_contribution_bounding_is_caught():
    first, second = mechanisms.aggregation_outputs(TRIALS, seed=0,
                                                   broken="no_contribution_bounding")
    assert epsilon_lower_bound(first, second, delta=0.0, confidence=0.99) > (
        mechanisms.AGGREGATION_EPSILON)


def test_the_operator_is_in_the_shipped_list():
    audit = mechanisms.shipped()["dp_aggregation"]
    assert audit.claimed_epsilon == mechanisms.AGGREGATION_EPSILON
    assert audit.run(1_000).epsilon_lower_bound <= audit.claimed_epsilon


# AVG's count and centred sum, each at its share of AVG's epsilon (budget.MEAN_COUNT_FRACTION,
# issue 48): measured 0.26 and 0.38 against the claims 0.41 and 0.59 (5,000 runs, confidence
# 0.9999: fails for a correct operator with probability <= 1e-4); the broken variant, a part
# noised at the whole AVG epsilon, measured 0.78 and 0.83 (power, at confidence 0.99).
@pytest.mark.parametrize("part", sorted(mechanisms.AVG_PARTS))
def test_avgs_count_and_sum_each_stay_within_their_share(part):
    audit = mechanisms.shipped()[f"dp_sql_avg_{part}"]
    assert audit.claimed_epsilon == mechanisms.AVG_EPSILON * mechanisms.AVG_PARTS[part]
    first, second = mechanisms.avg_outputs(TRIALS, seed=0, part=part)
    assert epsilon_lower_bound(first, second, delta=0.0, confidence=0.9999) <= (
        audit.claimed_epsilon)


@pytest.mark.parametrize("part", sorted(mechanisms.AVG_PARTS))
def test_an_avg_part_noised_at_the_whole_avg_epsilon_is_caught(part):
    first, second = mechanisms.avg_outputs(TRIALS, seed=0, part=part, broken="whole_share")
    assert epsilon_lower_bound(first, second, delta=0.0, confidence=0.99) > (
        mechanisms.AVG_EPSILON * mechanisms.AVG_PARTS[part])


# AVG pooled over the released groups (aggregators.mean_estimate, issue 48): another group's
# released mean, whose rows are the same on both sides, moves only through the pooling of the
# noisy sums. One real release per run (~3-10 ms each), so fewer runs: measured bound 0.0
# against the claim 1 at 150 runs (confidence 0.9999: fails for a correct operator with
# probability <= 1e-4); the broken variant, the estimator handed the pre-noise sums, measured
# 2.4 at 100 runs (power, at confidence 0.99: its output is one value per side).
def test_avgs_pooling_is_post_processing_of_its_noisy_sums():
    audit = mechanisms.shipped()["dp_sql_avg_pooled"]
    assert audit.claimed_epsilon == mechanisms.AVG_EPSILON
    first, second = mechanisms.avg_pooled_outputs(150, seed=0)
    assert epsilon_lower_bound(first, second, delta=0.0, confidence=0.9999) <= (
        audit.claimed_epsilon)


def test_avgs_pooling_of_the_pre_noise_sums_is_caught():
    first, second = mechanisms.avg_pooled_outputs(100, seed=0, broken="exact_sums")
    assert epsilon_lower_bound(first, second, delta=0.0, confidence=0.99) > (
        mechanisms.AVG_EPSILON)
