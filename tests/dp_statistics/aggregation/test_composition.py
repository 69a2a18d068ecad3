"""A query's steps composed by their privacy loss distributions (budget.Composition.PLD): each
aggregate gets more noise budget than the basic split, and dp-accounting's own accountant finds
the composed events within the grant."""
import dataclasses
import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregateKind, AggregationQuery,
                                                NoiseKind, QueryError, SelectionRule, plan)
from sage_tfx.dp_statistics.aggregation.budget import Composition


def _query(noise, selection=SelectionRule.WEIGHTED_GAUSSIAN):
    return AggregationQuery(("k",), "uid", (Aggregate.count(),
                                            Aggregate(AggregateKind.AVG, "x", 0.0, 50.0)),
                            max_partitions_contributed=4, max_contributions_per_partition=2,
                            noise=noise, selection=selection)


def _noises(event):
    """The noise events a step's event is made of (AVG's count and sum are composed)."""
    if isinstance(event, dp_event.ComposedDpEvent):
        return [part for inner in event.events for part in _noises(inner)]
    return [event.event if isinstance(event, dp_event.SelfComposedDpEvent) else event]


def _epsilon_by_dp_accounting(event, delta):
    """dp-accounting's PLD accountant at a finer grid than the plan's (1e-4 nats)."""
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(event)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("noise, least_scale", [(NoiseKind.GAUSSIAN, 1.5),
                                                (NoiseKind.LAPLACE, 1.01)])
def test_the_composed_events_fit_the_grant_with_more_budget_per_step(noise, least_scale):
    epsilon, delta = 1.0, 1e-6
    tight = plan(_query(noise), epsilon, delta)
    basic = plan(_query(noise), epsilon, delta, composition=Composition.BASIC)
    # the ledger's split is the same; every step's noise is calibrated at lambda times its share
    assert [(s.name, s.epsilon, s.delta) for s in tight.steps] == [
        (s.name, s.epsilon, s.delta) for s in basic.steps]
    scales = {step.noise_scale for step in tight.steps}
    assert len(scales) == 1 and scales.pop() >= least_scale
    for step, before in zip(tight.steps, basic.steps):
        for one, other in zip(_noises(step.event), _noises(before.event)):
            assert one.noise_multiplier < other.noise_multiplier  # less noise, same grant
    assert tight.additional_delta == basic.additional_delta
    assert _epsilon_by_dp_accounting(tight.event, delta - tight.additional_delta) <= epsilon


def test_a_plan_with_no_delta_to_trade_is_the_basic_split():
    """Truncated-geometric selection and Laplace noise: every event is pure (its delta all goes
    to the selection, outside the events), and pure losses add: nothing to gain."""
    query = _query(NoiseKind.LAPLACE, SelectionRule.TRUNCATED_GEOMETRIC)
    assert plan(query, 1.0, 1e-6) == plan(query, 1.0, 1e-6, composition=Composition.BASIC)


@pytest.mark.parametrize("composition", list(Composition))
def test_the_weighted_gaussian_samplers_rounding_delta_is_charged_inside_the_grant(composition):
    """Issue 45, item 5: the weighted Gaussian selection's floating-point sampler adds
    (1 + e^epsilon) C 2^-49 to the release's delta (mechanisms.selection derives it), epsilon
    the grant's. The plan charges it as additional delta out of the selection's share: the
    selection runs at the rest, and the grant's delta still covers the whole."""
    from sage_tfx.dp_statistics.aggregation.frontend import PlannedQuery, stated_mechanism
    from sage_tfx.mechanisms.selection import weighted_gaussian_selection

    epsilon, delta = 3.0, 1e-9
    budget = plan(_query(NoiseKind.GAUSSIAN), epsilon, delta, composition=composition)
    step = budget.step("partition_selection")
    rounding = (1 + math.exp(epsilon)) * 4 * 2.0 ** -49
    assert step.rounding_delta == pytest.approx(rounding, rel=1e-12)
    ran = weighted_gaussian_selection([], max_partitions_per_unit=4,
                                      epsilon=step.noise_epsilon, delta=step.delta - rounding)
    assert step.additional_delta == pytest.approx(ran.additional_delta + rounding, rel=1e-12)
    assert step.event == ran.event
    assert budget.delta <= delta and budget.additional_delta >= rounding
    stated = stated_mechanism(PlannedQuery(None, budget.query, (), budget, epsilon, delta))
    assert f"delta includes {rounding:.2g}" in stated


def test_a_weighted_gaussian_selection_whose_rounding_delta_is_not_negligible_is_refused():
    """C = 100,000 at epsilon 10: (1 + e^10) 1e5 2^-49 = 3.9e-6, above the whole delta 1e-6."""
    query = dataclasses.replace(_query(NoiseKind.LAPLACE), max_partitions_contributed=100_000)
    with pytest.raises(QueryError, match=r"floating-point sampler adds delta .* = 3.91e-06"):
        plan(query, 10.0, 1e-6)
    assert plan(query, 1.0, 1e-6).step("partition_selection").rounding_delta < 1e-9
