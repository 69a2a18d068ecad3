"""The DP SQL tests' tables (schemas only) and helpers: compile a query, or get its refusal."""
import pytest

from sage_tfx.dp_statistics.aggregation import QueryError, sql

SCHEMAS = {
    "trips": sql.TableSchema("uid", {"uid": "string", "area": "int", "fare": "float",
                                     "company": "string"}),
    "riders": sql.TableSchema("uid", {"uid": "string", "age": "int", "area": "int"}),
    "fleet": sql.TableSchema("car", {"car": "string", "area": "int"}),
}


def compile_sql(text):
    return sql.to_query(sql.check(sql.parse(text), SCHEMAS))


def refusal(text):
    with pytest.raises(QueryError) as error:
        compile_sql(text)
    return str(error.value)
