"""DP SQL and DP aggregation for users: over ingested tables (`sage-tfx query`), over a frame in
Python (`dp_aggregate`), and in TFX (components/dp_aggregate). Thin: parsing and the ownership
checks are sql.py's, the relation below the operator relation.py's, the operator the core's, and
paying for the release the release protocol's (sage_tfx.release).

A query is parsed once and planned once (`plan_query`): the plan's split among the query's steps,
their dp-accounting events and the delta partition selection spends outside them are the
ReleasePlan the protocol charges (`PlannedQuery.release_plan`). `run` then checks the grant pays
for exactly this plan (a grant made elsewhere, e.g. by the BlockLedger component, must have been
made from it), consumes every step's share (once, in the ledger: a second run on the same grant
is refused) and runs the operator.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal
from typing import Callable, Mapping, NamedTuple, Optional, Union

import pandas as pd
import pyarrow as pa

from sage_tfx.dp_statistics.aggregation import accuracy, relation, sql
from sage_tfx.dp_statistics.aggregation.budget import (MAX_EPSILON, SELECTION_STEP, BudgetPlan,
                                                       Composition, composition_for, plan,
                                                       units_kept_half_the_time)
from sage_tfx.dp_statistics.aggregation.local import aggregate
from sage_tfx.dp_statistics.aggregation.release import Release
from sage_tfx.dp_statistics.aggregation.spec import (AggregateKind, AggregationQuery, QueryError,
                                                     SelectionRule)
from sage_tfx.release import Charged, GuaranteeUnit, ReleasePlan, consume
from sage_tfx.sage_access.accounting import BudgetRequest, event_from_json
from sage_tfx.sage_access.errors import BadRequest

# A step's fraction of the grant, written exactly (decimal) and rounded down, so the fractions
# never sum to more than 1 (sage_access.ledger.check_split).
_FRACTION_DIGITS = Decimal("1e-15")


@dataclass(frozen=True)
class PlannedQuery:
    """A checked SQL query, the operator's query for it, the released table's column order
    (the SELECT list, NTILE expanded) and its budget plan at the requested (epsilon, delta),
    the grant's (the plan may spend less delta than granted, e.g. none with Laplace noise)."""
    checked: sql.CheckedQuery
    query: AggregationQuery
    columns: tuple[str, ...]
    budget: BudgetPlan
    epsilon: float
    delta: float

    def release_plan(self, front_door: str, request: str, **options) -> ReleasePlan:
        """What the release protocol charges for this query (`options`: ReleasePlan's)."""
        terms = grant_terms(self.budget)
        return ReleasePlan(front_door, request, self.epsilon, self.delta, terms.split, terms.events, terms.additional_delta, **options)


def check_query(parsed: sql.ParsedQuery, schemas: Mapping[str, sql.TableSchema],
                arrow_schemas: Mapping[str, pa.Schema]
                ) -> tuple[sql.CheckedQuery, AggregationQuery, tuple[str, ...]]:
    """Check `parsed` (sql.parse) against the tables, including a run of its relation on empty
    tables: every refusal names the clause, before anything is read or charged. Returns the
    checked query, the operator's query and the released table's column order."""
    checked = sql.check(parsed, schemas)
    query, columns = sql.to_query(checked)
    relation.check_on_schema(checked, arrow_schemas)
    return checked, query, columns


def plan_query(parsed: sql.ParsedQuery, schemas: Mapping[str, sql.TableSchema],
               arrow_schemas: Mapping[str, pa.Schema], epsilon: float,
               delta: float, composition: Composition = Composition.PLD) -> PlannedQuery:
    """`check_query`, then the budget plan at (epsilon, delta), the grant's: OPTIONS epsilon
    and delta (BigQuery's), when given, must be these. `composition`: the one cheapest for
    the ledger that will charge the plan (budget.composition_for)."""
    stated = parsed.options.get("epsilon")
    if isinstance(stated, (int, float)) and not isinstance(stated, bool) and \
            stated > MAX_EPSILON:
        raise QueryError(
            f"OPTIONS epsilon = {stated:g}: BigQuery's documentation sets epsilon = 1e20 to "
            "remove the noise (a demonstration on data that is not private); a table released "
            "without noise has no differential-privacy guarantee, and sage-tfx releases none: "
            f"every release is noised within its grant, at epsilon at most {MAX_EPSILON:g}. "
            "Give the epsilon you mean to spend (nothing was charged)")
    for name, granted in (("epsilon", epsilon), ("delta", delta)):
        stated = parsed.options.get(name)
        if stated is not None and not (isinstance(stated, (int, float))
                                       and math.isclose(stated, granted, rel_tol=1e-9,
                                                        abs_tol=1e-300)):
            raise QueryError(f"OPTIONS {name} = {stated!r}, but the grant's {name} is "
                             f"{granted:g}: give the same value (the grant is what is charged)")
    checked, query, columns = check_query(parsed, schemas, arrow_schemas)
    return PlannedQuery(checked, query, columns,
                        plan(query, epsilon, delta, composition=composition), epsilon, delta)


class GrantTerms(NamedTuple):
    """What to request a query's grant with: each step's exact fraction of the budget, the
    dp-accounting event it runs, and the delta partition selection spends outside its event
    (an rdp ledger, whose RDP curves cannot carry it, refuses such a grant before charging)."""
    split: dict[str, str]
    events: dict[str, object]
    additional_delta: float


def grant_terms(budget: BudgetPlan) -> GrantTerms:
    """The terms of the grant that pays for `budget` (pass all three to the ledger; or let
    `request_grant` do it)."""
    split = {step.name: str(Decimal(step.epsilon / budget.epsilon).quantize(
        _FRACTION_DIGITS, rounding=ROUND_DOWN)) for step in budget.steps}
    return GrantTerms(split, {step.name: step.event for step in budget.steps},
                      budget.additional_delta)


def check_grant(planned: PlannedQuery, grant, accounting) -> None:
    """Refuse (QueryError; nothing consumed, nothing recorded) a grant charged elsewhere that
    was not made for `planned` or that the grant's ledger (`accounting`) could not charge."""
    _check_accountable(grant, planned.budget, accounting)  # the ledger's rule first
    _check_grant_pays(grant, planned.budget)


def _check_grant_pays(grant, budget: BudgetPlan) -> None:
    """The grant must have been made for this plan: its split and the events it recorded."""
    split, events, _ = grant_terms(budget)
    recorded = {step: event_from_json(grant.events[step]) if step in grant.events else None
                for step in events}
    # A basic ledger may have recorded no event for a step (the BlockLedger component records
    # only the mechanisms it knows); one it recorded must be what runs.
    if dict(grant.split) != split or any(
            recorded[step] is not None and recorded[step] != event
            for step, event in events.items()):
        raise QueryError(f"grant {grant.grant_id} was not made for this query: its split is "
                         f"{dict(grant.split)}, the query's plan needs {split} with each step's "
                         "event (charge it with release.charge(ledger, "
                         "planned.release_plan(...), selector))")


def _check_accountable(grant, budget: BudgetPlan, accounting) -> None:
    """Refuse (QueryError, before anything is consumed or released) a plan that the accountant
    of the grant's ledger would not have charged on the grant's budget. A grant requested by
    hand without the plan's additional_delta passes the split and event checks, yet e.g. an
    rdp ledger then charged only the events' curve while partition selection spends delta
    outside them. The rule is the accountant's (grant_demand), asked here as at request time."""
    check_accountable(BudgetRequest(epsilon=grant.epsilon, delta=grant.delta or 0.0),
                      grant_terms(budget), accounting,
                      f"grant {grant.grant_id} cannot pay for this query's plan")


def check_accountable(request: BudgetRequest, terms: GrantTerms, accounting,
                      refused: str) -> None:
    """QueryError (`refused`: who cannot pay for what, then the accountant's reason) unless the
    accountant (`accounting`, a ledger's) would charge `request` with these terms: each step's
    split and event, and the delta spent outside the events. Asked before a charge (a front
    door's preflight) and after one (a grant charged elsewhere: `check_grant`)."""
    try:
        accounting.grant_demand(request, terms.split, terms.events, terms.additional_delta)
    except BadRequest as error:
        raise QueryError(f"{refused}: {error}; nothing was released") from None


def require_epsilon_delta(grant, needs: str) -> tuple[float, float]:
    """The grant's (epsilon, delta); QueryError for an RDP-curve grant, which has neither."""
    if grant.epsilon is None:
        raise QueryError(f"grant {grant.grant_id} is an RDP curve; {needs} needs an "
                         "(epsilon, delta) grant")
    return grant.epsilon, grant.delta or 0.0


def run(rows: pa.Table, planned: PlannedQuery, charged: Charged, unit: GuaranteeUnit,
        engine: Callable = aggregate, intervals: bool = False,
        non_negative_counts: bool = False) -> Release:
    """Consume every share of the charged grant, then run the operator on `rows` with `engine`
    (local.aggregate, or a caller's wrapper of beam.aggregate_with_beam, called with the
    keyword `intervals`). The grant was charged from `planned` (release.charge), or checked to
    pay for it (`check_grant`).

    Post-processing of what was released, at no budget: `intervals` adds after each aggregate
    its noise standard deviation and 95% interval (`<name>_stddev`, `<name>_ci_low`,
    `<name>_ci_high`; accuracy.py; computed only when asked); `non_negative_counts` clamps
    COUNT values (and their intervals) at 0; a release made with it states
    NON_NEGATIVE_COUNTS in its guarantee."""
    budget = planned.budget
    for step in budget.steps:
        charged.share(step.name)
    release = engine(rows, planned.query, budget, unit, intervals=intervals)
    table = release.table.copy()
    stated = release.intervals.copy() if intervals else None
    if non_negative_counts:
        for counted in planned.query.aggregates:
            if counted.kind in (AggregateKind.COUNT, AggregateKind.COUNT_DISTINCT):
                name = counted.output_name
                table[name] = table[name].clip(lower=0.0)
                if stated is not None:
                    low, high = accuracy.interval_columns(name)[1:]
                    stated[low], stated[high] = stated[low].clip(lower=0.0), stated[high].clip(
                        lower=0.0)
    columns = list(planned.columns)
    if intervals:
        table = pd.concat([table, stated], axis=1)
        columns = [column for name in planned.columns for column in (
            [name, *accuracy.interval_columns(name)]
            if name + accuracy.SUFFIXES[0] in stated.columns else [name])]  # keys have none
    return dataclasses.replace(release, table=table[columns])


def nothing_released(planned: PlannedQuery, unit_column: str) -> str:
    """Why a release has no row, in public numbers only (the rule, its budget, the options):
    every group's noisy unit count fell short of partition selection's threshold."""
    query = planned.query
    step = planned.budget.step(SELECTION_STEP)
    threshold = units_kept_half_the_time(query, step)
    size = (f"a group is kept with probability 1/2 or more only from about {threshold} "
            f"distinct {unit_column} values")
    return (f"no group released: partition selection ({SelectionRule(query.selection).value}, "
            f"epsilon {step.epsilon:g} of the query's {planned.epsilon:g}, delta {step.delta:g}, "
            f"max_groups_contributed = {query.max_partitions_contributed}) dropped every group; "
            f"{size}. To release smaller groups: list them (OPTIONS(public_groups = (...)): no "
            "selection and no budget spent on it), raise --epsilon, or lower "
            "max_groups_contributed (each unit then counts in fewer groups, and the "
            "threshold falls)")


# What a release made with non_negative_counts states with its guarantee (Guarantee.mechanism).
NON_NEGATIVE_COUNTS = "counts clamped at 0 by post-processing"


def stated_mechanism(planned: PlannedQuery, non_negative_counts: bool = False) -> Optional[str]:
    """What a release states with its guarantee (Guarantee.mechanism), every front door alike:
    over public groups, the C_eff its noise is calibrated for (AggregationQuery.
    partitions_per_unit: min(max_groups_contributed, the number of public groups)), under the
    weighted Gaussian selection the delta charged for its sampler, and NON_NEGATIVE_COUNTS
    when asked. Public numbers only: the options and the group list."""
    query = planned.query
    parts = []
    if SelectionRule(query.selection) is SelectionRule.PUBLIC:
        groups = len(query.public_partitions)
        parts.append(f"noise calibrated for a unit in at most {query.partitions_per_unit} "
                     f"group(s): min(max_groups_contributed {query.max_partitions_contributed}, "
                     f"{groups} public group(s))")
    if SelectionRule(query.selection) is SelectionRule.WEIGHTED_GAUSSIAN:
        rounding = planned.budget.step(SELECTION_STEP).rounding_delta
        parts.append(f"delta includes {rounding:.2g} for the weighted Gaussian selection's "
                     "floating-point sampler ((1 + e^epsilon) C 2^-49)")
    if non_negative_counts:
        parts.append(NON_NEGATIVE_COUNTS)
    return "; ".join(parts) or None


def planned_for_grant(parsed: sql.ParsedQuery, schemas: Mapping[str, sql.TableSchema],
                      arrow_schemas: Mapping[str, pa.Schema], grant,
                      accounting) -> PlannedQuery:
    """The plan of `parsed` at the (epsilon, delta) of a grant charged elsewhere (the
    BlockLedger component's) by a ledger with `accounting`, which `run` then checks the grant
    was made for."""
    epsilon, delta = require_epsilon_delta(grant, "a DP aggregation")
    return plan_query(parsed, schemas, arrow_schemas, epsilon, delta,
                      composition_for(accounting))


def dp_aggregate(data: Union[pa.Table, pd.DataFrame], query_sql: str, grant, ledger,
                 unit: GuaranteeUnit = GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ,
                 intervals: bool = False, non_negative_counts: bool = False) -> Release:
    """The DP aggregation of `data` (an Arrow table or a pandas frame) under `grant`, a ledger
    Grant made for this query (`release.charge(ledger, planned.release_plan(...), selector)`)
    with the `ledger` that issued it.

    `query_sql`: DP SQL whose FROM names any table (it is `data`) and whose OPTIONS name the
    unit (`privacy_unit_column = uid`). Every share of the grant is consumed before anything
    runs, so a grant pays for one release; the grant's outcome is recorded (released, or
    failed with a public reason). `intervals`, `non_negative_counts`: as `run`'s."""
    if isinstance(data, pd.DataFrame):
        data = pa.Table.from_pandas(data, preserve_index=False)
    if not isinstance(data, pa.Table):
        raise QueryError(f"data must be a pyarrow.Table or a pandas.DataFrame, got "
                         f"{type(data).__name__}")
    parsed = sql.parse(query_sql)
    unit_column = parsed.options.get("privacy_unit_column")
    if not isinstance(unit_column, str):
        raise QueryError("on a frame, name the unit in the query: OPTIONS(privacy_unit_column "
                         "= uid)")
    names = sql.table_names(parsed)
    schema = sql.TableSchema(unit_column, {field.name: sql.column_kind(field.type)
                                           for field in data.schema})
    planned = planned_for_grant(parsed, {name: schema for name in names},
                                {name: data.schema for name in names}, grant,
                                ledger.accounting)
    check_grant(planned, grant, ledger.accounting)
    with consume(ledger, grant, list(grant.split), "dp_aggregate()") as charged:
        release = run(relation.evaluate(planned.checked, lambda _: data), planned, charged, unit,
                      intervals=intervals, non_negative_counts=non_negative_counts)
        charged.released(guarantee=charged.guarantee(
            unit, unit_column, mechanism=stated_mechanism(planned, non_negative_counts)))
    return release
