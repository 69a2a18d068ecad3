"""One grant (epsilon, delta) split among a query's steps, and the dp-accounting events of each.

Steps. ``partition_selection`` (absent with public partitions), one step per aggregate named by
its output column, and ``bounds:<output column>`` for each aggregate whose bounds are inferred
(§4.2.5). Four aggregates are post-processing of another step and have no step of their own
(:func:`derived_from`): COUNT(DISTINCT unit) under a thresholding rule is the selection's noisy
unit count (the seed's remark after its thresholding theorem); COUNT(col) next to an AVG, VAR or
STDDEV of the same column is that aggregate's noisy count of non-NULL rows (the same rows, the
same sensitivity m; COUNT(*) is not: it also counts the rows whose value is NULL); a row-scoped
SUM with the column and literal bounds of an AVG/VAR/STDDEV is mid * N + S from its noisy row
count N and centred sum S (PipelineDP derives COUNT and SUM from MEAN the same way); and a
quantile (an NTILE's cut point, a MEDIAN beside a MAX) of the column and bounds of an earlier
quantile is read from that one's noisy tree: the tree holds every quantile of its column
(aggregators.quantile_from_tree), so k quantiles build, noise and pay for ONE tree, whose step
weighs k (the weight their k trees had) and, when the bounds are inferred, share one bounds step.

Composition (DP SQL §4.2.3, "User-level differential privacy", reconstructed). A unit touches at
most C_u partitions; on each, step s is (eps_s, delta_s)-DP in the partition's output. The seed
bounds the unit's loss by the sum of the C_u largest per-partition costs; every partition here
pays the same, so that is C_u times one partition's cost, and we calibrate each step's noise on
the WHOLE vector of partitions instead: the L1 norm of a unit's change over its C_u partitions is
at most C_u * Delta_s (Laplace), its L2 norm at most sqrt(C_u) * Delta_s (Gaussian, different
partitions are different coordinates), where Delta_s is the step's per-partition sensitivity
(aggregators.py). So each step is one vector mechanism at (eps_s, delta_s), its event a
Laplace/GaussianDpEvent, and the steps compose: the sum of eps_s is epsilon and the sum of
delta_s (Gaussian noise, and the selection's additional delta) is at most delta (basic
composition, the seed's Proposition 5). ``BudgetPlan.event`` is the composed event for the
ledger; the selection's ``additional_delta`` sits outside it (mechanisms.Release's contract).

Tighter composition (``Composition.PLD``, the default). Basic composition adds epsilons as if
every step's privacy loss could be at its worst on the same outcome; the privacy loss
distributions of the actual noises (Laplace, Gaussian) compose far better, most of all for
Gaussians, whose losses add as independent normals. So once the basic split is made, every
step's noise is recalibrated at (lambda eps_s, delta_s) for one common factor lambda >= 1, the
largest (to a relative 1e-3, rounded down) for which dp-accounting's PLD accountant (add-or-
remove-one, pessimistic discretisation) finds the composed events
(epsilon, delta - additional_delta)-DP: with the selection's additional delta outside the
events (mechanisms.Release), the release is then (epsilon, delta)-DP, the grant. The split's
fractions stay the basic shares (what the ledger records as each step's part of the grant);
each step's ``noise_scale`` is lambda and its event is the noise that runs. lambda = 1 (the
basic plan, sound by basic composition) when the events have no delta to trade (pure Laplace
steps whose delta all goes to the selection's threshold) or PLD finds nothing better.

Shares. By default a step weighs the number of noisy sums it releases (selection, bounds,
COUNT, SUM, QUANTILE: 1; AVG: 2; VAR/STDDEV: 3), which is PipelineDP's split (its
NaiveBudgetAccountant gives each mechanism weight 1, and MEAN is two); ``weights`` overrides by
step name. An aggregate that releases k noisy sums splits its share among them: VAR/STDDEV
(count, centred sum, centred sum of squares) evenly, AVG 41/100 to its count and 59/100 to its
centred sum (MEAN_COUNT_FRACTION says why). Delta: with
Laplace noise all of it goes to the selection; with Gaussian noise the selection gets half and
the Gaussian steps share the rest in proportion to their weights.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
from fractions import Fraction
from typing import Mapping, Optional

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from sage_tfx import mechanisms
from sage_tfx.mechanisms import selection
from sage_tfx.sage_access.accounting import share_of
from sage_tfx.dp_statistics.aggregation.spec import (MAX_MAGNITUDE, AggregateKind,
                                                     AggregationQuery, NoiseKind, QueryError,
                                                     SelectionRule)

SELECTION_STEP = "partition_selection"
BOUNDS_STEP_PREFIX = "bounds:"

_SELECTION_MECHANISMS = {
    SelectionRule.LAPLACE_THRESHOLD: mechanisms.laplace_threshold,
    SelectionRule.GAUSSIAN_THRESHOLD: mechanisms.gaussian_threshold,
    SelectionRule.TRUNCATED_GEOMETRIC: mechanisms.truncated_geometric_selection,
    SelectionRule.WEIGHTED_GAUSSIAN: mechanisms.weighted_gaussian_selection,
}
_THRESHOLDING = (SelectionRule.LAPLACE_THRESHOLD, SelectionRule.GAUSSIAN_THRESHOLD)

# Noisy sums each aggregate releases per partition (aggregators.py says which).
NOISY_SUMS = {AggregateKind.COUNT: 1, AggregateKind.COUNT_DISTINCT: 1, AggregateKind.SUM: 1,
              AggregateKind.AVG: 2, AggregateKind.VAR: 3, AggregateKind.STDDEV: 3,
              AggregateKind.QUANTILE: 1}


class Composition(str, enum.Enum):
    """How a plan composes its steps (module docstring): basic (epsilons add) or by the
    privacy loss distributions of their noise (dp-accounting's PLD accountant)."""
    BASIC = "basic"
    PLD = "pld"


def composition_for(accounting) -> Composition:
    """The composition whose plan is cheapest for the ledger that charges it (``accounting``:
    the ledger's accounting object, sage_access.accounting, or its mode's name).

    A basic ledger charges the grant's (epsilon, delta) whatever noise runs, so the PLD plan
    (less noise for the same charge) is the better buy. An rdp ledger charges the RDP curve
    of the events that run: PLD's factor lambda >= 1 lowers every step's noise and so raises
    that curve, while the basic plan's events are the noisiest that meet the grant: BASIC."""
    mode = str(getattr(accounting, "name", accounting))
    return Composition.BASIC if mode == "rdp" else Composition.PLD


@dataclasses.dataclass(frozen=True)
class PlanStep:
    """A step's share of the grant and the event of the noise it runs. ``additional_delta``:
    the part of ``delta`` spent outside ``event`` (partition selection only), of which
    ``rounding_delta`` is the weighted Gaussian selection's floating-point sampler's
    (mechanisms.selection.weighted_gaussian_rounding_delta): the mechanism runs at the rest,
    ``mechanism_delta``. ``noise_scale``: the factor lambda of a PLD plan (module docstring):
    the noise is calibrated at (``noise_epsilon`` = lambda * epsilon, mechanism_delta)."""
    name: str
    epsilon: float
    delta: float
    event: dp_event.DpEvent
    additional_delta: float = 0.0
    noise_scale: float = 1.0
    rounding_delta: float = 0.0

    @property
    def noise_epsilon(self) -> float:
        return self.epsilon * self.noise_scale

    @property
    def mechanism_delta(self) -> float:
        return self.delta - self.rounding_delta


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """The grant split for ``query``. ``epsilon``/``delta``: what the steps spend in total (basic
    composition; at most the grant)."""
    query: AggregationQuery
    epsilon: float
    delta: float
    steps: tuple[PlanStep, ...]

    def step(self, name: str) -> PlanStep:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(f"no step {name!r} in this plan; steps: {[s.name for s in self.steps]}")

    @property
    def event(self) -> dp_event.DpEvent:
        return dp_event.ComposedDpEvent([step.event for step in self.steps])

    @property
    def additional_delta(self) -> float:
        return sum(step.additional_delta for step in self.steps)


_MEAN_KINDS = (AggregateKind.AVG, AggregateKind.VAR, AggregateKind.STDDEV)


def derived_from(query: AggregationQuery) -> dict[str, str]:
    """Output name -> the step it is post-processed from (module docstring), for the
    aggregates that have no step of their own."""
    derived = {}
    means = [a for a in query.aggregates if a.kind in _MEAN_KINDS]
    for aggregate in query.aggregates:
        if (aggregate.kind is AggregateKind.COUNT_DISTINCT
                and SelectionRule(query.selection) in _THRESHOLDING):
            derived[aggregate.output_name] = SELECTION_STEP
        elif aggregate.kind is AggregateKind.COUNT and aggregate.column is not None:
            # The mean's count is of its column's non-NULL sampled rows: COUNT(that column).
            source = next((m for m in means if m.column == aggregate.column), None)
            if source is not None:
                derived[aggregate.output_name] = source.output_name
        elif aggregate.kind is AggregateKind.SUM and aggregate.bounds_rows:
            source = next((m for m in means if (m.column, m.low, m.high) == (
                aggregate.column, aggregate.low, aggregate.high) and m.low is not None), None)
            if source is not None:
                derived[aggregate.output_name] = source.output_name
        elif aggregate.kind is AggregateKind.QUANTILE:
            tree = _tree_of(query, aggregate)
            if tree != aggregate.output_name:
                derived[aggregate.output_name] = tree
    return derived


def bounds_inferred_by_step(query: AggregationQuery) -> tuple:
    """The aggregates whose bounds their own ``bounds:`` step infers (a quantile reading another
    one's tree uses that one's bounds: aggregators.shared_bounds)."""
    derived = derived_from(query)
    return tuple(a for a in query.aggregates
                 if a.bounds_inferred and a.output_name not in derived)


def _tree_of(query: AggregationQuery, quantile) -> str:
    """The quantile whose tree ``quantile`` reads: the first of its column and bounds (equal
    literal bounds, or both inferred: then from that first one's bounds step)."""
    return next(a.output_name for a in query.aggregates if a.kind is AggregateKind.QUANTILE
                and (a.column, a.low, a.high) == (quantile.column, quantile.low, quantile.high))


def _step_weights(query: AggregationQuery) -> dict[str, float]:
    names = {} if SelectionRule(query.selection) is SelectionRule.PUBLIC else {SELECTION_STEP: 1.0}
    inferred = {a.output_name for a in bounds_inferred_by_step(query)}
    derived = derived_from(query)
    for aggregate in query.aggregates:
        if aggregate.output_name in inferred:
            names[BOUNDS_STEP_PREFIX + aggregate.output_name] = 1.0
        if aggregate.output_name in derived:
            continue
        names[aggregate.output_name] = float(NOISY_SUMS[aggregate.kind])
        if aggregate.kind is AggregateKind.QUANTILE:  # one tree for all its quantiles
            names[aggregate.output_name] *= sum(
                1 for other in query.aggregates if other.kind is AggregateKind.QUANTILE
                and _tree_of(query, other) == aggregate.output_name)
    return names


# The largest epsilon OPTIONS may state (frontend.plan_query refuses more, saying why): the
# selections' calibrations compute e^epsilon in double precision (mechanisms/selection.py),
# which overflows at 709.78, and far below it a release is all but noiseless (BigQuery's
# documentation sets epsilon = 1e20 to remove the noise).
MAX_EPSILON = 700.0


def _grant(epsilon, delta) -> tuple[float, float]:
    try:
        epsilon, delta = float(epsilon), float(delta)
    except (TypeError, ValueError):
        raise QueryError(f"epsilon and delta must be numbers, got {epsilon!r}, {delta!r}") from None
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise QueryError(f"epsilon must be a positive finite number, got {epsilon!r}")
    if not 0 <= delta < 1:
        raise QueryError(f"delta must lie in [0, 1), got {delta!r}")
    return epsilon, delta


def plan(query: AggregationQuery, epsilon: float, delta: float,
         weights: Optional[Mapping[str, float]] = None,
         composition: Composition = Composition.PLD) -> BudgetPlan:
    """Split the grant (epsilon, delta) among ``query``'s steps and calibrate their noise by
    ``composition`` (module docstring). Raises QueryError for a bad query, a bad grant, a grant
    whose delta is 0 when a step needs some (selection, Gaussian noise), or unknown/non-positive
    weights; nothing is charged here."""
    basic = _basic_plan(query, epsilon, delta, weights)
    if Composition(composition) is Composition.BASIC:
        return basic
    scale = _pld_noise_scale(basic)
    if scale == 1.0:
        return basic
    return dataclasses.replace(basic, steps=tuple(
        _step(query, step.name, step.epsilon, step.delta, basic.epsilon, scale)
        for step in basic.steps))


def _basic_plan(query: AggregationQuery, epsilon: float, delta: float,
                weights: Optional[Mapping[str, float]]) -> BudgetPlan:
    query.check()
    epsilon, delta = _grant(epsilon, delta)
    default = _step_weights(query)
    names = list(default)
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise QueryError(f"weights name unknown steps {unknown}; the steps are {names}")
    share = {name: float(weights.get(name, default[name])) for name in names}
    if not all(math.isfinite(w) and w > 0 for w in share.values()):
        raise QueryError(f"weights must be positive finite numbers, got {weights!r}")
    aggregates = {a.output_name: a for a in query.aggregates}
    gaussian_steps = [n for n in names if n in aggregates
                      and NoiseKind(query.noise) is NoiseKind.GAUSSIAN]
    selection_delta = 0.0
    if SELECTION_STEP in names:
        selection_delta = delta / 2.0 if gaussian_steps else delta
    if delta == 0 and (SELECTION_STEP in names or gaussian_steps):
        raise QueryError("delta must be positive: "
                         + ("partition selection" if SELECTION_STEP in names else
                            "Gaussian noise") + " spends some")
    # Each step's exact fraction of the grant, rounded down (share_of): the steps' epsilons
    # (and deltas) sum to at most the grant's, with no rounding up to overspend it.
    total = sum(Fraction(w) for w in share.values())
    gaussian_weight = sum(Fraction(share[n]) for n in gaussian_steps)
    steps = []
    for name in names:
        if name == SELECTION_STEP:
            step_delta = selection_delta
        elif name in gaussian_steps:
            step_delta = share_of(delta - selection_delta, Fraction(share[name]) / gaussian_weight)
        else:
            step_delta = 0.0  # bounds and Laplace noise
        steps.append(_step(query, name, share_of(epsilon, Fraction(share[name]) / total),
                           step_delta, epsilon))
        if name in aggregates:
            _check_noise_scale(query, aggregates[name], steps[-1].event)
    spent_delta = sum(step.delta for step in steps)
    return BudgetPlan(query, epsilon, spent_delta, tuple(steps))


def _step(query: AggregationQuery, name: str, epsilon: float, delta: float,
          release_epsilon: float, scale: float = 1.0) -> PlanStep:
    """Step ``name`` with its share (epsilon, delta) of the grant and the event of its noise,
    calibrated at (scale * epsilon, delta): scale 1 in the basic plan, lambda in a PLD plan
    (module docstring). The one place a step's event is made. ``release_epsilon``: the
    grant's, at which the weighted Gaussian selection's rounding delta is charged."""
    noise_epsilon = epsilon * scale
    additional_delta = rounding_delta = 0.0
    if name == SELECTION_STEP:
        rounding_delta = _selection_rounding_delta(query, release_epsilon, delta)
        event, additional_delta = _selection_event(query, noise_epsilon,
                                                   delta - rounding_delta)
        additional_delta += rounding_delta
    elif name.startswith(BOUNDS_STEP_PREFIX):
        event = dp_event.LaplaceDpEvent(noise_multiplier=1.0 / noise_epsilon)
    else:
        kind = next(a.kind for a in query.aggregates if a.output_name == name)
        event = component_event(query, kind, noise_epsilon, delta)
    return PlanStep(name, epsilon, delta, event, additional_delta, scale, rounding_delta)


def _selection_rounding_delta(query: AggregationQuery, release_epsilon: float,
                              delta: float) -> float:
    """The part of the selection step's ``delta`` charged for the weighted Gaussian's
    floating-point sampler (mechanisms.selection.weighted_gaussian_rounding_delta, at the
    grant's epsilon; 0 under the other rules, whose noise is OpenDP's exact samplers). Refused
    (QueryError) where it would take half the step's delta or more."""
    if SelectionRule(query.selection) is not SelectionRule.WEIGHTED_GAUSSIAN:
        return 0.0
    rounding = selection.weighted_gaussian_rounding_delta(
        release_epsilon=release_epsilon,
        max_partitions_per_unit=query.max_partitions_contributed)
    if 2 * rounding >= delta:
        raise QueryError(
            f"weighted_gaussian partition selection: its floating-point sampler adds delta "
            f"(1 + e^epsilon) C 2^-49 = {rounding:.3g} at epsilon {release_epsilon:g} and "
            f"max_groups_contributed C = {query.max_partitions_contributed}, not negligible "
            f"against the selection's delta {delta:.3g}; lower epsilon or "
            "max_groups_contributed, raise delta, or use another selection rule")
    return rounding


# The PLD accountant's loss grid: 1e-3 nats (pessimistic rounding, so the epsilon it reports is
# an upper bound); lambda is searched to a relative 1e-3 and rounded down.
_PLD_DISCRETISATION = 1e-3
_PLD_SCALE_TOLERANCE = 1e-3


def pld_epsilon(event: dp_event.DpEvent, delta: float) -> float:
    """The epsilon at ``delta`` of ``event`` by dp-accounting's PLD accountant (add-or-remove-one,
    the ledger's relation)."""
    accountant = pld_privacy_accountant.PLDAccountant(
        value_discretization_interval=_PLD_DISCRETISATION)
    accountant.compose(event)
    return accountant.get_epsilon(delta)


def _pld_noise_scale(basic: BudgetPlan) -> float:
    """The factor lambda >= 1 of the module docstring for ``basic``'s steps (1.0: no gain)."""
    return _pld_noise_scale_of(basic.query, basic.epsilon, basic.delta - basic.additional_delta,
                               tuple((step.name, step.epsilon, step.delta)
                                     for step in basic.steps))


@functools.lru_cache(maxsize=256)
def _pld_noise_scale_of(query: AggregationQuery, target: float, event_delta: float,
                        steps: tuple[tuple[str, float, float], ...]) -> float:
    """`_pld_noise_scale`, cached on what determines it (a plan's events are rebuilt from
    these by `_step`; a ComposedDpEvent, AVG's, holds a list and cannot be hashed)."""
    if event_delta <= 0 or len(steps) < 2:
        return 1.0  # pure events compose additively; one step is calibrated exactly already

    def composed(scale: float) -> dp_event.DpEvent:
        return dp_event.ComposedDpEvent([_step(query, name, epsilon, delta, target, scale).event
                                         for name, epsilon, delta in steps])

    def fits(scale: float) -> bool:
        return pld_epsilon(composed(scale), event_delta) <= target

    if not fits(1.0):
        return 1.0
    low, high = 1.0, 2.0
    while fits(high):  # epsilon grows with the scale: bracket the largest that fits
        low, high = high, 2.0 * high
    while high - low > _PLD_SCALE_TOLERANCE * low:
        middle = (low + high) / 2.0
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _check_noise_scale(query: AggregationQuery, aggregate, event: dp_event.DpEvent) -> None:
    """Refuse, before any charge, an aggregate whose noise scale (its multiplier times the L1
    or L2 sensitivity over C_eff partitions, AggregationQuery.partitions_per_unit) exceeds
    spec.MAX_MAGNITUDE: its noisy sums could overflow to infinity by the noise alone."""
    l1 = query.largest_change(aggregate)
    if l1 is None:
        return
    parts = (event.events if isinstance(event, dp_event.ComposedDpEvent) else
             [event.event if isinstance(event, dp_event.SelfComposedDpEvent) else event])
    sensitivity = l1 if NoiseKind(query.noise) is NoiseKind.LAPLACE \
        else l1 / math.sqrt(query.partitions_per_unit)
    scale = max(part.noise_multiplier for part in parts) * sensitivity
    if not scale <= MAX_MAGNITUDE:
        raise QueryError(f"aggregate {aggregate.output_name!r}: bounds [{aggregate.low!r}, "
                         f"{aggregate.high!r}] at this step's epsilon need noise of scale "
                         f"{scale:g}, beyond 2^1000 (about {MAX_MAGNITUDE:.3g}); narrow the "
                         "bounds or raise epsilon")


# AVG's two noisy sums, its count N and its centred sum S (aggregators.py), do not cost the mean
# alike: to first order its error is (e_S - mu e_N) / n, mu = mean - mid in [-h, h], so its
# variance is (sd_S^2 + mu^2 sd_N^2) / n^2, with sd_S = c h / eps_S and sd_N = c / eps_N (both
# sensitivities are m per row, S's times h; c the same constant for both: sqrt(2) C_eff m for
# Laplace, and about that for the Gaussian at small epsilon). Nothing public says where the
# mean lies in the bounds: averaged over mu uniform on [-h, h] (E mu^2 = h^2 / 3), the
# variance is c^2 (h^2 / eps_S^2 + h^2 / (3 eps_N^2)) / n^2, least under eps_S + eps_N = eps
# at eps_S / eps_N = 3^(1/3) = 1.442: the count gets 1 / (1 + 3^(1/3)) = 0.409 of AVG's epsilon,
# here the exact fraction 41/100 (sum 59/100; an even split's mean variance is 8.5% larger at
# the average, PipelineDP's split). At a mean on a bound (mu = +-h) it is 10% larger than the
# even split's; at the midpoint 30% smaller. Deltas (Gaussian noise) are split evenly.
MEAN_COUNT_FRACTION = Fraction(41, 100)


def component_budgets(kind: AggregateKind, epsilon: float,
                      delta: float) -> tuple[tuple[float, float], ...]:
    """(epsilon, delta) of each of the aggregate's noisy sums, in its layout's order: AVG's
    count and centred sum by MEAN_COUNT_FRACTION, the others evenly. Each part's epsilon is
    its exact fraction rounded down (share_of): the parts never spend more than ``epsilon``."""
    parts = NOISY_SUMS[kind]
    fractions = ((MEAN_COUNT_FRACTION, 1 - MEAN_COUNT_FRACTION) if kind is AggregateKind.AVG
                 else (Fraction(1, parts),) * parts)
    return tuple((share_of(epsilon, fraction), delta / parts) for fraction in fractions)


def component_event(query: AggregationQuery, kind: AggregateKind, epsilon: float,
                    delta: float) -> dp_event.DpEvent:
    def one(part_epsilon: float, part_delta: float) -> dp_event.DpEvent:
        if NoiseKind(query.noise) is NoiseKind.LAPLACE:
            return dp_event.LaplaceDpEvent(noise_multiplier=1.0 / part_epsilon)
        return dp_event.GaussianDpEvent(noise_multiplier=mechanisms.gaussian_sigma(
            l2_sensitivity=1.0, epsilon=part_epsilon, delta=part_delta))

    budgets = component_budgets(kind, epsilon, delta)
    if len(set(budgets)) == 1:
        return one(*budgets[0]) if len(budgets) == 1 else dp_event.SelfComposedDpEvent(
            one(*budgets[0]), len(budgets))
    return dp_event.ComposedDpEvent([one(*budget) for budget in budgets])


def run_selection(query: AggregationQuery, step: PlanStep, statistic) -> mechanisms.Release:
    """The selection rule of ``query`` at the step's share, on the per-partition unit counts
    (integers), or for the weighted Gaussian the partitions' sums of unit weights."""
    rule = SelectionRule(query.selection)
    return _SELECTION_MECHANISMS[rule](
        np.asarray(statistic, dtype=np.float64 if rule is SelectionRule.WEIGHTED_GAUSSIAN
                   else np.int64),
        max_partitions_per_unit=query.max_partitions_contributed,
        epsilon=step.noise_epsilon, delta=step.mechanism_delta)


def units_kept_half_the_time(query: AggregationQuery, step: PlanStep) -> int:
    """How many units, alone in a group, ``query``'s selection rule keeps it from with
    probability 1/2 or more at ``step``'s share (public: the rule's own threshold,
    mechanisms.selection.units_kept_half_the_time; the query selects its groups)."""
    return selection.units_kept_half_the_time(
        _SELECTION_MECHANISMS[SelectionRule(query.selection)],
        max_partitions_per_unit=query.max_partitions_contributed,
        epsilon=step.noise_epsilon, delta=step.mechanism_delta)


def _selection_event(query: AggregationQuery, noise_epsilon: float,
                     delta: float) -> tuple[dp_event.DpEvent, float]:
    """(event, additional_delta) of the selection run at (noise_epsilon, delta), read from the
    selection mechanism itself, run on no partitions: the same code that will run on the data
    states what it spends."""
    try:
        dry = run_selection(query, PlanStep(SELECTION_STEP, noise_epsilon, delta,
                                            dp_event.NoOpDpEvent()), [])
    except ValueError as error:
        raise QueryError(f"partition selection cannot run at epsilon {noise_epsilon:g}, delta "
                         f"{delta:g}: {error}") from None
    except OverflowError:
        raise QueryError(f"partition selection cannot run at epsilon {noise_epsilon:g}: its "
                         "calibration computes e^epsilon, which overflows past 709.78; lower "
                         "epsilon") from None
    return dry.event, dry.additional_delta
