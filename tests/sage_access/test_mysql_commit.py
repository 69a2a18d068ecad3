"""A grant on MySQL in one transaction of a few round trips (sage_access/mysql_commit.py): the
same rows in ML Metadata's tables as ML Metadata's own put_execution writes, read back as ML
Metadata reads them, and round trips and statements on the server that do not grow with the
blocks charged."""
import threading
import time

import pytest
from dp_accounting import dp_event
from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2 as pb

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
    ledger.request(BlockIds(["b0", "b1"]), epsilon=0.25, delta=1e-8,
                   request_text="SELECT COUNT(*) FROM trips WHERE city = 'Zürich' -- ☃ 😀 €")
    ledger.request(RecentWindow(2), epsilon=0.125, delta=0.0, pipeline="taxi", run_id="run-1",
                   split={"count": "0.5", "sum": "0.5"},
                   events={"count": dp_event.LaplaceDpEvent(8.0)})
    ledger.request(BlockIds(["b3"]), epsilon=0.5, delta=0.0, pipeline="taxi",
                   data_uri="/granted/b3")
    ledger.request(BlockIds(["b2", "b3"]), epsilon=0.0625, delta=0.0, pipeline="taxi",
                   run_id="run-1")


def test_a_grant_writes_the_rows_ml_metadata_writes(mariadb_server, monkeypatch):
    """The same history, once with grants in mysql_commit's transaction and once with ML
    Metadata's put_execution: every row of every table ML Metadata reads is the same, text
    beyond ASCII included (a request's text), and ML Metadata reads that text back."""
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
    assert BlockLedger(batched).grant_records()[0]["request"] == (
        "SELECT COUNT(*) FROM trips WHERE city = 'Zürich' -- ☃ 😀 €")


def test_a_grant_on_mysql_costs_a_few_round_trips_whatever_its_blocks(mariadb_server):
    """ML Metadata's put_execution sent about 25 statements per block charged (753 for a grant
    of 30 blocks), each a round trip; in one transaction the round trips do not grow with the
    blocks: 2 for any grant on named blocks (its blocks locked and read, with the records of
    their versions, the changes that made them and those changes' balances; then every write
    and the COMMIT in one batch). The session's server runs nothing else meanwhile. The block
    ids hold SQL's table-alias text (`A.`), which the reads' SQL must not rewrite."""
    ledger = BlockLedger.create(mariadb_server.store(), min_request_epsilon=0.001)
    ledger.add_blocks([NewBlock(f"A.b{index:02d}", 1.0, 1e-6) for index in range(40)])
    counts = {}
    for width in (1, 30):
        ids = [f"A.b{index:02d}" for index in range(width)]
        ledger.request(BlockIds(ids), epsilon=0.01, delta=0.0)  # connections opened
        with mariadb_server.round_trips() as counted:
            ledger.request(BlockIds(ids), epsilon=0.01, delta=0.0)
        counts[width] = counted[0]
    assert counts[30] == counts[1] == 2, counts


def test_the_server_runs_as_many_statements_for_30_blocks_as_for_1(mariadb_server):
    """Each statement costs the server its own parse, plan and table opening (about 0.1 ms):
    a grant's batch once set one session variable per version record it created (31
    statements more for 30 blocks than for 1). Counted by the server (`Questions`: statements
    run, those of a batch one by one); its session runs nothing else meanwhile."""
    ledger = BlockLedger.create(mariadb_server.store(), min_request_epsilon=0.001)
    ledger.add_blocks([NewBlock(f"b{index:02d}", 1.0, 1e-6) for index in range(30)])

    def statements_run() -> int:
        [(_, count)] = mariadb_server.execute("SHOW GLOBAL STATUS LIKE 'Questions'")
        return int(count)

    counts = {}
    for width in (1, 30):
        ids = [f"b{index:02d}" for index in range(width)]
        ledger.request(BlockIds(ids), epsilon=0.01, delta=0.0)  # connections opened
        before = statements_run()
        ledger.request(BlockIds(ids), epsilon=0.01, delta=0.0)
        counts[width] = statements_run() - before
    assert counts[30] == counts[1], counts


def test_a_transaction_reads_artifacts_and_executions_as_ml_metadata_does(mariadb_server):
    """mysql_commit reads an artifact's properties as one JSON array (and an execution's as
    rows): every kind of value it reads comes back as ML Metadata's own reads give it, the
    doubles to the bit and the strings whole (quotes, backslashes, control characters, JSON of
    their own, and text beyond ASCII, which ML Metadata's client stores as its UTF-8 bytes
    taken for latin1 characters)."""
    store = mariadb_server.store()
    BlockLedger.create(store)  # the database and MLMD's schema
    spec = parse(store)
    mlmd = metadata_store.MetadataStore(spec.config())
    artifact_type = mlmd.put_artifact_type(pb.ArtifactType(
        name="Kinds", properties={"size": pb.INT, "label": pb.STRING, "ratio": pb.DOUBLE}))
    execution_type = mlmd.put_execution_type(pb.ExecutionType(name="KindsRun"))
    strings = ["", "it's \"quoted\"", "back\\slash\\", "line\nbreak\ttab\r\x01\x1f",
               "caf\u00e9 \u2603 \U0001F600", '{"json": [1, "two"]}', "%s %(x)s", "x" * 5000]
    doubles = [0.1, 0.1 + 0.2, 1 / 3, -2.5, 1e300, 5e-324, 2.2250738585072014e-308,
               1.7976931348623157e308, 2.0 ** 53 + 2, 123456789.123456789, 1e15, 1e16]
    ints = [0, 1, -1, 2**31 - 1, -2**31]
    nodes = []
    for index in range(3):
        artifact = pb.Artifact(type_id=artifact_type, uri=f"/data/{index}" if index else "",
                               name=f"kinds-{index}", external_id=f"kinds:{index}")
        if index:
            artifact.state = pb.Artifact.LIVE
        artifact.properties["size"].int_value = index
        artifact.properties["label"].string_value = strings[index]
        artifact.properties["ratio"].double_value = doubles[index]
        for position, value in enumerate(strings):
            artifact.custom_properties[f"s{position}"].string_value = value
        for position, value in enumerate(doubles):
            artifact.custom_properties[f"d{position}"].double_value = value
        for position, value in enumerate(ints):
            artifact.custom_properties[f"i{position}"].int_value = value
        nodes.append(artifact)
    nodes.append(pb.Artifact(type_id=artifact_type, name="bare", external_id="kinds:bare"))
    artifact_ids = mlmd.put_artifacts(nodes)
    execution = pb.Execution(type_id=execution_type, name="run",
                             last_known_state=pb.Execution.COMPLETE)
    execution.custom_properties["request"].string_value = strings[1] + strings[3]
    execution.custom_properties["ratio"].double_value = doubles[5]
    [execution_id] = mlmd.put_executions([execution])
    expected_artifacts = mlmd.get_artifacts_by_id(artifact_ids)
    expected_executions = mlmd.get_executions_by_id([execution_id])
    for node in (*expected_artifacts, *expected_executions):
        node.ClearField("type")  # the type's name, which ML Metadata joins in; the ledger has ids
    external_ids = sorted(artifact.external_id for artifact in expected_artifacts)
    with MySQLCommits(spec).transaction() as transaction:
        by_id = transaction.get_artifacts_by_id(artifact_ids)
        by_external_id = transaction.get_artifacts_by_external_ids(external_ids)
        locked = transaction.get_artifacts_by_external_ids(external_ids, lock=True)
        executions = transaction.get_executions_by_id([execution_id])
    assert by_id == sorted(expected_artifacts, key=lambda artifact: artifact.id)
    assert by_external_id == locked == sorted(expected_artifacts,
                                              key=lambda artifact: artifact.external_id)
    assert executions == expected_executions


def test_a_grant_that_waits_for_a_lock_does_not_redo_its_work(mariadb_server, monkeypatch):
    """Two grants on the same blocks: the second waits for the first's locks, then reads what
    the first committed and is granted, without re-running (a read that waited for a lock
    once saw the properties as they were before the lock's holder committed, so the balance
    check found a later version and the grant ran again)."""
    store = mariadb_server.store()
    ledger = BlockLedger.create(store, min_request_epsilon=0.001)
    ledger.add_blocks([NewBlock(f"b{index}", 1.0, 1e-6) for index in range(3)])
    first, second = BlockLedger(store), BlockLedger(store)
    holding, release = threading.Event(), threading.Event()
    commit = first._transactions.commit

    def commit_when_released(*args, **kwargs):
        holding.set()  # the first grant's blocks are locked
        assert release.wait(60)
        return commit(*args, **kwargs)

    monkeypatch.setattr(first._transactions, "commit", commit_when_released)
    ids = BlockIds(["b0", "b1", "b2"])
    granted = []
    threads = [threading.Thread(target=lambda: granted.append(first.request(
        ids, epsilon=0.25, delta=0.0)))]
    threads[0].start()
    assert holding.wait(60)
    threads.append(threading.Thread(target=lambda: granted.append(second.request(
        ids, epsilon=0.125, delta=0.0))))
    threads[1].start()
    deadline = time.monotonic() + 60
    while not mariadb_server.execute(  # the second grant waits for a lock the first holds
            "SELECT COUNT(*) FROM information_schema.INNODB_LOCK_WAITS")[0][0]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    release.set()
    for thread in threads:
        thread.join(60)
    assert len(granted) == 2
    assert (first.retries, second.retries) == (0, 0)
    assert [float(block.spent[0]) for block in ledger.blocks()] == [0.375] * 3
    assert ledger.audit().problems == []


def test_a_transaction_rolled_back_as_the_server_dies_raises_what_rolled_it_back(
        mariadb_server, monkeypatch):
    """The server dies while a transaction rolls back (a grant that lost to another writer
    raised Conflict, as the crash test's kill -9 of MariaDB once hit): the server rolls the
    transaction back in any case, so what made it roll back comes out (a Conflict is retried,
    where the lost connection ended the client's process), and the next transaction
    reconnects."""
    import pymysql

    store = mariadb_server.store()
    BlockLedger.create(store)
    commits = MySQLCommits(parse(store))
    real_rollback = pymysql.connections.Connection.rollback

    def lost(connection):
        connection.close()
        raise pymysql.err.OperationalError(2013, "Lost connection to MySQL server during query")

    monkeypatch.setattr(pymysql.connections.Connection, "rollback", lost)
    with pytest.raises(LookupError, match="what rolled it back"):
        with commits.transaction() as transaction:
            transaction.get_artifacts_by_external_ids(["state:default"], lock=True)
            raise LookupError("what rolled it back")
    monkeypatch.setattr(pymysql.connections.Connection, "rollback", real_rollback)
    with commits.transaction() as transaction:
        assert transaction.get_artifacts_by_external_ids(["state:default"], lock=True)
