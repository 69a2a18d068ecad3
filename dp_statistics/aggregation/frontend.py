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
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal
from typing import Callable, Mapping, NamedTuple, Union

import pandas as pd
import pyarrow as pa

from sage_tfx.dp_statistics.aggregation import relation, sql
from sage_tfx.dp_statistics.aggregation.budget import BudgetPlan, plan
from sage_tfx.dp_statistics.aggregation.local import aggregate
from sage_tfx.dp_statistics.aggregation.release import Release
from sage_tfx.dp_statistics.aggregation.spec import AggregationQuery, QueryError
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
               delta: float) -> PlannedQuery:
    """`check_query`, then the budget plan at (epsilon, delta)."""
    checked, query, columns = check_query(parsed, schemas, arrow_schemas)
    return PlannedQuery(checked, query, columns, plan(query, epsilon, delta), epsilon, delta)


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
    _check_grant_pays(grant, planned.budget)
    _check_accountable(grant, planned.budget, accounting)


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
    split, events, additional_delta = grant_terms(budget)
    try:
        accounting.grant_demand(BudgetRequest(epsilon=grant.epsilon, delta=grant.delta or 0.0),
                                split, events, additional_delta)
    except BadRequest as error:
        raise QueryError(f"grant {grant.grant_id} cannot pay for this query's plan: {error}; "
                         "nothing was released") from None


def run(rows: pa.Table, planned: PlannedQuery, charged: Charged, unit: GuaranteeUnit,
        engine: Callable = aggregate) -> Release:
    """Consume every share of the charged grant, then run the operator on `rows` with `engine`
    (local.aggregate, or a caller's wrapper of beam.aggregate_with_beam). The grant was charged
    from `planned` (release.charge), or checked to pay for it (`check_grant`)."""
    budget = planned.budget
    for step in budget.steps:
        charged.share(step.name)
    release = engine(rows, planned.query, budget, unit)
    return dataclasses.replace(release, table=release.table[list(planned.columns)])


def planned_for_grant(parsed: sql.ParsedQuery, schemas: Mapping[str, sql.TableSchema],
                      arrow_schemas: Mapping[str, pa.Schema], grant) -> PlannedQuery:
    """The plan of `parsed` at the (epsilon, delta) of a grant charged elsewhere (the
    BlockLedger component's), which `run` then checks the grant was made for."""
    if grant.epsilon is None:
        raise QueryError(f"grant {grant.grant_id} is an RDP curve; a DP aggregation needs an "
                         "(epsilon, delta) grant")
    return plan_query(parsed, schemas, arrow_schemas, grant.epsilon, grant.delta or 0.0)


def dp_aggregate(data: Union[pa.Table, pd.DataFrame], query_sql: str, grant, ledger,
                 unit: GuaranteeUnit = GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ) -> Release:
    """The DP aggregation of `data` (an Arrow table or a pandas frame) under `grant`, a ledger
    Grant made for this query (`release.charge(ledger, planned.release_plan(...), selector)`)
    with the `ledger` that issued it.

    `query_sql`: DP SQL whose FROM names any table (it is `data`) and whose OPTIONS name the
    unit (`privacy_unit_column = uid`). Every share of the grant is consumed before anything
    runs, so a grant pays for one release; the grant's outcome is recorded (released, or
    failed with a public reason)."""
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
                                {name: data.schema for name in names}, grant)
    check_grant(planned, grant, ledger.accounting)
    with consume(ledger, grant, list(grant.split), "dp_aggregate()") as charged:
        release = run(relation.evaluate(planned.checked, lambda _: data), planned, charged, unit)
        charged.released(guarantee=charged.guarantee(unit, unit_column))
    return release
