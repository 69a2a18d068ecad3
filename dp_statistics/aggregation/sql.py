"""DP SQL: `SELECT WITH ANONYMIZATION ...` parsed (sqlglot) and checked against the seed's
row-ownership rules, before anything is read or charged.

    SELECT WITH ANONYMIZATION [OPTIONS(max_groups_contributed = 4, ...)]
           key, ANON_COUNT(*), ANON_SUM(fare, 0, 50), ANON_AVG(fare, 0, 50), ANON_MEDIAN(secs)
    FROM trips [AS t] [JOIN riders [AS r] USING (uid)] [WHERE ...]
    GROUP BY key

`WITH DIFFERENTIAL_PRIVACY` (BigQuery's spelling) is accepted for `WITH ANONYMIZATION`.
sqlglot has no grammar for `SELECT WITH ANONYMIZATION OPTIONS(...)`, so the clause is cut out of
the text by *token* position (sqlglot's own tokenizer, so a string literal that happens to read
"WITH ANONYMIZATION" is never touched) and its option list is parsed by sqlglot as the select
list `SELECT name = value, ...`. The rest is parsed by sqlglot as ordinary SQL; no grammar is
hand-written here.

Aggregates (ZetaSQL's ANON_ names; bounds are literals, or omitted to be inferred with DP when
the query allows it): ANON_COUNT(*), ANON_COUNT(col), ANON_COUNT(DISTINCT <unit>),
ANON_SUM/AVG/VAR/STDDEV(expr[, lower, upper]), ANON_MEDIAN/MIN/MAX(expr[, lower, upper]),
ANON_PERCENTILE_CONT(expr, p[, lower, upper]) and ANON_NTILE(expr, n[, lower, upper]) (the
n-1 cut points of n equal parts). An aggregate's argument may be any row-wise expression.

BigQuery's spelling is accepted in the DP SELECT list: COUNT(*), COUNT(expr), SUM, AVG and
PERCENTILE_CONT(expr, p), with bounds as `contribution_bounds_per_group => (lower, upper)`
(SUM and COUNT: the unit's total, or count of rows, in the group is clamped, BigQuery's
meaning; AVG: each value is clamped, and AVG is the mean of the rows read, not BigQuery's mean
of per-unit means) or
`contribution_bounds_per_row => (lower, upper)` (SUM, PERCENTILE_CONT: each row), and
OPTIONS epsilon and delta (equal to the grant's). A query without GROUP BY releases one row,
the total (one public group: no selection). Outside the DP SELECT list (a subquery), SUM and
COUNT are SQL's per-unit reductions.

Row ownership (the seed's Table 4.3; uid is the unit column recorded at ingest). Every row the
operator reads must be owned by exactly one unit, so every operator below it must derive each
output row from rows of one unit only and carry uid along:

| operator | allowed form | refused (the error names the clause) |
| --- | --- | --- |
| projection (subquery SELECT list) | keeps uid, the column itself | no uid; uid replaced (below) |
| selection (WHERE) | any row-wise predicate | a subquery inside it (it reads other units' rows) |
| aggregation (subquery GROUP BY) | groups by uid (and more) | aggregates not grouped by uid |
| join | `USING (uid)`, or `ON a.uid = b.uid` | any other condition, a cross join |

A join compares the unit columns' names only: the tables' unit columns must hold the same
people's ids (the ingesting user's promise; no check can see it), else a joined row mixes people.

A subquery's output named uid must be the uid column itself (not an expression, nor another
column aliased uid), and no two of its outputs may share a name: either would let a value other
than the unit stand in for it, and the operator would bound the wrong thing.
Window functions (they read other rows), set operations, and ANON_ aggregates below the top
level are refused too. WHERE is applied to each row before the operator (a row-wise map: one
unit's rows pass or not independently of every other unit's).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import pyarrow as pa
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError
from sqlglot.parser import Parser
from sqlglot.tokens import TokenType

from sage_tfx.dp_statistics.aggregation.spec import (
    DEFAULT_MAX_CONTRIBUTIONS_PER_PARTITION, DEFAULT_MAX_PARTITIONS_CONTRIBUTED, Aggregate,
    AggregateKind, AggregationQuery, BoundsScope, NoiseKind, QueryError,
    SelectionRule)

DP_KEYWORDS = ("ANONYMIZATION", "DIFFERENTIAL_PRIVACY")
# ANON_ name -> (aggregate kind, whether a column argument is required).
# ANON_COUNT(expr): the rows where expr is not null (relation.evaluate passes it as presence).
COUNT_COLUMN = "count_column"
ANON_FUNCTIONS = {
    "ANON_COUNT": "count", "ANON_SUM": "sum", "ANON_AVG": "mean", "ANON_VAR": "variance",
    "ANON_STDDEV": "stddev", "ANON_NTILE": "ntile", "ANON_MEDIAN": "median",
    "ANON_MIN": "min", "ANON_MAX": "max", "ANON_PERCENTILE_CONT": "percentile",
}
# BigQuery's names of the DP aggregates (in the DP SELECT list only; parse() renames them to
# BIGQUERY_PREFIX + name) and the ANON_ function each is.
BIGQUERY_PREFIX = "BQ_"
BIGQUERY_NAMES = {"COUNT": "ANON_COUNT", "SUM": "ANON_SUM", "AVG": "ANON_AVG",
                  "PERCENTILE_CONT": "ANON_PERCENTILE_CONT"}
# Plain aggregates a subquery grouped by the unit may use (a per-unit, pre-DP reduction), with
# their pyarrow hash-aggregate names.
INNER_AGGREGATES = {exp.Sum: "sum", exp.Count: "count", exp.Avg: "mean", exp.Min: "min",
                    exp.Max: "max"}
# Clauses of a SELECT that the operator does not support (set operations are separate nodes).
_UNSUPPORTED_CLAUSES = ("having", "qualify", "windows", "limit", "offset", "order", "distinct",
                        "with", "laterals", "pivots", "sample", "into", "kind", "connect",
                        "prewhere", "cluster", "distribute", "sort", "match", "locks")


# ---------------------------------------------------------------- the relation below the operator
@dataclass(frozen=True)
class Scan:
    """Rows of one ingested table (`alias` is how the query names it)."""
    table: str
    alias: str


@dataclass(frozen=True)
class Join:
    """Rows of `left` and `right` with equal unit (inner, or left outer)."""
    left: "Relation"
    right: "Relation"
    kind: str  # "inner" | "left outer"
    clause: str
    right_suffix: str  # appended to the right side's column names (the unit's is shared)


@dataclass(frozen=True)
class Filter:
    """Rows of `child` for which the predicate is true (a row-wise map)."""
    child: "Relation"
    predicate: exp.Expression


@dataclass(frozen=True)
class Project:
    """One row per row of `child`: the unit and the named row-wise expressions."""
    child: "Relation"
    items: tuple[tuple[str, exp.Expression], ...]


@dataclass(frozen=True)
class GroupByUnit:
    """A subquery aggregation grouped by the unit (and `keys`): one row per (unit, keys)."""
    child: "Relation"
    keys: tuple[tuple[str, exp.Expression], ...]
    aggregates: tuple[tuple[str, str, Optional[exp.Expression]], ...]  # (name, kind, argument)


Relation = Union[Scan, Join, Filter, Project, GroupByUnit]


@dataclass(frozen=True)
class TableSchema:
    """What ingest recorded about a table: its unit column and its columns' types."""
    unit_column: str
    columns: Mapping[str, str]  # name -> a kind of ARROW_TYPES


# A column's kind and how its values are held in Arrow (ingest's Parquet rows, DPAggregate's).
ARROW_TYPES = {"int": pa.int64(), "float": pa.float64(), "string": pa.string()}


def column_kind(arrow_type: pa.DataType) -> str:
    """The kind of a column a caller's frame holds as `arrow_type` (any width of integer or
    float; anything else is read as text)."""
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_floating(arrow_type):
        return "float"
    return "string"


@dataclass(frozen=True)
class AggregateCall:
    """One ANON_ aggregate of the SELECT list, as written."""
    name: str  # the output column
    kind: str  # a value of ANON_FUNCTIONS, COUNT_COLUMN or "count_distinct_units"
    argument: Optional[exp.Expression]  # None for COUNT(*) and COUNT(DISTINCT unit)
    lower: Optional[float] = None
    upper: Optional[float] = None
    ntiles: Optional[int] = None
    q: Optional[float] = None  # PERCENTILE_CONT's percentile
    rows_bounded: bool = False  # contribution_bounds_per_row: SUM clamps each row
    clause: str = ""


@dataclass(frozen=True)
class ParsedQuery:
    """A DP query after parsing, before its tables are known."""
    sql: str
    options: Mapping[str, object]
    select: exp.Select = field(repr=False)


@dataclass(frozen=True)
class CheckedQuery:
    """A DP query that passed every check: the relation to read (each row owned by one unit),
    the unit column in it, the group keys (output name, expression) and the aggregates."""
    parsed: ParsedQuery
    tables: tuple[str, ...]
    unit_column: str
    source: Relation
    keys: tuple[tuple[str, exp.Expression], ...]
    aggregates: tuple[AggregateCall, ...]
    output_order: tuple[str, ...]  # the SELECT list's column names, in order


# ---------------------------------------------------------------- parsing
def parse(sql: str) -> ParsedQuery:
    """The query's DP clause and options cut out (see the module docstring), the rest parsed.

    The body is parsed from the tokens of the user's own text (the DP clause's tokens left
    out), so a parse error's line, column and context are those of the text the user wrote."""
    if not isinstance(sql, str) or not sql.strip():
        raise QueryError("the query is empty")
    try:
        tokens = sqlglot.tokenize(sql)
    except TokenError as error:
        raise QueryError(f"the query does not parse: {_plain(str(error))}") from None
    if (len(tokens) < 3 or tokens[0].token_type != TokenType.SELECT
            or tokens[1].token_type != TokenType.WITH
            or tokens[2].text.upper() not in DP_KEYWORDS):
        raise QueryError("a DP query starts with SELECT WITH ANONYMIZATION (or SELECT WITH "
                         "DIFFERENTIAL_PRIVACY); this one does not")
    body_start = 3
    options: dict[str, object] = {}
    if len(tokens) > 4 and tokens[3].text.upper() == "OPTIONS" and \
            tokens[4].token_type == TokenType.L_PAREN:
        depth, close = 0, None
        for index in range(4, len(tokens)):
            depth += {TokenType.L_PAREN: 1, TokenType.R_PAREN: -1}.get(tokens[index].token_type, 0)
            if depth == 0:
                close = index
                break
        if close is None:
            raise QueryError("OPTIONS( ... is not closed")
        options = _options(sql[tokens[4].end + 1:tokens[close].start])
        body_start = close + 1
    body = [tokens[0], *tokens[body_start:]]
    _mark_dp_aggregates(body)
    try:
        statements = Parser().parse(body, sql)
    except ParseError as error:
        raise QueryError(f"the query does not parse: {_parse_error(error)}") from None
    except TokenError as error:
        raise QueryError(f"the query does not parse: {_plain(str(error))}") from None
    statements = [s for s in statements if s is not None]
    if len(statements) != 1:
        raise QueryError(f"give exactly one SELECT statement, got {len(statements)}")
    select = statements[0]
    if not isinstance(select, exp.Select):
        raise QueryError(f"the DP query must be one SELECT, got {type(select).__name__.upper()}: "
                         f"{_clause(select)}")
    return ParsedQuery(sql=sql, options=options, select=select)


def _mark_dp_aggregates(body: list) -> None:
    """BigQuery's spelling: COUNT, SUM, AVG and PERCENTILE_CONT called in the DP SELECT list
    (before its FROM, at any depth) are the DP aggregates. sqlglot's own Sum/Avg/... take one
    argument and no `name => value`, so these calls are renamed, token by token, to the
    internal BQ_ names (BIGQUERY_FUNCTIONS); a subquery's SUM (in FROM) stays SQL's."""
    depth = 0
    for index, token in enumerate(body[1:-1], start=1):
        depth += {TokenType.L_PAREN: 1, TokenType.R_PAREN: -1}.get(token.token_type, 0)
        if depth == 0 and token.token_type == TokenType.FROM:
            return
        if token.text.upper() in BIGQUERY_NAMES and \
                body[index + 1].token_type == TokenType.L_PAREN:
            token.text = BIGQUERY_PREFIX + token.text.upper()
            token.token_type = TokenType.VAR


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _plain(text: str) -> str:
    """sqlglot's message without the terminal's underline escapes."""
    return _ANSI_ESCAPE.sub("", text)


def _parse_error(error: ParseError) -> str:
    """The first error sqlglot reports, on the user's text: what is wrong, where (line and
    column of the text as written) and the words around it."""
    if not error.errors:
        return _plain(str(error))
    first = error.errors[0]
    near = " ".join(_plain((first.get("start_context") or "")[-30:]
                           + (first.get("highlight") or "")).split())
    description = re.sub(r"<class '[\w.]*?(\w+)'>", r"\1", str(first.get("description")))
    return (f"{description} at line {first.get('line')}, column {first.get('col')}, "
            f"near \"{near}\"")


def _options(text: str) -> dict[str, object]:
    """OPTIONS(name = literal, ...) as {lower-case name: Python value}."""
    if not text.strip():
        return {}
    try:
        items = sqlglot.parse_one("SELECT " + text).expressions
    except ParseError as error:  # its positions are of "SELECT " + text: not shown
        reason = error.errors[0].get("description") if error.errors else "invalid syntax"
        raise QueryError(f"OPTIONS({text}) does not parse: {reason}") from None
    except TokenError as error:
        raise QueryError(f"OPTIONS({text}) does not parse: {_plain(str(error))}") from None
    options = {}
    for item in items:
        if not (isinstance(item, exp.EQ) and isinstance(item.this, exp.Column)
                and not item.this.table):
            raise QueryError(f"OPTIONS: {_clause(item)} is not `name = value`")
        name = item.this.name.lower()
        if name in options:
            raise QueryError(f"OPTIONS names {name} twice")
        options[name] = _literal(item.expression, f"OPTIONS {name}")
    return options


def _literal(node: exp.Expression, where: str):
    """A literal's Python value (numbers, strings, booleans, NULL, tuples of them)."""
    if isinstance(node, exp.Paren):
        return _literal(node.this, where)
    if isinstance(node, exp.Neg):
        value = _literal(node.this, where)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value
    if isinstance(node, exp.Literal):
        if node.is_string:
            return node.this
        text = node.this
        return int(text) if text.lstrip("+-").isdigit() else float(text)
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Tuple):
        return tuple(_literal(item, where) for item in node.expressions)
    if isinstance(node, exp.Column) and not node.table:  # a bare word: an enum name
        return node.name
    raise QueryError(f"{where}: {_clause(node)} is not a literal")


def _clause(node: exp.Expression) -> str:
    """The node as SQL, as the user spelled it (BigQuery's names without the internal BQ_)."""
    text = re.sub(rf"\b{BIGQUERY_PREFIX}({'|'.join(BIGQUERY_NAMES)})\(", r"\1(", node.sql())
    return text if len(text) <= 160 else text[:157] + "..."


def _check_name(name: str, where: str) -> str:
    """An output (or unit) column's name, refused when it could collide with the relation's
    internal columns (relation.py names them `__value<i>` and `__argument<i>`): a collision
    would silently replace one column by another."""
    if name.startswith(RESERVED_PREFIX):
        raise QueryError(f"{where}: the name {name} starts with {RESERVED_PREFIX}, which is "
                         "reserved for the operator's internal columns; choose another name")
    return name


# ---------------------------------------------------------------- checking
class _Scope:
    """The columns a relation exposes: unqualified and alias-qualified names -> internal name."""

    def __init__(self, unit: str):
        self.unit = unit
        self.plain: dict[str, Optional[str]] = {}  # None: ambiguous
        self.qualified: dict[tuple[str, str], str] = {}
        self.types: dict[str, str] = {}

    def add(self, alias: Optional[str], name: str, internal: str, kind: str) -> None:
        self.plain[name] = internal if self.plain.get(name, internal) == internal else None
        if alias:
            self.qualified[(alias, name)] = internal
        self.types[internal] = kind

    def resolve(self, column: exp.Column, where: str) -> str:
        name, alias = column.name, column.table
        if alias:
            if (alias, name) not in self.qualified:
                raise QueryError(f"{where}: unknown column {alias}.{name}")
            return self.qualified[(alias, name)]
        if name not in self.plain:
            known = ", ".join(sorted(self.plain))
            raise QueryError(f"{where}: unknown column {name} (known: {known})")
        if self.plain[name] is None:
            raise QueryError(f"{where}: column {name} is ambiguous; qualify it (alias.{name})")
        return self.plain[name]


def table_names(parsed: ParsedQuery) -> tuple[str, ...]:
    """The tables the query names, each once, in order of appearance."""
    return tuple(dict.fromkeys(table.name for table in parsed.select.find_all(exp.Table)))


def check(parsed: ParsedQuery, schemas: Mapping[str, TableSchema]) -> CheckedQuery:
    """The query checked against the tables' schemas and the row-ownership rules."""
    select = parsed.select
    _refuse_unsupported(select, "the DP query")
    if not select.args.get("from_"):
        raise QueryError("the DP query has no FROM clause")
    tables: list[str] = []
    source, scope = _source(select, schemas, tables)
    unit = _check_name(scope.unit, "the privacy unit column")
    group = select.args.get("group")
    group_items = list(group.expressions) if group else []
    keys: list[tuple[str, exp.Expression]] = []
    aggregates: list[AggregateCall] = []
    order: list[str] = []
    aliases = {item.alias: item.this for item in select.expressions
               if isinstance(item, exp.Alias) and not _is_anon(item.this)}
    key_exprs = []  # GROUP BY, resolved to the relation's columns
    for item in group_items:
        if isinstance(item, exp.Column) and not item.table and item.name in aliases \
                and item.name not in scope.plain:
            item = aliases[item.name]
        key_exprs.append(_check_row_wise(item, scope, f"GROUP BY {_clause(item)}"))
    for index, item in enumerate(select.expressions):
        inner = item.this if isinstance(item, exp.Alias) else item
        if isinstance(inner, exp.Star):
            raise QueryError("SELECT *: a DP query names its group keys and aggregates")
        name = _check_name(item.alias if isinstance(item, exp.Alias)
                           else _default_name(inner, index), f"SELECT {_clause(item)}")
        if _is_anon(inner):
            aggregates.append(_aggregate_call(name, inner, scope))
        else:
            if _contains_anon(inner):
                raise QueryError(f"SELECT {_clause(item)}: an ANON_ aggregate inside an "
                                 "expression is not supported; select it on its own")
            resolved = _check_row_wise(inner, scope, f"SELECT {_clause(item)}")
            if resolved not in key_exprs:
                raise QueryError(f"SELECT {_clause(item)}: not an ANON_ aggregate and not in "
                                 "GROUP BY")
            keys.append((name, resolved))
        if name in order:
            raise QueryError(f"SELECT: two output columns are named {name}; alias one")
        order.append(name)
    if not aggregates:
        raise QueryError("the DP query selects no ANON_ aggregate")
    for key, item in zip(key_exprs, group_items):
        if not any(key == expression for _, expression in keys):
            raise QueryError(f"GROUP BY {_clause(item)} is not in the SELECT list (every group "
                             "key is released with its row)")
    if not group_items:  # one public group, the total: a constant key, never released
        keys.append((TOTAL_KEY, exp.Literal.number(TOTAL_GROUP)))
    return CheckedQuery(parsed=parsed, tables=tuple(dict.fromkeys(tables)), unit_column=unit,
                        source=source, keys=tuple(keys), aggregates=tuple(aggregates),
                        output_order=tuple(order))


def _function_name(node: exp.Anonymous) -> str:
    """The ANON_ name of a DP aggregate call (BigQuery's SUM is ANON_SUM)."""
    name = node.name.upper()
    if name.startswith(BIGQUERY_PREFIX) and name[len(BIGQUERY_PREFIX):] in BIGQUERY_NAMES:
        return BIGQUERY_NAMES[name[len(BIGQUERY_PREFIX):]]
    return name


def _default_name(node: exp.Expression, index: int) -> str:
    """An unaliased output column's name: a column's own name; ANON_SUM(fare) -> anon_sum_fare,
    SUM(fare) -> sum_fare."""
    if isinstance(node, exp.Column):
        return node.name
    if _is_anon(node):
        argument = node.expressions[0] if node.expressions else None
        if isinstance(argument, exp.Distinct):
            argument = argument.expressions[0]
        suffix = f"_{argument.name}" if isinstance(argument, exp.Column) else ""
        return node.name.lower().removeprefix(BIGQUERY_PREFIX.lower()) + suffix
    return f"column_{index}"


def _is_anon(node: exp.Expression) -> bool:
    return isinstance(node, exp.Anonymous) and _function_name(node) in ANON_FUNCTIONS


def _contains_anon(node: exp.Expression) -> bool:
    return any(_is_anon(n) for n in node.walk())


def _number(node: exp.Expression, where: str) -> float:
    value = _literal(node, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise QueryError(f"{where}: {_clause(node)} must be a number literal")
    return float(value)


# BigQuery's named bounds: what each clamps (SUM: the unit's total in the group, or each row).
BOUNDS_PER_GROUP = "contribution_bounds_per_group"
BOUNDS_PER_ROW = "contribution_bounds_per_row"


def _named_bounds(call: exp.Anonymous, function: str,
                  where: str) -> tuple[list, Optional[tuple[float, float]], Optional[str]]:
    """The call's positional arguments, and its `name => (lower, upper)` bounds and their
    name, if any (BigQuery's spelling)."""
    positional, named = [], {}
    for argument in call.expressions:
        if isinstance(argument, exp.Kwarg):
            named[argument.this.name.lower()] = argument.expression
        else:
            positional.append(argument)
    if not named:
        return positional, None, None
    unknown = sorted(set(named) - {BOUNDS_PER_GROUP, BOUNDS_PER_ROW})
    if unknown or len(named) > 1:
        raise QueryError(f"{where}: give one of {BOUNDS_PER_GROUP} or {BOUNDS_PER_ROW} "
                         f"=> (lower, upper), got {sorted(named)}")
    [(kind, value)] = named.items()
    if function == "ANON_COUNT" and kind != BOUNDS_PER_GROUP:
        raise QueryError(f"{where}: COUNT clamps each unit's count in a group: use "
                         f"{BOUNDS_PER_GROUP}")
    if function == "ANON_PERCENTILE_CONT" and kind != BOUNDS_PER_ROW:
        raise QueryError(f"{where}: PERCENTILE_CONT clamps each row: use {BOUNDS_PER_ROW}")
    bounds = _literal(value, where)
    if not (isinstance(bounds, tuple) and len(bounds) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)):
        raise QueryError(f"{where}: {kind} => (lower, upper) takes two number literals")
    return positional, (float(bounds[0]), float(bounds[1])), kind


def _aggregate_call(name: str, call: exp.Anonymous, scope: _Scope) -> AggregateCall:
    where = _clause(call)
    function = _function_name(call)
    kind = ANON_FUNCTIONS[function]
    args, named, bounds_name = _named_bounds(call, function, where)
    if kind == "count" and named is not None:
        return _bounded_count(name, args, named, scope, where)
    if kind == "count":
        if len(args) == 1 and isinstance(args[0], exp.Star):
            return AggregateCall(name=name, kind="count", argument=None, clause=where)
        if len(args) == 1 and isinstance(args[0], exp.Distinct):
            distinct = args[0].expressions
            if len(distinct) == 1 and isinstance(distinct[0], exp.Column) and \
                    scope.resolve(distinct[0], where) == scope.unit:
                return AggregateCall(name=name, kind="count_distinct_units", argument=None,
                                     clause=where)
            raise QueryError(f"{where}: COUNT(DISTINCT ...) counts distinct units only "
                             f"(COUNT(DISTINCT {scope.unit})); other columns would need "
                             "cross-unit de-duplication (seed §4.2.3)")
        if len(args) == 1 and not isinstance(args[0], exp.Distinct):
            return AggregateCall(name=name, kind=COUNT_COLUMN,
                                 argument=_check_row_wise(args[0], scope, where), clause=where)
        raise QueryError(f"{where}: COUNT takes *, one expression (its rows where it is "
                         f"not null) or DISTINCT {scope.unit}")
    if not args:
        raise QueryError(f"{where}: {function} needs a column")
    written, rest = args[0], args[1:]
    argument = _check_row_wise(written, scope, where)
    ntiles = q = None
    if kind == "ntile":
        if not rest:
            raise QueryError(f"{where}: ANON_NTILE(expr, n[, lower, upper]) needs n")
        n = _number(rest[0], where)
        if n != int(n) or n < 2:
            raise QueryError(f"{where}: ANON_NTILE's n must be an integer >= 2, got {n:g}")
        ntiles, rest = int(n), rest[1:]
    if kind == "percentile":
        if not rest:
            raise QueryError(f"{where}: PERCENTILE_CONT(expr, percentile, ...) needs the "
                             "percentile, a number in [0, 1]")
        q, rest = _number(rest[0], where), rest[1:]
        if not 0.0 <= q <= 1.0:
            raise QueryError(f"{where}: the percentile must lie in [0, 1], got {q:g}")
    if named is not None and rest:
        raise QueryError(f"{where}: give the bounds once: as {bounds_name} or as arguments")
    if len(rest) not in (0, 2):
        raise QueryError(f"{where}: give both bounds (lower, upper) or neither (inferred)")
    lower = upper = None
    if rest or named:
        lower, upper = named or (_number(rest[0], where), _number(rest[1], where))
        if not lower < upper:
            raise QueryError(f"{where}: the lower bound {lower:g} must be below the upper "
                             f"bound {upper:g}")
    if _expression_type(written, scope) == "string":
        raise QueryError(f"{where}: {_clause(written)} is text; {function} needs "
                         "numbers (declare the column numeric at ingest)")
    return AggregateCall(name=name, kind=kind, argument=argument, lower=lower, upper=upper,
                         ntiles=ntiles, q=q, rows_bounded=bounds_name == BOUNDS_PER_ROW,
                         clause=where)


def _bounded_count(name: str, args: list, bounds: tuple[float, float], scope: _Scope,
                   where: str) -> AggregateCall:
    """BigQuery's COUNT(*, contribution_bounds_per_group => (lower, upper)) and COUNT(expr,
    ...): each unit's count of rows (of rows where expr is not null) in a group, clamped into
    [lower, upper], summed over units. That is the unit-scoped SUM (BoundsScope.UNIT) of a row
    indicator, 1 per row or NOT (expr IS NULL): the same operator, sensitivity and noise as
    SUM(indicator, contribution_bounds_per_group => (lower, upper))."""
    lower, upper = bounds
    if not 0.0 <= lower < upper:
        raise QueryError(f"{where}: a count's bounds must satisfy 0 <= lower < upper, got "
                         f"({lower:g}, {upper:g})")
    if len(args) == 1 and isinstance(args[0], exp.Star):
        indicator = exp.Literal.number(1)
    elif len(args) == 1 and not isinstance(args[0], exp.Distinct):
        present = exp.Not(this=exp.Is(this=_check_row_wise(args[0], scope, where),
                                      expression=exp.Null()))
        indicator = exp.Paren(this=present)
    else:
        raise QueryError(f"{where}: COUNT with {BOUNDS_PER_GROUP} takes * or one expression")
    return AggregateCall(name=name, kind="sum", argument=indicator, lower=lower, upper=upper,
                         clause=where)


def _expression_type(node: exp.Expression, scope: _Scope) -> str:
    """'string' when the expression's values can be text, else 'number'. Text flows through
    a column, a string literal, parentheses, COALESCE (any text operand) and a subquery's
    MIN/MAX of text; every other row-wise form yields numbers or booleans, or fails on the
    schema (relation.check_on_schema) before any charge."""
    if isinstance(node, exp.Column):
        return scope.types.get(scope.resolve(node, _clause(node)), "string")
    if isinstance(node, exp.Literal):
        return "string" if node.is_string else "number"
    if isinstance(node, (exp.Paren, exp.Min, exp.Max)):
        return _expression_type(node.this, scope)
    if isinstance(node, exp.Coalesce):
        operands = [node.this, *node.expressions]
        return "string" if any(_expression_type(o, scope) == "string" for o in operands) \
            else "number"
    return "number"


# Row-wise expression nodes (each output row is a function of one input row).
_ROW_WISE = (exp.Column, exp.Literal, exp.Boolean, exp.Null, exp.Paren, exp.Neg, exp.Not,
             exp.And, exp.Or, exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.Is,
             exp.In, exp.Between, exp.Add, exp.Sub, exp.Mul, exp.Div, exp.Like, exp.Abs,
             exp.Coalesce, exp.Identifier, exp.Tuple)


def _check_row_wise(node: exp.Expression, scope: _Scope, where: str) -> exp.Expression:
    """Refuse anything that reads other rows (subqueries, window functions, aggregates) or
    that the per-row evaluator does not implement; resolve every column (unknown ones refused).
    Returns a copy whose columns carry the relation's internal names, unqualified."""
    for child in node.walk():
        if isinstance(child, (exp.Subquery, exp.Select, exp.Exists)):
            raise QueryError(f"{where}: a subquery here reads other units' rows (row ownership, "
                             "seed Table 4.3); join the table USING the unit instead")
        if isinstance(child, exp.Window):
            raise QueryError(f"{where}: window function {_clause(child)} reads other rows "
                             "(row ownership, seed Table 4.3)")
        if isinstance(child, exp.AggFunc) or _is_anon(child):
            raise QueryError(f"{where}: aggregate {_clause(child)} is not allowed here")
        if isinstance(child, exp.Column):
            scope.resolve(child, where)
        elif isinstance(child, exp.Div) and "string" in (
                _expression_type(child.this, scope), _expression_type(child.expression, scope)):
            # Division converts its operands to floats row by row: text would fail on a value.
            raise QueryError(f"{where}: {_clause(child)} divides text; division needs numbers "
                             "(declare the column numeric at ingest)")
        elif not isinstance(child, _ROW_WISE):
            raise QueryError(f"{where}: {_clause(child)} ({type(child).__name__}) is not "
                             "supported in a DP query (row-wise comparisons, arithmetic, IN, "
                             "BETWEEN, LIKE, IS NULL, ABS and COALESCE are)")
    return node.transform(lambda n: exp.column(scope.resolve(n, where), quoted=True)
                          if isinstance(n, exp.Column) else n)


def _refuse_unsupported(select: exp.Select, where: str) -> None:
    for clause in _UNSUPPORTED_CLAUSES:
        value = select.args.get(clause)
        if value:
            text = value.sql() if isinstance(value, exp.Expression) else str(value)
            raise QueryError(f"{where}: {clause.upper()} ({text}) is not supported")


def _source(select: exp.Select, schemas: Mapping[str, TableSchema],
            tables: list[str]) -> tuple[Relation, _Scope]:
    """The FROM (with its joins) and WHERE of one SELECT, as a relation and its scope."""
    relation, scope = _from_item(select.args["from_"].this, schemas, tables)
    for join in select.args.get("joins") or []:
        relation, scope = _join(relation, scope, join, schemas, tables)
    where = select.args.get("where")
    if where is not None:
        relation = Filter(relation, _check_row_wise(where.this, scope,
                                                    f"WHERE {_clause(where.this)}"))
    return relation, scope


def _from_item(node: exp.Expression, schemas: Mapping[str, TableSchema],
               tables: list[str]) -> tuple[Relation, _Scope]:
    if isinstance(node, exp.Table):
        if node.args.get("db") or node.args.get("catalog"):
            raise QueryError(f"FROM {_clause(node)}: name an ingested table without a prefix")
        name = node.name
        if name not in schemas:
            known = ", ".join(sorted(schemas)) or "none"
            raise QueryError(f"FROM {name}: no such table in this ledger (ingested: {known})")
        tables.append(name)
        schema = schemas[name]
        alias = node.alias or name
        scope = _Scope(schema.unit_column)
        for column, kind in schema.columns.items():
            scope.add(alias, column, column, kind)
        return Scan(name, alias), scope
    if isinstance(node, exp.Subquery):
        inner = node.this
        if not isinstance(inner, exp.Select):
            raise QueryError(f"FROM ({_clause(inner)}): only a SELECT subquery is supported")
        relation, scope = _subquery(inner, schemas, tables)
        if node.alias:
            for name, internal in scope.plain.items():
                if internal is not None:
                    scope.qualified[(node.alias, name)] = internal
        return relation, scope
    raise QueryError(f"FROM {_clause(node)}: not a table or a subquery")


def _join(left: Relation, left_scope: _Scope, join: exp.Join,
          schemas: Mapping[str, TableSchema], tables: list[str]) -> tuple[Relation, _Scope]:
    clause = _clause(join).strip()
    side = (join.side or "").upper()
    if join.kind and join.kind.upper() not in ("INNER", "OUTER"):
        raise QueryError(f"{clause}: {join.kind.upper()} JOIN is not supported")
    if side not in ("", "LEFT"):
        public = " UNNEST(" in clause.upper() and side == "RIGHT"
        raise QueryError(f"{clause}: {side} JOIN is not supported (INNER or LEFT)" + (
            "; to release exactly a list of public groups (BigQuery's public-groups join), "
            "list them: OPTIONS(public_groups = (...))" if public else ""))
    right, right_scope = _from_item(join.this, schemas, tables)
    using = join.args.get("using")
    on = join.args.get("on")
    unit = left_scope.unit
    if right_scope.unit != unit:
        raise QueryError(f"{clause}: the joined tables' unit columns differ ({unit} and "
                         f"{right_scope.unit}); they must name the same privacy unit (and hold "
                         "the same people's ids: only the names are compared)")
    if using:
        names = [identifier.name for identifier in using]
        if unit not in names:
            raise QueryError(f"{clause}: the join is not on the privacy unit {unit} (row "
                             f"ownership, seed Table 4.3): use USING ({unit})")
        if names != [unit]:
            raise QueryError(f"{clause}: join USING ({unit}) only; put other conditions in WHERE")
    elif on is not None:
        conjuncts = list(on.flatten()) if isinstance(on, exp.And) else [on]
        on_unit = [c for c in conjuncts if _is_unit_equality(c, left_scope, right_scope)]
        if not on_unit:
            raise QueryError(f"{clause}: the join is not on the privacy unit {unit} (row "
                             f"ownership, seed Table 4.3): use USING ({unit}) or "
                             f"ON a.{unit} = b.{unit}")
        rest = [c for c in conjuncts if c not in on_unit]
        if rest:
            raise QueryError(f"{clause}: join ON the unit only; put {_clause(rest[0])} in WHERE")
    else:
        raise QueryError(f"{clause}: a join without a condition pairs rows of different units "
                         f"(row ownership, seed Table 4.3): use USING ({unit})")
    # Columns keep their names through a join, except the right side's, which get a suffix
    # unique to this join (the unit column is shared).
    suffix = f"#{len(tables)}"
    scope = _Scope(unit)
    for source in (left_scope, right_scope):
        def joined(internal: str) -> str:
            return internal if internal == unit or source is left_scope else internal + suffix
        for (alias, name), internal in source.qualified.items():
            scope.qualified[(alias, name)] = joined(internal)
        for name, internal in source.plain.items():
            if internal is None:
                scope.plain[name] = None
                continue
            scope.plain[name] = joined(internal) if scope.plain.get(name, joined(internal)) \
                == joined(internal) else None
            scope.types[joined(internal)] = source.types[internal]
    return Join(left, right, "left outer" if side == "LEFT" else "inner", clause, suffix), scope


def _is_unit_equality(node: exp.Expression, left: _Scope, right: _Scope) -> bool:
    if not isinstance(node, exp.EQ):
        return False
    a, b = node.this, node.expression
    if not (isinstance(a, exp.Column) and isinstance(b, exp.Column) and a.table and b.table):
        return False

    def side(column: exp.Column) -> Optional[str]:
        key = (column.table, column.name)
        if left.qualified.get(key) == left.unit:
            return "left"
        if right.qualified.get(key) == right.unit:
            return "right"
        return None

    return {side(a), side(b)} == {"left", "right"}


def _subquery(select: exp.Select, schemas: Mapping[str, TableSchema],
              tables: list[str]) -> tuple[Relation, _Scope]:
    """A subquery in FROM: a projection (keeping the unit), optionally grouped by the unit."""
    clause = f"subquery ({_clause(select)})"
    _refuse_unsupported(select, clause)
    if not select.args.get("from_"):
        raise QueryError(f"{clause}: no FROM clause")
    relation, inner_scope = _source(select, schemas, tables)
    unit = inner_scope.unit
    group = select.args.get("group")
    group_items = list(group.expressions) if group else []
    has_aggregate = any(isinstance(n, exp.AggFunc) for item in select.expressions
                        for n in item.walk())
    if group_items or has_aggregate:
        grouped_by_unit = any(isinstance(item, exp.Column)
                              and inner_scope.resolve(item, clause) == unit
                              for item in group_items)
        if not grouped_by_unit:
            shown = f"GROUP BY {', '.join(_clause(i) for i in group_items)}" if group_items \
                else "an aggregate without GROUP BY"
            raise QueryError(f"{clause}: {shown} is not grouped by the privacy unit {unit}: its "
                             "rows would mix units (row ownership, seed Table 4.3); add "
                             f"{unit} to GROUP BY")
    resolved_groups = [_check_row_wise(item, inner_scope, clause) for item in group_items]
    keys, aggregates, projected = [], [], []
    scope = _Scope(unit)
    keeps_unit = False
    for index, item in enumerate(select.expressions):
        inner = item.this if isinstance(item, exp.Alias) else item
        name = _check_name(item.alias_or_name or f"column_{index}", clause)
        if isinstance(inner, exp.Star):
            raise QueryError(f"{clause}: SELECT * is not supported; name the columns")
        if group_items or has_aggregate:
            if isinstance(inner, exp.AggFunc):
                aggregates.append((name, *_inner_aggregate(inner, inner_scope, clause)))
                kind = _expression_type(inner, inner_scope)
            else:
                resolved = _check_row_wise(inner, inner_scope, clause)
                if resolved not in resolved_groups:
                    raise QueryError(f"{clause}: {_clause(item)} is neither aggregated nor "
                                     "in GROUP BY")
                keys.append((name, resolved))
                kind = _expression_type(inner, inner_scope)
        else:
            projected.append((name, _check_row_wise(inner, inner_scope, clause)))
            kind = _expression_type(inner, inner_scope)
        if name in scope.plain:
            raise QueryError(f"{clause}: two of its output columns are named {name}; alias one "
                             "(the later would replace the earlier)")
        is_unit = isinstance(inner, exp.Column) and inner_scope.resolve(inner, clause) == unit
        if is_unit and name != unit:
            raise QueryError(f"{clause}: keep the unit column's name ({unit}), not {name}")
        if name == unit and not is_unit:
            # Anything else named like the unit would become the unit the operator bounds.
            raise QueryError(f"{clause}: {_clause(item)}: the output named {unit} must be the "
                             f"privacy unit column {unit} itself (row ownership, seed Table 4.3)")
        keeps_unit = keeps_unit or is_unit
        scope.add(None, name, name, kind)
    if not keeps_unit:
        raise QueryError(f"{clause}: its SELECT list drops the privacy unit {unit}; every "
                         "subquery must carry it (row ownership, seed Table 4.3)")
    if group_items or has_aggregate:
        return GroupByUnit(relation, tuple(keys), tuple(aggregates)), scope
    return Project(relation, tuple(projected)), scope


def _inner_aggregate(node: exp.AggFunc, scope: _Scope,
                     clause: str) -> tuple[str, Optional[exp.Expression]]:
    kind = INNER_AGGREGATES.get(type(node))
    if kind is None:
        raise QueryError(f"{clause}: aggregate {_clause(node)} is not supported in a subquery "
                         "(SUM, COUNT, AVG, MIN, MAX are)")
    argument = node.this
    if isinstance(argument, exp.Distinct):
        raise QueryError(f"{clause}: {_clause(node)}: DISTINCT is not supported here")
    if isinstance(argument, exp.Star):
        return kind, None
    return kind, _check_row_wise(argument, scope, clause)


# ---------------------------------------------------------------- into the operator's query
# Query options (OPTIONS(name = value, ...)), each with its documented default:
#   max_groups_contributed (alias kappa): C_u, partitions one unit may touch
#       (default spec.DEFAULT_MAX_PARTITIONS_CONTRIBUTED = 4, BigQuery's name);
#   max_rows_contributed_per_group: rows of one unit per partition read by COUNT(*), AVG, VAR,
#       STDDEV and quantiles (default spec.DEFAULT_MAX_CONTRIBUTIONS_PER_PARTITION);
#   selection: by default spec.default_selection (weighted_gaussian, or truncated_geometric
#       when max_groups_contributed = 1), or truncated_geometric, weighted_gaussian,
#       laplace_threshold (the seed's tau-thresholding), gaussian_threshold; public_groups = (k1, k2, ...) (one key column) or ((a, b), ...)
#       releases exactly those groups, with no selection and no budget for it;
#   group_selection_strategy (BigQuery's): LAPLACE_THRESHOLD (selection = laplace_threshold) or
#       PUBLIC_GROUPS (with public_groups = (...), which lists them: a join with a public
#       table, BigQuery's way to list them, is refused as every non-unit join is);
#   noise: laplace (default) or gaussian;
#   infer_bounds: true (default: omitted bounds are inferred with DP, §4.2.5) or false (an
#       aggregate without bounds is refused);
#   privacy_unit_column: optional; must name the unit column recorded at ingest;
#   epsilon, delta: optional (BigQuery's); they must equal the grant's (--epsilon/--delta),
#       which is what is charged (frontend.plan_query checks them).
OPTION_NAMES = ("max_groups_contributed", "kappa", "max_rows_contributed_per_group",
                "selection", "group_selection_strategy", "public_groups", "noise",
                "infer_bounds", "privacy_unit_column", "epsilon", "delta")
# BigQuery's group_selection_strategy values, as the selection rule each is.
GROUP_SELECTION_STRATEGIES = {"LAPLACE_THRESHOLD": SelectionRule.LAPLACE_THRESHOLD,
                              "PUBLIC_GROUPS": SelectionRule.PUBLIC}
RESERVED_PREFIX = "__"  # no user column may start with it (_check_name)
# A query without GROUP BY releases one row, the total: the operator groups by this constant
# key, listed as the one public group (no selection, no budget for it) and not released.
TOTAL_KEY, TOTAL_GROUP = RESERVED_PREFIX + "total", 1
ARGUMENT_PREFIX = RESERVED_PREFIX + "value"


def _option_int(options: Mapping[str, object], names: tuple[str, ...], default: int) -> int:
    given = [name for name in names if name in options]
    if len(given) > 1:
        raise QueryError(f"OPTIONS: {' and '.join(given)} name the same option; give one")
    if not given:
        return default
    value = options[given[0]]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise QueryError(f"OPTIONS {given[0]} must be a positive integer, got {value!r}")
    return value


def _option_enum(options: Mapping[str, object], name: str, enum, default):
    if name not in options:
        return default
    try:
        return enum(str(options[name]).lower())
    except ValueError:
        raise QueryError(f"OPTIONS {name} = {options[name]!r}: one of "
                         f"{[member.value for member in enum]}") from None


def _group_selection_strategy(options: dict) -> None:
    """BigQuery's OPTIONS group_selection_strategy, rewritten in ``options`` as the selection
    rule it names."""
    if "group_selection_strategy" not in options:
        return
    if "selection" in options:
        raise QueryError("OPTIONS: group_selection_strategy and selection name the same "
                         "option; give one")
    strategy = str(options.pop("group_selection_strategy")).upper()
    if strategy not in GROUP_SELECTION_STRATEGIES:
        raise QueryError(f"OPTIONS group_selection_strategy = {strategy}: one of "
                         f"{list(GROUP_SELECTION_STRATEGIES)}")
    if strategy == "PUBLIC_GROUPS" and "public_groups" not in options:
        raise QueryError("OPTIONS group_selection_strategy = PUBLIC_GROUPS: list the groups "
                         "with OPTIONS(public_groups = (...)); a join with a table of public "
                         "groups (BigQuery's RIGHT OUTER JOIN ... USING (key)) is not supported, "
                         "as a join here is on the unit column")
    options["selection"] = GROUP_SELECTION_STRATEGIES[strategy].value


def to_query(checked: CheckedQuery) -> tuple[AggregationQuery, tuple[str, ...]]:
    """The operator's AggregationQuery for a checked query, and the released table's column
    order. The operator reads the relation `relation.evaluate` builds: the unit column, one
    column per group key (named as released) and one per aggregate argument
    (`__value<i>`)."""
    options = dict(checked.parsed.options)
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise QueryError(f"OPTIONS: unknown option(s) {unknown} (known: {list(OPTION_NAMES)})")
    unit = options.get("privacy_unit_column")
    if unit is not None and unit != checked.unit_column:
        raise QueryError(f"OPTIONS privacy_unit_column = {unit}: the tables' unit column, "
                         f"recorded at ingest, is {checked.unit_column}")
    infer = options.get("infer_bounds", True)
    if not isinstance(infer, bool):
        raise QueryError(f"OPTIONS infer_bounds must be true or false, got {infer!r}")
    _group_selection_strategy(options)
    # None: the operator's default rule (spec.default_selection), resolved by AggregationQuery
    selection = _option_enum(options, "selection", SelectionRule, None)
    public = options.get("public_groups")
    if checked.keys and checked.keys[0][0] == TOTAL_KEY:
        given = [name for name in ("public_groups", "selection") if name in options]
        if given:
            raise QueryError(f"OPTIONS {given[0]}: a query without GROUP BY releases one row, "
                             "the total, with no group to select; drop the option or add "
                             "GROUP BY")
        selection, public = SelectionRule.PUBLIC, ((TOTAL_GROUP,),)
    elif public is not None:
        if "selection" in options and selection is not SelectionRule.PUBLIC:
            raise QueryError("OPTIONS: public_groups releases exactly the listed groups; it "
                             f"cannot go with selection = {selection.value}")
        selection = SelectionRule.PUBLIC
        listed = public if isinstance(public, tuple) else (public,)
        public = tuple(key if isinstance(key, tuple) else (key,) for key in listed)
    elif selection is SelectionRule.PUBLIC:
        raise QueryError("OPTIONS selection = public needs public_groups = (...)")
    aggregates, order = [], []
    keys = {name for name, _ in checked.keys}
    for index, call in enumerate(checked.aggregates):
        column = f"{ARGUMENT_PREFIX}{index}" if call.argument is not None else None
        bounds = {"low": call.lower, "high": call.upper}
        if call.kind == "count":
            made = [Aggregate.count(name=call.name)]
        elif call.kind == COUNT_COLUMN:
            made = [Aggregate.count(column, name=call.name)]
        elif call.kind == "count_distinct_units":
            made = [Aggregate.count_distinct(name=call.name)]
        elif call.kind == "ntile":
            made = [Aggregate(AggregateKind.QUANTILE, column, q=k / call.ntiles,
                              name=f"{call.name}_{k}", **bounds)
                    for k in range(1, call.ntiles)]
        elif call.kind == "percentile":
            made = [Aggregate(AggregateKind.QUANTILE, column, q=call.q, name=call.name,
                              **bounds)]
        elif call.kind == "sum" and call.rows_bounded:
            made = [Aggregate(AggregateKind.SUM, column, name=call.name,
                              scope=BoundsScope.ROW, **bounds)]
        else:
            kind, q = {"sum": (AggregateKind.SUM, None), "mean": (AggregateKind.AVG, None),
                       "variance": (AggregateKind.VAR, None),
                       "stddev": (AggregateKind.STDDEV, None),
                       "median": (AggregateKind.QUANTILE, 0.5),
                       "min": (AggregateKind.QUANTILE, 0.0),
                       "max": (AggregateKind.QUANTILE, 1.0)}[call.kind]
            made = [Aggregate(kind, column, q=q, name=call.name, **bounds)]
        aggregates.extend(made)
        order.append((call.name, [a.name for a in made]))
    released = []
    for name in checked.output_order:
        expanded = dict(order).get(name)
        released.extend(expanded if expanded is not None else [name])
    clash = sorted(keys & {a.name for a in aggregates})
    if clash:
        raise QueryError(f"SELECT: output column(s) {clash} name both a key and an aggregate")
    query = AggregationQuery(
        group_by=tuple(name for name, _ in checked.keys), unit_column=checked.unit_column,
        aggregates=tuple(aggregates),
        max_partitions_contributed=_option_int(
            options, ("max_groups_contributed", "kappa"), DEFAULT_MAX_PARTITIONS_CONTRIBUTED),
        max_contributions_per_partition=_option_int(
            options, ("max_rows_contributed_per_group",),
            DEFAULT_MAX_CONTRIBUTIONS_PER_PARTITION),
        selection=selection, public_partitions=public,
        noise=_option_enum(options, "noise", NoiseKind, NoiseKind.LAPLACE), infer_bounds=infer)
    query.check()
    return query, tuple(released)
