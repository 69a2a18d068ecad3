"""`--store mysql://...`: parsing, the password kept out of argv, records and errors, and what
`init` and the read-only commands do to a MySQL database."""
import subprocess
import sys

import pytest
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access import BlockLedger, StoreRefused
from sage_tfx.sage_access.store import (MYSQL_PASSWORD_VARIABLE, MySQLStore, StoreUnreachable,
                                        connect_read_only, describe, parse)

SECRET = "pw-9f2c-never-shown"


def ledger_cli(store: str, *args: str, env=None):
    done = subprocess.run([sys.executable, "-m", "sage_tfx.cli", "ledger", "--store", store,
                           *args], capture_output=True, text=True, env=env)
    return done.returncode, done.stdout, done.stderr


def test_tcp_and_socket_specs_parse_and_describe_back():
    tcp = parse("mysql://sage@db.internal:3307/ledger")
    assert tcp == MySQLStore(user="sage", host="db.internal", port=3307, database="ledger")
    assert parse("mysql://sage@db.internal/ledger").port == 3306
    socket = parse("mysql://sage@localhost/ledger?socket=/run/mysqld/mysqld.sock"
                   "&password_file=/etc/sage/pw")
    assert (socket.socket, socket.password_file) == ("/run/mysqld/mysqld.sock", "/etc/sage/pw")
    for store in (tcp, socket):
        assert parse(describe(store)) == store


@pytest.mark.parametrize("spec", [
    "mysql://db:3306/ledger",                    # no user
    "mysql://sage@:3306/ledger",                 # no host
    "mysql://sage@db:99999/ledger",              # port out of range
    "mysql://sage@db:3306/",                     # no database
    "mysql://sage@db:3306/led;ger",              # not a database name
    "mysql://sage@db/ledger?sslmode=off",        # an option we do not read
    "mysql://sage@db/ledger?socket=",            # an empty option
    "mysql://sage@db/ledger?socket=/run/m.sock", # a socket of another host
])
def test_malformed_mysql_specs_are_refused_naming_the_form(spec):
    with pytest.raises(StoreRefused, match="mysql://USER@HOST"):
        parse(spec)


def test_a_password_in_the_spec_is_refused_without_repeating_it(tmp_path):
    spec = f"mysql://sage:{SECRET}@db:3306/ledger"
    with pytest.raises(StoreRefused) as refused:
        parse(spec)
    assert SECRET not in str(refused.value) and "password_file" in str(refused.value)
    code, out, err = ledger_cli(spec, "show")
    assert code == 2 and SECRET not in out + err
    with pytest.raises(StoreRefused) as other_scheme:
        parse(f"mariadb://sage:{SECRET}@db/ledger")
    assert SECRET not in str(other_scheme.value)


def test_the_password_comes_from_the_file_or_else_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(MYSQL_PASSWORD_VARIABLE, "from-environment")
    assert parse("mysql://sage@db/ledger").config().mysql.password == "from-environment"
    password_file = tmp_path / "password"
    password_file.write_text("from-file\n")
    store = parse(f"mysql://sage@db/ledger?password_file={password_file}")
    assert store.config().mysql.password == "from-file"
    assert "from-file" not in describe(store) + repr(store)
    missing = parse(f"mysql://sage@db/ledger?password_file={tmp_path / 'absent'}")
    with pytest.raises(StoreRefused, match="password file"):
        missing.config()


def test_an_unreachable_server_is_refused_without_the_password(monkeypatch):
    monkeypatch.setenv(MYSQL_PASSWORD_VARIABLE, SECRET)
    spec = "mysql://sage@127.0.0.1:1/ledger"  # nothing listens on port 1
    with pytest.raises(StoreUnreachable) as refused:
        BlockLedger(spec)
    assert SECRET not in str(refused.value) and "127.0.0.1:1" in str(refused.value)
    code, out, err = ledger_cli(spec, "show")
    assert code == 5 and "cannot connect" in err and SECRET not in out + err


def test_a_wrong_password_is_refused_without_repeating_it(mariadb_server, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text(SECRET)
    spec = f"mysql://sage@127.0.0.1:{mariadb_server.port}/ledger?password_file={wrong}"
    for args in (("init",), ("show",)):
        code, out, err = ledger_cli(spec, *args)
        assert code == 5 and "Access denied" in err and SECRET not in out + err, args


def test_init_creates_the_schema_in_utf8mb4_and_read_only_commands_create_nothing(
        mariadb_server, mariadb_store):
    database = parse(mariadb_store).database
    code, _, err = ledger_cli(mariadb_store, "show")
    assert code == 2 and "init" in err
    assert not mariadb_server.execute(f"SHOW DATABASES LIKE '{database}'")
    mariadb_server.execute(f"CREATE DATABASE {database}")  # empty: still not a ledger
    for command in ("show", "contexts", "grants", "audit"):
        code, _, err = ledger_cli(mariadb_store, command)
        assert code == 2 and "init" in err, command
    assert not mariadb_server.execute(f"SHOW TABLES FROM {database}")
    assert ledger_cli(mariadb_store, "init")[0] == 0
    charsets = mariadb_server.execute(
        "SELECT DISTINCT CCSA.character_set_name FROM information_schema.tables T JOIN "
        "information_schema.collation_character_set_applicability CCSA ON "
        f"CCSA.collation_name = T.table_collation WHERE T.table_schema = '{database}'")
    assert charsets == [("utf8mb4",)]
    assert ledger_cli(mariadb_store, "add-block", "b1", "--epsilon", "1", "--delta", "1e-6")[0] == 0
    code, out, _ = ledger_cli(mariadb_store, "show")
    assert code == 0 and "b1" in out


def test_the_read_only_client_refuses_writes(mariadb_store):
    BlockLedger.create(mariadb_store).add_block("b1", 1.0, 1e-6)
    reader = BlockLedger(mariadb_store, read_only=True)
    assert [block.block_id for block in reader.blocks()] == ["b1"]
    with pytest.raises(StoreRefused, match="read-only"):
        reader.register_pipeline("intruder")
    assert BlockLedger(mariadb_store).waiting_pipelines() == []


def test_a_database_of_another_application_is_refused_and_left_unchanged(mariadb_server,
                                                                         mariadb_store):
    database = parse(mariadb_store).database
    mariadb_server.execute(f"CREATE DATABASE {database}",
                           f"CREATE TABLE {database}.orders (id INT PRIMARY KEY)")
    for args in (("init",), ("show",)):
        code, _, err = ledger_cli(mariadb_store, *args)
        assert code == 2 and "not an ML Metadata store" in err, args
    with pytest.raises(StoreRefused):
        connect_read_only(mariadb_store)
    assert mariadb_server.execute(f"SHOW TABLES FROM {database}") == [("orders",)]


def test_the_socket_form_reaches_the_same_ledger(mariadb_server, mariadb_store):
    BlockLedger.create(mariadb_store).add_block("b1", 1.0, 1e-6)
    over_socket = mariadb_server.socket_store(parse(mariadb_store).database)
    assert [b.block_id for b in BlockLedger(over_socket, read_only=True).blocks()] == ["b1"]


def failing_once(monkeypatch, message: str):
    """Make the next MLMD call fail as MySQL does with `message`; the calls that failed."""
    from ml_metadata import errors as mlmd_errors
    from ml_metadata.metadata_store import metadata_store

    real = metadata_store.MetadataStore._call_method
    failed = []

    def call(store, method_name, request, response):
        if not failed:
            failed.append(method_name)
            raise mlmd_errors.InternalError(message)
        return real(store, method_name, request, response)

    monkeypatch.setattr(metadata_store.MetadataStore, "_call_method", call)
    return failed


@pytest.mark.parametrize("message", [
    "mysql_query failed: errno: Lost connection to MySQL server during query",
    "mysql_query failed: errno: Deadlock found when trying to get lock; try restarting "
    "transaction"])
def test_a_read_that_loses_its_connection_or_a_deadlock_is_read_again(mariadb_store, monkeypatch,
                                                                      message):
    ledger = BlockLedger.create(mariadb_store)
    ledger.add_block("b1", 1.0, 1e-6)
    connection = ledger.store._metadata_store
    failed = failing_once(monkeypatch, message)
    assert [block.block_id for block in ledger.blocks()] == ["b1"]
    assert failed and failed[0].startswith("Get")
    # A lost connection leaves the MLMD object dead for good: a new one replaced it.
    assert (ledger.store._metadata_store is connection) == ("Deadlock" in message)


def test_a_write_that_loses_its_connection_reconnects_and_says_its_fate_is_unknown(
        mariadb_store, monkeypatch):
    from sage_tfx.sage_access.store import CommitUnknown

    ledger = BlockLedger.create(mariadb_store)
    connection = ledger.store._metadata_store
    failing_once(monkeypatch, "mysql_query failed: errno: MySQL server has gone away")
    with pytest.raises(CommitUnknown):
        ledger.store.put_artifact_type(pb.ArtifactType(name="sage_tfx.test.Any"))
    assert ledger.store._metadata_store is not connection
    ledger.add_block("b1", 1.0, 1e-6)  # the new connection works
