"""Property tests of the allocation policy and retirement (pure functions, basic accounting).
Budgets are exact fractions (exact.exact_vector), so every identity below holds exactly."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_tfx.sage_access import allocation
from sage_tfx.sage_access.accounting import BasicComposition
from sage_tfx.sage_access.exact import exact_vector as budget

BASIC = BasicComposition()
PIPELINES = ["p0", "p1", "p2"]
MIN_DEMAND = budget([0.01, 0.0])

operations = st.lists(st.one_of(
    st.tuples(st.just("charge"), st.sampled_from(PIPELINES + [None]),
              st.floats(0.01, 0.6), st.floats(0, 3e-7)),
    st.tuples(st.just("release"), st.sampled_from(PIPELINES)),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(waiting=st.lists(st.sampled_from(PIPELINES), unique=True), ops=operations,
       min_epsilon=st.floats(0.01, 0.3))
def test_policy_invariants_hold_for_any_sequence(waiting, ops, min_epsilon):
    capacity = BASIC.capacity(1.0, 1e-6)
    min_demand = budget([min_epsilon, 0.0])
    block = allocation.new_block("b", 1.0, 1e-6, capacity, BASIC.zero(), waiting, min_demand,
                                 BASIC)
    waiting = list(waiting)
    # An arriving block is split evenly among the longest-waiting pipelines, as many as can each
    # get a share that pays the minimum request.
    sharing = allocation.recipients(waiting, capacity, min_demand, BASIC)
    assert sharing == waiting[:len(sharing)]
    # As many as possible: one more share would not pay the minimum.
    assert len(sharing) == len(waiting) or capacity[0] / (len(sharing) + 1) < min_demand[0]
    assert list(block.reservations) == sharing
    for share in block.reservations.values():
        assert np.array_equal(share, capacity / len(sharing)) and share[0] >= min_demand[0]
    for op in ops:
        before = block
        if op[0] == "charge":
            _, pipeline, epsilon, delta = op
            demand = budget([epsilon, delta])
            if not allocation.can_pay(block, demand, pipeline, BASIC):
                continue
            block = allocation.charge(block, demand, pipeline, BASIC, min_demand)
            assert np.array_equal(block.spent, before.spent + demand)
            # Nobody draws on another pipeline's reservation.
            for other, share in before.reservations.items():
                if other != pipeline:
                    assert np.array_equal(block.reservations[other], share)
        else:
            pipeline = op[1]
            if pipeline not in waiting:
                continue
            waiting.remove(pipeline)
            block = allocation.release(block, pipeline, waiting)
            assert pipeline not in block.reservations
            returned = np.maximum(before.reservations.get(pipeline, BASIC.zero()), 0)
            total_before = sum(np.maximum(r, 0) for r in before.reservations.values()) + BASIC.zero()
            total_after = sum(np.maximum(r, 0) for r in block.reservations.values()) + BASIC.zero()
            if waiting and not block.retired:  # re-split: the total reserved is unchanged
                assert np.array_equal(total_after, total_before)
            else:  # nobody waiting: it becomes free
                assert np.array_equal(total_after, total_before - returned)
        # The ceiling is never exceeded, and reservations never promise more than is left.
        assert np.all(block.spent <= capacity)
        assert np.all(allocation.free_budget(block) >= 0)
        assert block.retired or not before.retired  # retirement is permanent
        assert block.retired == (not BASIC.fits(block.spent, min_demand, capacity)) or \
            op[0] == "release"


def test_retired_block_never_pays_again():
    capacity = BASIC.capacity(1.0, 1e-6)
    block = allocation.new_block("b", 1.0, 1e-6, capacity, BASIC.zero(), [], MIN_DEMAND, BASIC)
    block = allocation.charge(block, budget([0.95, 0.0]), None, BASIC, budget([0.1, 0.0]))
    assert block.retired
    assert not allocation.can_pay(block, budget([0.01, 0.0]), None, BASIC)


def test_reservation_then_free_budget_for_a_waiting_pipeline():
    capacity = BASIC.capacity(1.0, 1e-6)
    block = allocation.new_block("b", 1.0, 1e-6, capacity, BASIC.zero(), ["p0", "p1"],
                                 MIN_DEMAND, BASIC)
    small = budget([0.1, 0.0])
    block = allocation.release(block, "p1", ["p0"])  # p1 leaves: p0 gets everything
    assert np.array_equal(block.reservations["p0"], capacity)
    # A pipeline that is not waiting only sees the free budget, which is now empty.
    assert not allocation.can_pay(block, small, "p9", BASIC)
    assert allocation.can_pay(block, small, "p0", BASIC)


def test_under_overload_shares_go_to_the_longest_waiting_and_stay_spendable():
    """Split among all of 150 waiting pipelines, a block would give each 1/150 < 0.01, the
    minimum request: nobody could spend any share, of this block or any later one. Budgets are
    exact, so a split 100 ways gives shares of exactly 0.01, which pay it."""
    capacity = BASIC.capacity(1.0, 1e-6)
    waiting = [f"p{i:03d}" for i in range(150)]
    block = allocation.new_block("b", 1.0, 1e-6, capacity, BASIC.zero(), waiting, MIN_DEMAND,
                                 BASIC)
    assert list(block.reservations) == waiting[:100]
    assert all(allocation.can_pay(block, MIN_DEMAND, name, BASIC) for name in waiting[:100])
    assert not allocation.can_pay(block, MIN_DEMAND, waiting[100], BASIC)  # it waits its turn


def test_free_budget_and_charge_count_follow_the_ledger_arithmetic():
    # Written out by hand: capacity 1.0 split between p0 and p1 (0.5 each); p0 spends 0.2 from
    # its reservation, an outsider spends 0.1 from the free budget (none is free yet, so it is
    # refused), then p1 leaves and its 0.5 becomes free.
    capacity = BASIC.capacity(1.0, 1e-6)
    block = allocation.new_block("b", 1.0, 1e-6, capacity, BASIC.zero(), ["p0", "p1"],
                                 MIN_DEMAND, BASIC)
    assert np.array_equal(allocation.free_budget(block), budget([0.0, 0.0]))
    block = allocation.charge(block, budget([0.2, 0.0]), "p0", BASIC, MIN_DEMAND)
    assert np.array_equal(block.reservations["p0"], budget([0.3, 5e-7]))
    assert np.array_equal(allocation.free_budget(block), budget([0.0, 0.0]))
    assert not allocation.can_pay(block, budget([0.1, 0.0]), None, BASIC)
    block = allocation.release(block, "p1", [])
    assert np.array_equal(allocation.free_budget(block), budget([0.5, 5e-7]))
    block = allocation.charge(block, budget([0.1, 0.0]), None, BASIC, MIN_DEMAND)
    assert np.array_equal(allocation.free_budget(block), budget([0.4, 5e-7]))
    assert np.array_equal(allocation.available_to(block, "p0"), budget([0.7, 1e-6]))
    assert block.charges == 2  # the ledger's audit compares this with the grant history
