"""A grant on MySQL in one transaction of a few round trips (sage_access/mysql_commit.py): the
same rows in ML Metadata's tables as ML Metadata's own put_execution writes, and a number of
round trips to the server that does not grow with the blocks charged."""
import pytest
from dp_accounting import dp_event

from sage_tfx.sage_access import BlockIds, BlockLedger, RecentWindow
from sage_tfx.sage_access import ledger as ledger_module
from sage_tfx.sage_access.ledger import NewBlock
from sage_tfx.sage_access.mysql_commit import MySQLCommits
from sage_tfx.sage_access.store import parse

# Each table's rows without what differs between two equal histories: surrogate ids of link rows
# (MLMD's rejected duplicate inserts consume auto-increment values) and times.
TABLES = {
    "Artifact": "type_id, uri, state, name, external_id",
    "ArtifactProperty": "artifact_id, name, is_custom_property, int_value, double_value, "
                        "string_value, byte_value, proto_value, bool_value",
    "Execution": "id, type_id, last_known_state, name, external_id",
    "ExecutionProperty": "execution_id, name, is_custom_property, int_value, double_value, "
                         "string_value, byte_value, proto_value, bool_value",
    "Event": "artifact_id, execution_id, type",
    "EventPath": "event_id, is_index_step, step_index, step_key",
    "Attribution": "context_id, artifact_id",
    "Association": "context_id, execution_id",
    "Context": "id, type_id, name, external_id",
}


def rows(server, database: str) -> dict:
    return {table: sorted(server.execute(f"SELECT {columns} FROM {database}.`{table}`"),
                          key=repr)
            for table, columns in TABLES.items()}


def history(store: str) -> None:
    """Blocks, a waiting pipeline's reservation, and grants of every kind the ledger makes: named
    blocks and a window, with a split and its events, granted data, a pipeline run's context."""
    ledger = BlockLedger.create(store, min_request_epsilon=0.01)
    ledger.add_blocks([NewBlock(f"b{index}", 1.0, 1e-6) for index in range(3)])
    ledger.register_pipeline("taxi")
    ledger.add_block("b3", 1.0, 1e-6, data_uri="/data/b3")
    ledger.request(BlockIds(["b0", "b1"]), epsilon=0.25, delta=1e-8)
    ledger.request(RecentWindow(2), epsilon=0.125, delta=0.0, pipeline="taxi", run_id="run-1",
                   split={"count": "0.5", "sum": "0.5"},
                   events={"count": dp_event.LaplaceDpEvent(8.0)})
    ledger.request(BlockIds(["b3"]), epsilon=0.5, delta=0.0, pipeline="taxi",
                   data_uri="/granted/b3")
    ledger.request(BlockIds(["b2", "b3"]), epsilon=0.0625, delta=0.0, pipeline="taxi",
                   run_id="run-1")


def test_a_grant_writes_the_rows_ml_metadata_writes(mariadb_server, monkeypatch):
    """The same history, once with grants in mysql_commit's transaction and once with ML
    Metadata's put_execution: every row of every table ML Metadata reads is the same."""
    grant_ids = iter(f"{index:032x}" for index in range(100))
    monkeypatch.setattr(ledger_module.uuid, "uuid4", lambda: type("U", (), {"hex": next(
        grant_ids)}))
    batched = mariadb_server.store()
    history(batched)
    grant_ids = iter(f"{index:032x}" for index in range(100))
    monkeypatch.setattr(MySQLCommits, "available", lambda self: False)
    by_mlmd = mariadb_server.store()
    history(by_mlmd)
    written, expected = rows(mariadb_server, parse(batched).database), rows(
        mariadb_server, parse(by_mlmd).database)
    for table in TABLES:
        assert written[table] == expected[table], table
    assert BlockLedger(batched).audit().problems == []


def test_a_grant_on_mysql_costs_a_few_round_trips_whatever_its_blocks(mariadb_server):
    """ML Metadata's put_execution sent about 25 statements per block charged (753 for a grant
    of 30 blocks), each a round trip; in one transaction the round trips do not grow with the
    blocks (5 for any grant on named blocks: its reads, then every write and the COMMIT in one
    batch). The session's server runs nothing else meanwhile."""
    ledger = BlockLedger.create(mariadb_server.store(), min_request_epsilon=0.001)
    ledger.add_blocks([NewBlock(f"b{index:02d}", 1.0, 1e-6) for index in range(40)])
    counts = {}
    for width in (1, 30):
        ids = [f"b{index:02d}" for index in range(width)]
        ledger.request(BlockIds(ids), epsilon=0.01, delta=0.0)  # connections opened
        with mariadb_server.round_trips() as counted:
            ledger.request(BlockIds(ids), epsilon=0.01, delta=0.0)
        counts[width] = counted[0]
    assert counts[30] == counts[1] <= 6, counts
