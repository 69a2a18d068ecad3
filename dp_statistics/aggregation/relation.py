"""The relation below the DP operator (FROM, JOIN ... USING (unit), subqueries grouped by the unit,
WHERE), evaluated with Arrow's compute engine on the granted blocks' rows.

Every step is one of the seed's Table 4.3 forms (sql.py checked it), so each output row is
derived from the rows of one unit: adding or removing a unit's rows adds or removes only rows
owned by that unit, and the operator's bounding covers them. The expressions are row-wise and
cannot fail on a value: arithmetic and casts to float are unchecked (an overflow wraps, an
integer beyond 2^53 rounds), division is in floating point (x / 0 is +-inf or NaN, never an
error), and a comparison of mismatched types fails on the schema alone.
`check_on_schema` runs the whole relation on empty tables of the ingested schemas before
anything is charged, so such an error refuses the query instead of stopping a charged run.

The aggregates' arguments are then read as numbers with SQL's NULL semantics: a NULL (or NaN)
value stays NULL, held as NaN, and every aggregate skips it (spec.py, aggregators.py); it is
never replaced by a default, which would pull a mean toward it. An argument must be numeric
(sql.py types it and `check_on_schema` checks Arrow's type before the charge); the conversion
to float is total all the same (text that does not parse is NULL), so no value can fail a
charged run.
"""
from __future__ import annotations

from typing import Callable, Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from sqlglot import exp

from sage_tfx.dp_statistics.aggregation.spec import QueryError
from sage_tfx.dp_statistics.aggregation.sql import (ARGUMENT_PREFIX, COUNT_COLUMN,
                                                    RESERVED_PREFIX, CheckedQuery, Filter,
                                                    GroupByUnit, Join, Project, Relation, Scan)

_COMPARISONS = {exp.EQ: pc.equal, exp.NEQ: pc.not_equal, exp.GT: pc.greater,
                exp.GTE: pc.greater_equal, exp.LT: pc.less, exp.LTE: pc.less_equal}
_ARITHMETIC = {exp.Add: pc.add, exp.Sub: pc.subtract, exp.Mul: pc.multiply}


def _literal(node: exp.Expression):
    if isinstance(node, exp.Paren):
        return _literal(node.this)
    if isinstance(node, exp.Neg):
        return -_literal(node.this)
    if isinstance(node, exp.Literal):
        if node.is_string:
            return node.this
        return int(node.this) if node.this.lstrip("+-").isdigit() else float(node.this)
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Null):
        return None
    raise QueryError(f"{node.sql()} must be a literal here")


def to_arrow(node: exp.Expression) -> pc.Expression:
    """A checked row-wise sqlglot expression (columns already carry internal names) as an
    Arrow compute expression."""
    kind = type(node)
    if kind is exp.Column:
        return pc.field(node.name)
    if kind in (exp.Literal, exp.Boolean, exp.Null):
        return pc.scalar(_literal(node))
    if kind is exp.Paren:
        return to_arrow(node.this)
    if kind is exp.Neg:
        return pc.negate(to_arrow(node.this))
    if kind is exp.Not:
        return pc.invert(to_arrow(node.this))
    if kind is exp.And:
        return pc.and_kleene(to_arrow(node.this), to_arrow(node.expression))
    if kind is exp.Or:
        return pc.or_kleene(to_arrow(node.this), to_arrow(node.expression))
    if kind in _COMPARISONS:
        return _COMPARISONS[kind](to_arrow(node.this), to_arrow(node.expression))
    if kind in _ARITHMETIC:
        return _ARITHMETIC[kind](to_arrow(node.this), to_arrow(node.expression))
    if kind is exp.Div:
        return pc.divide(to_arrow(node.this).cast(pa.float64(), safe=False),
                         to_arrow(node.expression).cast(pa.float64(), safe=False))
    if kind is exp.Is:
        if not isinstance(node.expression, exp.Null):
            raise QueryError(f"{node.sql()}: only IS NULL / IS NOT NULL are supported")
        return pc.is_null(to_arrow(node.this))
    if kind is exp.In:
        if node.args.get("query") or not node.expressions:
            raise QueryError(f"{node.sql()}: IN takes a list of literals")
        return to_arrow(node.this).isin([_literal(value) for value in node.expressions])
    if kind is exp.Between:
        value = to_arrow(node.this)
        return pc.and_kleene(pc.greater_equal(value, to_arrow(node.args["low"])),
                             pc.less_equal(value, to_arrow(node.args["high"])))
    if kind is exp.Like:
        pattern = _literal(node.expression)
        if not isinstance(pattern, str):
            raise QueryError(f"{node.sql()}: LIKE takes a string literal pattern")
        return pc.match_like(to_arrow(node.this), pattern)
    if kind is exp.Abs:
        return pc.abs(to_arrow(node.this))
    if kind is exp.Coalesce:
        return pc.coalesce(to_arrow(node.this), *[to_arrow(e) for e in node.expressions])
    raise QueryError(f"{node.sql()} ({kind.__name__}) is not supported in a DP query")


def _project(table: pa.Table, columns: Mapping[str, pc.Expression]) -> pa.Table:
    return ds.dataset(table).to_table(columns=dict(columns))


def _rows(relation: Relation, read: Callable[[str], pa.Table], unit: str) -> pa.Table:
    if isinstance(relation, Scan):
        return read(relation.table)
    if isinstance(relation, Filter):
        return ds.dataset(_rows(relation.child, read, unit)).to_table(
            filter=to_arrow(relation.predicate))
    if isinstance(relation, Join):
        left = _rows(relation.left, read, unit)
        right = _rows(relation.right, read, unit)
        right = right.rename_columns([name if name == unit else name + relation.right_suffix
                                      for name in right.column_names])
        return left.join(right, keys=unit, join_type=relation.kind)
    if isinstance(relation, Project):
        rows = _rows(relation.child, read, unit)
        return _project(rows, {name: to_arrow(e) for name, e in relation.items})
    if isinstance(relation, GroupByUnit):
        rows = _rows(relation.child, read, unit)
        columns = {name: to_arrow(e) for name, e in relation.keys}
        for index, (_, _, argument) in enumerate(relation.aggregates):
            if argument is not None:
                columns[f"{RESERVED_PREFIX}argument{index}"] = to_arrow(argument)
        projected = _project(rows, columns)
        keys = [name for name, _ in relation.keys]
        specs, names = [], list(keys)
        for index, (name, kind, argument) in enumerate(relation.aggregates):
            if argument is None:  # COUNT(*)
                specs.append(([], "count_all"))
            else:
                specs.append((f"{RESERVED_PREFIX}argument{index}", kind))
            names.append(name)
        grouped = projected.group_by(keys, use_threads=False).aggregate(specs)
        # pyarrow names results "<column>_<function>" after the keys; rename in order.
        outputs = grouped.select([*[f"{spec[0]}_{spec[1]}" if spec[0] else spec[1]
                                    for spec in specs], *keys])
        return outputs.rename_columns(names[len(keys):] + keys)
    raise TypeError(f"unknown relation {relation!r}")


def _arguments_raw(checked: CheckedQuery, read: Callable[[str], pa.Table]) -> pa.Table:
    """The unit column, the group keys and each aggregate argument (`__value<i>`) as its
    expression computes it, before the conversion to numbers."""
    rows = _rows(checked.source, read, checked.unit_column)
    columns = {checked.unit_column: pc.field(checked.unit_column)}
    columns.update({name: to_arrow(expression) for name, expression in checked.keys})
    for index, call in enumerate(checked.aggregates):
        if call.argument is not None:
            columns[f"{ARGUMENT_PREFIX}{index}"] = to_arrow(call.argument)
    return _project(rows, columns)


def _is_numeric(arrow_type: pa.DataType) -> bool:
    return (pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)
            or pa.types.is_boolean(arrow_type) or pa.types.is_decimal(arrow_type)
            or pa.types.is_null(arrow_type))


def _parsed_or_null(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _numbers(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """float64 values for ANY input type, NULL (and NaN) as NaN: numbers are cast (unchecked);
    anything else (check_on_schema refuses it, but a charged run must not fail on a value) is
    parsed value by value, unparseable -> NULL."""
    if _is_numeric(column.type):
        values = column.cast(pa.float64(), safe=False)
    else:
        values = pa.chunked_array([pa.array([_parsed_or_null(v) for v in column.to_pylist()],
                                            pa.float64())])
    return pc.fill_null(values, float("nan"))


def evaluate(checked: CheckedQuery, read: Callable[[str], pa.Table]) -> pa.Table:
    """The operator's input for `checked`: the unit column, one column per group key (named as
    released) and one per aggregate argument (`__value<i>`, as numbers, NULL as NaN). `read(table)`
    returns the rows of a table's granted blocks."""
    projected = _arguments_raw(checked, read)
    counted = _counted_arguments(checked)
    return pa.table({name: (_presence(column) if name in counted
                            else _numbers(column) if name.startswith(ARGUMENT_PREFIX)
                            else column)
                     for name, column in zip(projected.column_names, projected.columns)})


def _counted_arguments(checked: CheckedQuery) -> set[str]:
    """The arguments of ANON_COUNT(expr): of any type, only whether each row's is null."""
    return {f"{ARGUMENT_PREFIX}{index}" for index, call in enumerate(checked.aggregates)
            if call.kind == COUNT_COLUMN}


def _presence(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """1.0 where the value is set, NULL where it is null (the engines count the former)."""
    return pc.if_else(pc.is_valid(column), 1.0, pa.scalar(None, pa.float64()))


def check_on_schema(checked: CheckedQuery, schemas: Mapping[str, pa.Schema]) -> None:
    """Run the relation on empty tables of the ingested schemas: an expression whose types do
    not fit fails here, and an aggregate whose argument is not numeric is refused, on public
    information, before any charge."""
    try:
        projected = _arguments_raw(checked, lambda table: schemas[table].empty_table())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
        raise QueryError(f"the query does not fit the tables' column types: "
                         f"{str(error).splitlines()[0]}") from None
    counted = _counted_arguments(checked)
    for index, call in enumerate(checked.aggregates):
        name = f"{ARGUMENT_PREFIX}{index}"
        if name in projected.column_names and name not in counted and not _is_numeric(projected.schema.field(name).type):
            raise QueryError(f"{call.clause}: its argument is {projected.schema.field(name).type}"
                             "; the aggregate needs numbers (declare the column numeric at "
                             "ingest)")
