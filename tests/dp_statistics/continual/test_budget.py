"""The window's budget: calibrated with dp-accounting, thresholds that keep beta."""
import math

import numpy as np
import pytest
from dp_accounting import dp_event

from sage_tfx.dp_statistics.continual import budget, tree
from sage_tfx.mechanisms.keyed import KeyedGaussian


@pytest.mark.parametrize("micro_batches", [1, 100, 1000])
def test_plan_spends_exactly_the_budget_it_is_given(micro_batches):
    plan = budget.plan(6.0, 1e-9, micro_batches, 32)
    assert plan.achieved_epsilon() <= 6.0
    assert plan.achieved_epsilon() > 6.0 - 1e-6  # no budget left unused
    assert plan.conversion_delta + plan.additional_delta == pytest.approx(1e-9, rel=1e-12)
    # rho split half and half, as the paper's eps/2 each: rho_s = C H / (2 sigma_s^2).
    depth = tree.levels(micro_batches)
    rho_selection = 32 * depth / (2 * plan.selection_sigma ** 2)
    rho_values = depth * 32 ** 2 / (2 * plan.value_sigma ** 2)
    assert rho_selection == pytest.approx(rho_values)


def test_event_is_what_the_trees_run():
    plan = budget.plan(1.0, 1e-6, 64, 4, value_bound=2.5)
    selection, values = plan.event.events
    assert selection == dp_event.SelfComposedDpEvent(
        dp_event.SingleEpochTreeAggregationDpEvent(plan.selection_sigma, 64), 4)
    assert values == dp_event.SingleEpochTreeAggregationDpEvent(plan.value_sigma / (4 * 2.5), 64)


def test_more_contributions_or_triggers_need_more_noise():
    base = budget.plan(2.0, 1e-8, 100, 8)
    assert budget.plan(2.0, 1e-8, 1000, 8).selection_sigma > base.selection_sigma
    assert budget.plan(2.0, 1e-8, 100, 16).value_sigma > base.value_sigma


def test_thresholds_bound_a_pure_noise_crossing_by_beta():
    # Large delta so beta is measurable: pure-noise selection trees (count 0) must cross their
    # threshold anywhere in the window with probability <= beta (union over T leaves). With
    # 20,000 trees, the count of crossings exceeds beta * 20,000 + 6 sd with probability < 1e-8.
    plan = budget.plan(0.5, 0.3, 16, 1)
    n = 20_000
    noise = KeyedGaussian(bytes(range(32)))
    z = tree.prefix_noise(noise, np.arange(n), 16, plan.selection_sigma)
    crossed = (z > plan.thresholds[None, :]).any(axis=1).sum()
    expected = plan.beta * n
    assert crossed <= expected + 6 * math.sqrt(expected) + 1
    # The broken variant (a per-time tail, the paper's) crosses more often than beta allows.
    per_time = tree.prefix_std(16, plan.selection_sigma) * budget.norm.isf(plan.beta)
    assert (z > per_time[None, :]).any(axis=1).sum() > expected + 6 * math.sqrt(expected) + 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(epsilon=0), "epsilon"), (dict(delta=1.5), "delta"), (dict(micro_batches=0), "micro"),
    (dict(contribution_limit=2.5), "contribution_limit"), (dict(value_bound=math.inf), "value"),
    (dict(selection_share=1.0), "selection_share")])
def test_bad_parameters_are_named(kwargs, message):
    arguments = dict(epsilon=1.0, delta=1e-6, micro_batches=10, contribution_limit=2)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        budget.plan(**arguments)


# --- the BLT square-root factorization (factorization.py) ---

@pytest.mark.parametrize("micro_batches", [1, 100, 1000])
def test_the_factorization_plan_spends_exactly_its_budget(micro_batches):
    plan = budget.plan(6.0, 1e-9, micro_batches, 32, mechanism="factorization")
    assert plan.mechanism == "factorization"
    assert 6.0 - 1e-6 < plan.achieved_epsilon() <= 6.0


def test_the_factorization_event_is_the_gaussian_mechanism_of_its_brute_force_sensitivity():
    """GaussianDpEvent(sigma / sensitivity), the sensitivity of C' = B'^{-1} A (the
    column-normalised decoder that runs) from a dense solve,
    maximised by brute force over every way a unit's C = 2 records of bound L land in the T = 5
    steps (repeats allowed: records of one key can share a step); selection: one step per
    (key, round) stream, composed over the unit's C streams."""
    import itertools
    plan = budget.plan(1.0, 1e-6, 5, 2, value_bound=2.5, mechanism="factorization")
    encoder = np.linalg.solve(plan.factor.decoder_matrix(5), np.tril(np.ones((5, 5))))
    one = np.linalg.norm(encoder, axis=0).max()
    worst = max(np.linalg.norm(encoder @ np.bincount(steps, minlength=5).astype(float))
                for size in (1, 2)
                for steps in itertools.combinations_with_replacement(range(5), size))
    selection, values = plan.event.events
    assert selection.count == 2
    assert selection.event.noise_multiplier == pytest.approx(plan.selection_sigma / one,
                                                             rel=1e-12)
    assert values.noise_multiplier == pytest.approx(plan.value_sigma / (2.5 * worst), rel=1e-12)


def test_auto_takes_the_mechanism_of_smaller_worst_step_error_and_the_release_says_which():
    errors = budget.worst_step_errors(100)
    assert errors["factorization"] < 0.25 * errors["tree"]
    assert budget.plan(1.0, 1e-6, 100, 4, mechanism="auto").mechanism == "factorization"
    assert budget.plan(1.0, 1e-6, 1, 4, mechanism="auto").mechanism == "tree"  # a tie at T = 1
    assert "BLT square-root factorization" in budget.plan(
        1.0, 1e-6, 100, 4, mechanism="auto").statement
    assert "binary trees" in budget.plan(1.0, 1e-6, 100, 4).statement
    with pytest.raises(ValueError, match="unknown mechanism"):
        budget.plan(1.0, 1e-6, 100, 4, mechanism="banded")


def test_a_factorization_budget_survives_its_json_round_trip():
    """state.py stores the budget as JSON: the decoder's buffers come back as the very same
    floats (lists become tuples), so the reloaded budget is the plan."""
    import dataclasses
    import json
    plan = budget.plan(1.0, 1e-6, 100, 4, mechanism="factorization")
    again = budget.StreamBudget(**json.loads(json.dumps(dataclasses.asdict(plan))))
    assert again == plan and again.mechanism is budget.StreamMechanism.FACTORIZATION


def test_factorization_thresholds_bound_a_pure_noise_crossing_by_beta():
    """The union bound needs no independence across steps (factorization.py, "Thresholds"):
    with the BLT's correlated noise a pure-noise selection stream crosses tau anywhere in the
    window with probability <= beta (same 6-sd bound as the tree's test, < 1e-8)."""
    from sage_tfx.dp_statistics.continual import factorization
    plan = budget.plan(0.5, 0.3, 16, 1, mechanism="factorization")
    n = 20_000
    z = factorization.prefix_noise(KeyedGaussian(bytes(range(32))), np.arange(n), plan.factor,
                                   16, plan.selection_sigma)
    crossed = (z > plan.thresholds[None, :]).any(axis=1).sum()
    expected = plan.beta * n
    assert crossed <= expected + 6 * math.sqrt(expected) + 1
