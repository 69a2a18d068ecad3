"""Accounting rules: basic composition and the Rényi filter, checked against dp-accounting."""
import math
from fractions import Fraction

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_tfx.sage_access import BadRequest, BasicComposition, BudgetRequest, RenyiFilter
from sage_tfx.sage_access.accounting import pure_dp_rdp_curve


@pytest.mark.parametrize("epsilon_g,delta_g", [(1.0, 1e-6), (10.0, 1e-5), (0.5, 1e-9)])
def test_rdp_capacity_converts_to_exactly_the_ceiling_with_dp_accounting(epsilon_g, delta_g):
    rdp = RenyiFilter()
    capacity = rdp.capacity(epsilon_g, delta_g)
    per_order_delta = delta_g / len(rdp.orders)
    for order, cap in zip(rdp.orders, capacity):
        if cap <= per_order_delta ** 2:  # clipped at 0 or in dp-accounting's KL shortcut
            continue
        epsilon, _ = rdp_privacy_accountant.compute_epsilon([order], [cap], per_order_delta)
        assert epsilon == pytest.approx(epsilon_g, rel=1e-9)


def test_rdp_guarantee_is_the_filters_not_an_odometer_reading():
    """Issue 16 §5: converting the current sums (here about 0.77) is not a valid bound under
    adaptive composition; the filter certifies its ceiling once anything was spent."""
    rdp = RenyiFilter()
    spent = pure_dp_rdp_curve(0.3, rdp.orders) * 2
    odometer, _ = rdp_privacy_accountant.compute_epsilon(rdp.orders, spent, 1e-6 / len(rdp.orders))
    assert odometer < 1.0
    assert rdp.guarantee(spent, 1.0, 1e-6) == (1.0, 1e-6)
    assert rdp.guarantee(rdp.zero(), 1.0, 1e-6) == (0.0, 0.0)


def test_rdp_filter_admits_iff_some_order_stays_within_capacity():
    rdp = RenyiFilter()
    capacity = rdp.capacity(2.0, 1e-6)
    # A Gaussian mechanism's curve a / (2 sigma^2): admitted while some order fits.
    gaussian = np.array(rdp.orders) / (2 * 3.0 ** 2)
    spent = rdp.zero()
    admitted = 0
    while rdp.fits(spent, gaussian, capacity):
        spent = spent + gaussian
        admitted += 1
    assert admitted > 0
    assert np.any(spent <= capacity)
    assert not np.any(spent + gaussian <= capacity)
    # The composed curve still converts (dp-accounting) to within the ceiling.
    epsilon, _ = rdp_privacy_accountant.compute_epsilon(rdp.orders, spent, 1e-6 / len(rdp.orders))
    assert epsilon <= 2.0 + 1e-9


def test_rdp_filter_is_tighter_than_basic_composition_for_many_gaussians():
    # 50 Gaussians with sigma = 30 fit a (2, 1e-6) block under the RDP filter; basic composition
    # of their (eps, delta) conversions would need several times that ceiling.
    rdp = RenyiFilter()
    curve = np.array(rdp.orders) / (2 * 30.0 ** 2)
    capacity = rdp.capacity(2.0, 1e-6)
    assert rdp.fits(curve * 49, curve, capacity)
    single_epsilon, _ = rdp_privacy_accountant.compute_epsilon(rdp.orders, curve, 1e-6 / 50)
    assert 50 * single_epsilon > 4 * 2.0


def test_pure_dp_curve_never_exceeds_epsilon_or_zcdp_bound():
    curve = pure_dp_rdp_curve(0.5, (2.0, 4.0, 64.0))
    assert list(curve) == [0.25, 0.5, 0.5]


def test_basic_composition_is_componentwise():
    basic = BasicComposition()
    limit = basic.capacity(1.0, 1e-6)
    assert basic.fits(np.array([0.5, 0.0]), np.array([0.5, 1e-6]), limit)
    assert not basic.fits(np.array([0.5, 0.0]), np.array([0.5, 2e-6]), limit)
    assert not basic.fits(np.array([0.6, 0.0]), np.array([0.5, 0.0]), limit)


def test_rdp_curve_request_under_basic_composition_converts_with_dp_accounting():
    basic = BasicComposition()
    curve = tuple(a / (2 * 4.0 ** 2) for a in basic.orders)
    demand = basic.demand(BudgetRequest(rdp_curve=curve, delta=1e-6))
    expected, _ = rdp_privacy_accountant.compute_epsilon(basic.orders, curve, 1e-6)
    assert demand[0] == pytest.approx(expected)
    assert demand[1] == Fraction(1, 10**6)
    with pytest.raises(BadRequest, match="needs a delta"):
        basic.demand(BudgetRequest(rdp_curve=curve))


def test_rdp_ledger_refuses_approximate_dp_requests_without_a_curve():
    with pytest.raises(BadRequest, match="no finite RDP curve"):
        RenyiFilter().demand(BudgetRequest(epsilon=1.0, delta=1e-6))


bad_epsilons = st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf])
bad_deltas = st.sampled_from([-1e-9, 1.0, 2.0, math.nan, math.inf])


@given(epsilon=bad_epsilons)
def test_bad_epsilon_is_refused(epsilon):
    with pytest.raises(BadRequest, match="epsilon"):
        BudgetRequest(epsilon=epsilon, delta=1e-6)


@given(delta=bad_deltas)
def test_bad_delta_is_refused(delta):
    with pytest.raises(BadRequest, match="delta"):
        BudgetRequest(epsilon=1.0, delta=delta)


@settings(max_examples=50)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=4))
def test_bad_rdp_curves_are_refused(values):
    if all(math.isfinite(v) and v >= 0 for v in values):
        values = values + [-1.0]
    with pytest.raises(BadRequest):
        BudgetRequest(rdp_curve=values)


def test_rdp_filter_refuses_delta_spent_outside_the_events_basic_charges_it_within_delta():
    """Partition selection spends delta outside its DP event (mechanisms.Release). An RDP
    curve cannot carry it, so the filter refuses the grant; basic composition charges the
    grant's whole (epsilon, delta), which must include it."""
    from dp_accounting import dp_event

    request = BudgetRequest(epsilon=1.0, delta=1e-6)
    split, events = {"selection": "1"}, {"selection": dp_event.LaplaceDpEvent(1.0)}
    with pytest.raises(BadRequest, match="additional delta 1e-06"):
        RenyiFilter().grant_demand(request, split, events, additional_delta=1e-6)
    assert np.all(RenyiFilter().grant_demand(request, split, events) > 0)
    basic = BasicComposition()
    assert list(basic.grant_demand(request, split, events, additional_delta=1e-6)) == [1, Fraction(1, 10**6)]
    with pytest.raises(BadRequest, match="more than the grant's delta"):
        basic.grant_demand(request, split, events, additional_delta=2e-6)
