"""Looking under the ledger, on either backend: raw SQL on a store and a digest of its contents
(for tests that tamper with a store or check that nothing wrote to it)."""
import contextlib
import hashlib
import sqlite3

from sage_tfx.sage_access.store import MySQLStore, parse


def _mysql_connection(store: MySQLStore):
    import pymysql

    return pymysql.connect(host=store.host, port=store.port, user=store.user,
                           password=store.password(), unix_socket=store.socket,
                           database=store.database, charset="utf8mb4")


def execute_sql(spec: str, statement: str) -> None:
    """Run one SQL statement on the store's database, committed, behind the ledger's back."""
    store = parse(spec)
    if isinstance(store, MySQLStore):
        with contextlib.closing(_mysql_connection(store)) as connection:
            with connection.cursor() as cursor:
                cursor.execute(statement)
            connection.commit()
        return
    with contextlib.closing(sqlite3.connect(spec)) as connection:
        connection.execute(statement)
        connection.commit()


def store_digest(spec: str) -> str:
    """A digest that changes when anything in the store changes: the SQLite file's bytes, or
    every table's checksum in the MySQL database."""
    store = parse(spec)
    if not isinstance(store, MySQLStore):
        with open(spec, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    with contextlib.closing(_mysql_connection(store)) as connection:
        with connection.cursor() as cursor:
            cursor.execute("SHOW TABLES")
            tables = sorted(row[0] for row in cursor.fetchall())
            cursor.execute("CHECKSUM TABLE " + ", ".join(f"`{table}`" for table in tables)
                           + " EXTENDED")
            return hashlib.sha256(repr(cursor.fetchall()).encode()).hexdigest()
