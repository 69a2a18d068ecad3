"""`dp_aggregate(data, sql, grant, ledger)`: the operator on a frame, paid by one ledger grant
charged through the release protocol."""
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from sage_tfx import release
from sage_tfx.dp_statistics.aggregation import QueryError, frontend, sql
from sage_tfx.sage_access import BlockLedger
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.ledger import BlockIds

SQL = ("SELECT WITH ANONYMIZATION OPTIONS(privacy_unit_column = uid, public_groups = (1, 2)) "
       "area, ANON_COUNT(*) AS trips, ANON_SUM(fare, 0, 20) AS fares FROM t GROUP BY area")


def frame():
    rng = np.random.default_rng(3)
    return pd.DataFrame({"uid": rng.integers(0, 50, 400).astype(str),
                         "area": rng.integers(1, 3, 400), "fare": rng.uniform(0, 30, 400)})


SCHEMA = sql.TableSchema("uid", {"uid": "string", "area": "int", "fare": "float"})
ARROW_SCHEMA = pa.Table.from_pandas(frame(), preserve_index=False).schema


def planned(text, epsilon=1.0):
    return frontend.plan_query(sql.parse(text), {"t": SCHEMA}, {"t": ARROW_SCHEMA}, epsilon, 1e-6)


def granted(store_path, text=SQL, epsilon=1.0):
    ledger = BlockLedger.create(store_path)
    ledger.add_block("b1", 5.0, 1e-5)
    plan = planned(text, epsilon).release_plan("test", text)
    return ledger, release.charge(ledger, plan, BlockIds(["b1"])).grant


def test_a_grant_pays_for_one_release_of_its_query(store_path):
    ledger, grant = granted(store_path)
    result = frontend.dp_aggregate(frame(), SQL, grant, ledger)
    assert list(result.table.columns) == ["area", "trips", "fares"]
    assert sorted(result.table["area"]) == [1, 2]
    [record] = ledger.grant_records()
    assert (record["outcome"], record["front_door"], record["request"]) == ("released", "test", SQL)
    with pytest.raises(BadRequest, match="have an outcome already .released by dp_aggregate"):
        frontend.dp_aggregate(frame(), SQL, grant, ledger)


def test_a_grant_for_another_query_is_refused_before_anything_is_consumed(store_path):
    other = SQL.replace("ANON_SUM(fare, 0, 20) AS fares", "ANON_AVG(fare, 0, 20) AS fares")
    ledger, grant = granted(store_path, text=other)
    with pytest.raises(sql.QueryError, match="was not made for this query"):
        frontend.dp_aggregate(frame(), SQL, grant, ledger)
    # Nothing was consumed or recorded by the refusal: the right query still runs on it.
    assert ledger.grant_records()[0]["outcome"] == "incomplete"
    assert len(frontend.dp_aggregate(frame(), other, grant, ledger).table) == 2
    assert ledger.grant_records()[0]["outcome"] == "released"


# Gaussian thresholding's event has an RDP curve; the discrete Laplace of the other rules has
# none in dp-accounting, so an rdp ledger refuses that one for want of a curve.
SELECTED = SQL.replace("public_groups = (1, 2)", "selection = gaussian_threshold")


def test_an_rdp_ledger_refuses_a_query_whose_selection_spends_delta_outside_its_event(
        store_path):
    """The filter charges only the events' RDP curve: the selection's additional delta would
    go uncharged, so the API's grant is refused before anything is charged; a grant made by
    hand without saying it releases nothing."""
    ledger = BlockLedger.create(store_path, accounting="rdp")
    ledger.add_block("b1", 5.0, 1e-5)
    terms = frontend.grant_terms(planned(SELECTED).budget)
    assert terms.additional_delta > 0
    with pytest.raises(BadRequest, match="rdp ledger cannot charge delta spent outside"):
        release.charge(ledger, planned(SELECTED).release_plan("test", SELECTED),
                       BlockIds(["b1"]))
    assert not np.any(ledger.blocks()[0].spent)
    grant = ledger.request(BlockIds(["b1"]), 1.0, 1e-6, split=terms.split, events=terms.events)
    # The run asks the ledger's accountant, so the user reads the accountant's one rule.
    with pytest.raises(QueryError, match="rdp ledger cannot charge delta spent outside .*"
                                         "nothing was released"):
        frontend.dp_aggregate(frame(), SELECTED, grant, ledger)
    assert ledger.use_share(grant, next(iter(terms.split)), "another consumer")  # unconsumed


def test_a_frames_column_kinds_are_the_tables_kinds():
    """One home for the kinds (sql.ARROW_TYPES), read back from a frame by sql.column_kind."""
    assert {kind: sql.column_kind(arrow) for kind, arrow in sql.ARROW_TYPES.items()} == {
        kind: kind for kind in sql.ARROW_TYPES}
    assert [sql.column_kind(t) for t in (pa.int32(), pa.float32(), pa.bool_())] == [
        "int", "float", "string"]


def test_the_stated_accuracy_is_computed_only_when_asked(store_path, monkeypatch):
    """Without `intervals` no stddev or interval is computed (a quantile's costs two more
    descents of its tree); with it every aggregate states one. The released values are the
    same either way (test_fixed_seed_release.py, bit for bit)."""
    from sage_tfx.dp_statistics.aggregation import accuracy

    text = SQL.replace("AS fares", "AS fares, ANON_AVG(fare, 0, 20) AS mean, "
                       "ANON_STDDEV(fare, 0, 20) AS sd, ANON_MEDIAN(fare, 0, 20) AS median")
    stated = []
    for name in ("additive", "mean", "variance", "quantile"):
        monkeypatch.setattr(accuracy, name, lambda *args, real=getattr(accuracy, name),
                            name=name, **options: (stated.append(name),
                                                   real(*args, **options))[1])
    ledger, grant = granted(store_path, text=text)
    plain = frontend.dp_aggregate(frame(), text, grant, ledger)
    assert stated == []
    assert list(plain.table.columns) == ["area", "trips", "fares", "mean", "sd", "median"]

    ledger.add_block("b2", 5.0, 1e-5)
    plan = planned(text).release_plan("test", text)
    grant = release.charge(ledger, plan, BlockIds(["b2"])).grant
    with_intervals = frontend.dp_aggregate(frame(), text, grant, ledger, intervals=True)
    assert sorted(set(stated)) == ["additive", "mean", "quantile", "variance"]
    assert [c for c in with_intervals.table.columns if c.endswith("_stddev")] == [
        "trips_stddev", "fares_stddev", "mean_stddev", "sd_stddev", "median_stddev"]
