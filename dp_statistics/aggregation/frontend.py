"""DP SQL and DP aggregation for users: over ingested tables (`sage-tfx query`), over a frame in
Python (`dp_aggregate`), and in TFX (components/dp_aggregate). Thin: parsing and the ownership
checks are sql.py's, the relation below the operator relation.py's, the operator the core's.

A grant pays for exactly one run of one query. Its split among the query's steps (`grant_terms`)
is the plan's, recorded on the grant with each step's dp-accounting event; before anything is
released, every step's share is consumed in the ledger (one record per share, so a second run on
the same grant is refused) and the plan made from the grant's own (epsilon, delta) must give the
recorded split and events.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Optional, Union

import pandas as pd
import pyarrow as pa

from sage_tfx.dp_statistics.aggregation import relation, sql
from sage_tfx.dp_statistics.aggregation.budget import BudgetPlan, plan
from sage_tfx.dp_statistics.aggregation.local import aggregate
from sage_tfx.dp_statistics.aggregation.release import Release
from sage_tfx.dp_statistics.aggregation.spec import (AggregationQuery, GuaranteeUnit,
                                                     QueryError)
from sage_tfx.sage_access.accounting import BudgetRequest, event_from_json
from sage_tfx.sage_access.errors import BadRequest

if TYPE_CHECKING:
    from sage_tfx.sage_access.ledger import Grant

# A step's fraction of the grant, written exactly (decimal) and rounded down, so the fractions
# never sum to more than 1 (sage_access.ledger.check_split).
_FRACTION_DIGITS = Decimal("1e-15")


@dataclass(frozen=True)
class PreparedQuery:
    """A checked SQL query and the operator's query for it; `columns` is the released table's
    column order (the SELECT list, NTILE expanded)."""
    checked: sql.CheckedQuery
    query: AggregationQuery
    columns: tuple[str, ...]


def prepare(text: str, schemas: Mapping[str, sql.TableSchema],
            arrow_schemas: Mapping[str, pa.Schema]) -> PreparedQuery:
    """Parse and check `text` against the tables (refusing it, with the clause named, before
    anything is read or charged), including a run of its relation on empty tables."""
    checked = sql.check(sql.parse(text), schemas)
    query, columns = sql.to_query(checked)
    relation.check_on_schema(checked, arrow_schemas)
    return PreparedQuery(checked, query, columns)


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


def request_grant(ledger, selector, query: AggregationQuery, epsilon: float, delta: float,
                  **request_options) -> "Grant":
    """Charge `ledger` for one run of `query` on the blocks `selector` picks, with the terms of
    its plan at (epsilon, delta): the ledger refuses (nothing charged) a grant it cannot
    account, e.g. an rdp ledger one whose selection spends delta outside its event, so a
    grant made here is never charged for a release `dp_aggregate` would refuse."""
    terms = grant_terms(plan(query, epsilon, delta))
    return ledger.request(selector, epsilon, delta, split=terms.split, events=terms.events,
                          additional_delta=terms.additional_delta, **request_options)


def _budget_of(grant, query: AggregationQuery) -> BudgetPlan:
    """The plan made from the grant's own budget; it must be the one the grant recorded."""
    if grant.epsilon is None:
        raise QueryError(f"grant {grant.grant_id} is an RDP curve; a DP aggregation needs an "
                         "(epsilon, delta) grant")
    budget = plan(query, grant.epsilon, grant.delta or 0.0)
    split, events, _ = grant_terms(budget)
    if hasattr(grant, "check_event"):  # a component's GrantInfo reads events from the ledger
        recorded = {step: grant.event(step) for step in events}
    else:  # a ledger Grant carries them as JSON
        recorded = {step: event_from_json(grant.events[step]) if step in grant.events else None
                    for step in events}
    # A basic ledger may have recorded no event for a step (the BlockLedger component records
    # only the mechanisms it knows); one it recorded must be what runs.
    if dict(grant.split) != split or any(
            recorded[step] is not None and recorded[step] != event
            for step, event in events.items()):
        raise QueryError(f"grant {grant.grant_id} was not made for this query: its split is "
                         f"{dict(grant.split)}, the query's plan needs {split} with each step's "
                         "event (request the grant with "
                         "frontend.request_grant(ledger, selector, query, epsilon, delta))")
    return budget


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


def run(rows: pa.Table, prepared_query: AggregationQuery, grant, use_share,
        unit: GuaranteeUnit, columns: Optional[tuple[str, ...]] = None,
        engine: Callable = aggregate, *, accounting) -> Release:
    """Consume every share of `grant` (`use_share(step)`), then run the operator on `rows`
    with `engine` (local.aggregate, or a caller's wrapper of beam.aggregate_with_beam).
    `accounting`: the accounting of the ledger that issued the grant (`ledger.accounting`),
    which must be able to charge the query's plan on the grant's budget."""
    budget = _budget_of(grant, prepared_query)
    _check_accountable(grant, budget, accounting)
    for step in budget.steps:
        use_share(step.name)
    release = engine(rows, prepared_query, budget, unit)
    if columns is not None:
        release = dataclasses.replace(release, table=release.table[list(columns)])
    return release


def dp_aggregate(data: Union[pa.Table, pd.DataFrame], query_or_sql: Union[str, AggregationQuery],
                 grant, ledger=None, unit: GuaranteeUnit = GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ
                 ) -> Release:
    """The DP aggregation of `data` (an Arrow table or a pandas frame) under `grant`.

    `query_or_sql`: an AggregationQuery, or DP SQL whose FROM names any table (it is `data`)
    and whose OPTIONS name the unit (`privacy_unit_column = uid`). `grant`: what the ledger
    granted for this query (made with `request_grant(ledger, selector, query, epsilon, delta)`,
    which an rdp ledger refuses before charging when the selection spends delta), either
    a component's GrantInfo (privacy_grant.require_grant) or a ledger Grant with the `ledger`
    that issued it. Every share of the grant is consumed before anything runs, so a grant
    pays for one release."""
    if isinstance(data, pd.DataFrame):
        data = pa.Table.from_pandas(data, preserve_index=False)
    if not isinstance(data, pa.Table):
        raise QueryError(f"data must be a pyarrow.Table or a pandas.DataFrame, got "
                         f"{type(data).__name__}")
    if hasattr(grant, "share") and hasattr(grant, "consumer"):  # a component's GrantInfo
        use_share, accounting = grant.share, grant.ledger.accounting
    elif ledger is not None:
        def use_share(step: str) -> None:
            ledger.use_share(grant, step, consumer="dp_aggregate")
        accounting = ledger.accounting
    else:
        raise QueryError("pass the ledger that issued the grant (ledger=...), so that its shares "
                         "are spent once")
    if isinstance(query_or_sql, AggregationQuery):
        return run(data, query_or_sql, grant, use_share, unit, accounting=accounting)
    parsed = sql.parse(query_or_sql)
    unit_column = parsed.options.get("privacy_unit_column")
    if not isinstance(unit_column, str):
        raise QueryError("on a frame, name the unit in the query: OPTIONS(privacy_unit_column "
                         "= uid)")
    names = [table.name for table in parsed.select.find_all(sql.exp.Table)]
    schema = sql.TableSchema(unit_column, {field.name: sql.column_kind(field.type)
                                           for field in data.schema})
    prepared = prepare(query_or_sql, {name: schema for name in names},
                       {name: data.schema for name in names})
    rows = relation.evaluate(prepared.checked, lambda _: data)
    return run(rows, prepared.query, grant, use_share, unit, prepared.columns,
               accounting=accounting)
