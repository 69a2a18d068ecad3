"""Connecting to ML Metadata: an embedded SQLite file by default, any MLMD config otherwise.

`connect(store)` accepts:
* a path (str or Path): an SQLite MLMD file, created if missing;
* `":memory:"`: MLMD's in-memory fake database (one process only; simulators and unit tests);
* `"grpc://HOST:PORT"`: an MLMD gRPC server, e.g. Kubeflow's metadata-grpc-service on port 8080;
  `grpc://HOST:PORT?tls=DIR` reaches one behind mutual TLS with the client certificate in DIR
  (ca.pem, client.pem, client.key: grpc_tls.py), read at connection; `grpc+unix:///PATH` one on
  a Unix socket (sage_access/grpc_server.py listens on one by default). See `GrpcStore`;
* `"mysql://USER@HOST[:PORT]/DATABASE"` or `"mysql://USER@localhost/DATABASE?socket=PATH"`: ML
  Metadata on MySQL/MariaDB (what Kubeflow runs), shared by many processes on many hosts. The
  password is never part of the spec (argv and records show it): it is read, at every
  (re)connection, from the file `?password_file=PATH` or else the environment variable
  SAGE_TFX_MYSQL_PASSWORD (none: no password). See `MySQLStore`;
* a `metadata_store_pb2.ConnectionConfig` (SQLite, MySQL, ...);
* a `metadata_store_pb2.MetadataStoreClientConfig` (see `kubeflow_grpc_config`,
  `grpc_tls.client_config`);
* an already open `MetadataStore`.
Any other `scheme://` string is refused (it is not silently taken for a relative path).

`connect_read_only(store)` is what inspecting commands use: an SQLite file is opened in MLMD's
READONLY mode after `inspect_sqlite` has checked, with Python's own read-only SQLite, that it
is an ML Metadata store holding sage-tfx's types; a file that is not is never handed to MLMD,
which would add its tables to it. A MySQL database is checked the same way (`inspect_mysql`, in a
read-only session) and opened without database creation: MLMD's own open would create a missing
database and its tables.
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import sqlite3
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar, Union

import grpc
from ml_metadata import errors as mlmd_errors
from ml_metadata.metadata_store import metadata_store
from ml_metadata.metadata_store.pywrap.metadata_store_extension import metadata_store as mlmd_cc
from ml_metadata.proto import metadata_store_pb2

from sage_tfx.private_files import open_private, private_directory
from sage_tfx.sage_access.errors import BadRequest, LedgerError

MYSQL_PASSWORD_VARIABLE = "SAGE_TFX_MYSQL_PASSWORD"
# A MySQL client retries its connection this long while the server restarts (a failover, a
# crash and recovery) before the store counts as unreachable.
MYSQL_RECONNECT_SECONDS = 120

_SQLITE_MAGIC = b"SQLite format 3\x00"
# An artifact type every sage-tfx ledger store has (`BlockLedger.create` registers it; the
# ledger names it from here).
STATE_TYPE = "sage_tfx.LedgerState"
# Kubeflow Pipelines' own ML Metadata, where a ledger on the cluster lives.
KUBEFLOW_LEDGER_STORE = "grpc://metadata-grpc-service:8080"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
UNIX_SOCKET_SCHEME = "grpc+unix://"
# How long a gRPC call may wait for an MLMD server before the store counts as unreachable.
GRPC_TIMEOUT_SECONDS = 30


T = TypeVar("T")


class StoreRefused(BadRequest):
    """The store is not one sage-tfx may use for this command; nothing was read or written."""


class StoreUnreachable(LedgerError):
    """The store's server could not be reached (or refused the login); nothing was written."""


class CommitUnknown(Exception):
    """A write lost its connection to the database: it may or may not have committed. The store
    has reconnected; the caller resolves what happened from the ledger (transaction.py)."""


_MYSQL_USER = re.compile(r"^[A-Za-z0-9_.$-]{1,80}$")
_MYSQL_DATABASE = re.compile(r"^[A-Za-z0-9_$]{1,64}$")
_MYSQL_OPTIONS = ("socket", "password_file")


@dataclass(frozen=True)
class MySQLStore:
    """`mysql://USER@HOST[:PORT]/DATABASE[?socket=PATH][&password_file=PATH]`, parsed. Holds no
    password: `config()` reads it when connecting (so a rotated password file is picked up on
    reconnection), from `password_file` or else $SAGE_TFX_MYSQL_PASSWORD."""
    user: str
    host: str
    port: int
    database: str
    socket: Optional[str] = None
    password_file: Optional[str] = None

    def __str__(self) -> str:
        options = urllib.parse.urlencode({key: getattr(self, key) for key in _MYSQL_OPTIONS
                                          if getattr(self, key)}, safe="/")
        return (f"mysql://{self.user}@{self.host}:{self.port}/{self.database}"
                + (f"?{options}" if options else ""))

    def password(self) -> str:
        if self.password_file is None:
            return os.environ.get(MYSQL_PASSWORD_VARIABLE, "")
        try:
            with open(self.password_file, encoding="utf-8") as handle:
                return handle.read().rstrip("\r\n")
        except OSError as error:
            raise StoreRefused(f"store {self}: cannot read the password file: "
                               f"{error.strerror}") from None

    def pymysql_connection(self, **options):
        """A PyMySQL connection to the server (StoreUnreachable if it cannot be made), utf8mb4;
        `options` are PyMySQL's (database, autocommit, ...)."""
        import pymysql  # only MySQL stores need it

        try:
            return pymysql.connect(host=self.host, port=self.port, user=self.user,
                                   password=self.password(), unix_socket=self.socket,
                                   connect_timeout=10, charset="utf8mb4", **options)
        except pymysql.MySQLError as error:
            raise StoreUnreachable(f"store {self}: cannot connect to the MySQL server "
                                   f"({error.args[-1]})") from None

    def config(self, create_database: bool = True) -> metadata_store_pb2.ConnectionConfig:
        config = metadata_store_pb2.ConnectionConfig()
        mysql = config.mysql
        mysql.database, mysql.user, mysql.password = self.database, self.user, self.password()
        if self.socket:  # MLMD aborts the process unless exactly one of host and socket is set
            mysql.socket = self.socket
        else:
            mysql.host, mysql.port = self.host, self.port
        mysql.skip_db_creation = not create_database
        return config


def _without_password(spec: str) -> str:
    """`spec` with the password of a `scheme://USER:PASSWORD@...` replaced by ***."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/@:]*):[^/]*@", r"\1:***@", spec)


def _parse_mysql(spec: str) -> MySQLStore:
    # The spec may be malformed because it holds a password (`USER:PASSWORD@`): no error below
    # quotes it; they name the part that is wrong.
    usage = ("a MySQL store is mysql://USER@HOST[:PORT]/DATABASE or "
             "mysql://USER@localhost/DATABASE?socket=PATH, with ?password_file=PATH or "
             f"${MYSQL_PASSWORD_VARIABLE} for the password")
    parts = urllib.parse.urlsplit(spec)
    user, at, address = parts.netloc.rpartition("@")
    if ":" in user:
        raise StoreRefused("a MySQL store spec must not hold the password (argv and records "
                           f"show it): use ?password_file=PATH or ${MYSQL_PASSWORD_VARIABLE}")
    host, colon, port = address.rpartition(":") if not address.endswith("]") else (address, "", "")
    if not colon:
        host, port = address, "3306"
    database = parts.path[1:]
    if not at or not _MYSQL_USER.match(user):
        raise StoreRefused(f"MySQL store: the user is missing or not a plain name; {usage}")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreRefused(f"MySQL store: host or port missing or invalid; {usage}")
    if not _MYSQL_DATABASE.match(database):
        raise StoreRefused(f"MySQL store: database {database!r} must be 1-64 letters, digits, "
                           f"_ or $; {usage}")
    options = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(options) - set(_MYSQL_OPTIONS))
    if unknown or any(len(values) != 1 or not values[0] for values in options.values()) \
            or parts.fragment:
        raise StoreRefused(f"MySQL store: options {sorted(options)} not understood (only "
                           f"socket and password_file, once each, non-empty); {usage}")
    if "socket" in options and host != "localhost":
        raise StoreRefused(f"MySQL store: a socket is on this host: give USER@localhost; {usage}")
    return MySQLStore(user=user, host=host, port=int(port), database=database,
                      socket=options.get("socket", [None])[0],
                      password_file=options.get("password_file", [None])[0])


@dataclass(frozen=True)
class GrpcStore:
    """An ML Metadata gRPC server: `grpc://HOST:PORT[?tls=DIR]` (`tls`: the client directory of
    a mutual TLS set, grpc_tls.py) or `grpc+unix:///PATH` (`socket`), parsed. Holds paths only:
    `client()` reads the certificates when connecting."""
    host: Optional[str] = None
    port: Optional[int] = None
    tls: Optional[str] = None
    socket: Optional[str] = None

    def __str__(self) -> str:
        if self.socket is not None:
            return f"{UNIX_SOCKET_SCHEME}{self.socket}"
        options = f"?{urllib.parse.urlencode({'tls': self.tls}, safe='/')}" if self.tls else ""
        return f"grpc://{self.host}:{self.port}{options}"

    def client(self) -> metadata_store.MetadataStore:
        if self.socket is not None:
            return _UnixSocketClient(self.socket)
        if self.tls is None:
            return metadata_store.MetadataStore(kubeflow_grpc_config(self.host, self.port))
        from sage_tfx.sage_access import grpc_tls

        try:
            return metadata_store.MetadataStore(grpc_tls.client_config(
                self.host, self.port, self.tls, GRPC_TIMEOUT_SECONDS))
        except (OSError, ValueError) as error:
            raise StoreRefused(f"store {self}: {error}") from None


class _UnixSocketClient(metadata_store.MetadataStore):
    """ML Metadata's gRPC client on a Unix socket: its config names only HOST:PORT, so the one
    step that makes the channel is replaced; every call is MLMD's own."""

    def __init__(self, path: str):
        self._socket = path
        super().__init__(metadata_store_pb2.MetadataStoreClientConfig(
            host="localhost", port=1, client_timeout_sec=GRPC_TIMEOUT_SECONDS))

    def _get_channel(self, config):
        self._grpc_timeout_sec = config.client_timeout_sec
        return grpc.insecure_channel(f"unix:{self._socket}")


def _parse_grpc(spec: str) -> GrpcStore:
    if spec.startswith(UNIX_SOCKET_SCHEME):
        path = spec[len(UNIX_SOCKET_SCHEME):]
        if not path.startswith("/"):
            raise StoreRefused(f"store {spec!r}: a Unix socket store is grpc+unix:///ABSOLUTE/PATH")
        return GrpcStore(socket=path)
    usage = ("a gRPC store is grpc://HOST:PORT (e.g. grpc://metadata-grpc-service:8080), "
             "with ?tls=DIR for mutual TLS")
    address, _, query = spec[len("grpc://"):].partition("?")
    host, colon, port = address.rpartition(":")
    if not colon or not host or "/" in host or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise StoreRefused(f"store {spec!r}: {usage}")
    options = urllib.parse.parse_qs(query, keep_blank_values=True)
    if set(options) - {"tls"} or any(len(v) != 1 or not v[0] for v in options.values()):
        raise StoreRefused(f"store {spec!r}: only the option tls=DIR is understood; {usage}")
    return GrpcStore(host=host, port=int(port), tls=options.get("tls", [None])[0])


StoreSpec = Union[str, os.PathLike, MySQLStore, GrpcStore, metadata_store_pb2.ConnectionConfig,
                  metadata_store_pb2.MetadataStoreClientConfig, metadata_store.MetadataStore]


def sqlite_config(path: Union[str, os.PathLike], read_only: bool = False
                  ) -> metadata_store_pb2.ConnectionConfig:
    modes = metadata_store_pb2.SqliteMetadataSourceConfig
    config = metadata_store_pb2.ConnectionConfig()
    config.sqlite.filename_uri = os.fspath(path)
    config.sqlite.connection_mode = modes.READONLY if read_only else modes.READWRITE_OPENCREATE
    return config


def kubeflow_grpc_config(host: str = "metadata-grpc-service",
                         port: int = 8080) -> metadata_store_pb2.MetadataStoreClientConfig:
    """The client config for Kubeflow Pipelines' MLMD service (in-cluster defaults)."""
    return metadata_store_pb2.MetadataStoreClientConfig(host=host, port=port,
                                                        client_timeout_sec=GRPC_TIMEOUT_SECONDS)


def describe(store: StoreSpec) -> str:
    """A string that `connect` accepts again, recorded in PrivacyGrant artifacts."""
    if isinstance(store, (str, os.PathLike)):
        return os.fspath(store)
    if isinstance(store, (MySQLStore, GrpcStore)):
        return str(store)
    if isinstance(store, metadata_store_pb2.MetadataStoreClientConfig):
        return f"grpc://{store.host}:{store.port}"
    if isinstance(store, metadata_store_pb2.ConnectionConfig) and store.HasField("sqlite"):
        return store.sqlite.filename_uri
    raise ValueError(f"cannot describe store {store!r} as a string")


def parse(spec: str) -> StoreSpec:
    """Inverse of `describe`: `grpc://HOST:PORT[?tls=DIR]` or `grpc+unix:///PATH` (GrpcStore),
    `mysql://...` (MySQLStore), `:memory:` or an SQLite path; StoreRefused for any other scheme
    or a malformed address."""
    if spec.startswith(("grpc://", UNIX_SOCKET_SCHEME)):
        return _parse_grpc(spec)
    if spec.startswith("mysql://"):
        return _parse_mysql(spec)
    if _SCHEME.match(spec):
        raise StoreRefused(f"store {_without_password(spec)!r}: only a file path, "
                           "grpc://HOST:PORT, grpc+unix:///PATH or "
                           "mysql://USER@HOST:PORT/DATABASE is supported")
    return spec


def connect(store: StoreSpec) -> metadata_store.MetadataStore:
    if isinstance(store, metadata_store.MetadataStore):
        return store
    if isinstance(store, str):
        store = parse(store)
    if isinstance(store, MySQLStore):
        return ReconnectingMySQLStore(store)
    if isinstance(store, GrpcStore):
        return store.client()
    if isinstance(store, str) and store == ":memory:":
        config = metadata_store_pb2.ConnectionConfig()
        config.fake_database.SetInParent()
        return metadata_store.MetadataStore(config)
    if isinstance(store, (str, os.PathLike)):
        _create_private_sqlite(os.fspath(store))
        return _open_sqlite(sqlite_config(store))
    return metadata_store.MetadataStore(store)


def _create_private_sqlite(path: str) -> None:
    """A new SQLite ledger is an empty file made 0600 (a missing directory 0700) before ML
    Metadata opens it, which would create it with the umask's mode (0644 under umask 022:
    every user of the machine could read the ledger). SQLite gives its journal the database
    file's mode; an existing file is left as it is (see private_files.py)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        private_directory(parent)
    try:
        open_private(path, exclusive=True).close()
    except FileExistsError:  # an existing store, or another process creating it right now
        pass


# Opening an SQLite store runs MLMD's schema check in a write transaction; when many processes
# open the same file at once (pipelines starting together), MLMD gives up after its own few
# retries with "Concurrent writes aborted". Opening changes nothing, so it is safe to try again.
_OPEN_ATTEMPTS = 20


def _open_sqlite(config) -> metadata_store.MetadataStore:
    for _ in range(_OPEN_ATTEMPTS - 1):
        try:
            return metadata_store.MetadataStore(config)
        except RuntimeError as error:
            if "Concurrent writes aborted" not in str(error):
                raise
            time.sleep(random.uniform(0.05, 0.5))
    return metadata_store.MetadataStore(config)


# How MySQL, through MLMD's C++ client, says the connection is gone (the server died or
# restarted, the network dropped). After one of them the MetadataStore object fails forever,
# even once the server is back ("Transaction already open"), so it is replaced.
_CONNECTION_LOST = ("lost connection", "server has gone away", "can't connect",
                    "transaction already open", "mysql_real_connect failed",
                    "connection refused", "server shutdown in progress", "connection was killed")


def is_lock_error(error: Exception) -> bool:
    """A concurrent writer got in the way; the call was rolled back as a whole, so it is safe
    to run again. SQLite reports a busy/locked database; MySQL (InnoDB) picks a deadlock victim,
    reads included (MLMD reads LOCK IN SHARE MODE), or times a lock wait out."""
    text = str(error).lower()
    return any(sign in text for sign in ("locked", "busy", "deadlock", "lock wait timeout"))


def connection_lost(error: Exception) -> bool:
    text = str(error).lower()
    return any(symptom in text for symptom in _CONNECTION_LOST)


def until_reachable(open_connection: Callable[[], T]) -> T:
    """`open_connection()`, tried again while it raises StoreUnreachable (the server restarting)
    for up to MYSQL_RECONNECT_SECONDS, then StoreUnreachable."""
    deadline = time.monotonic() + MYSQL_RECONNECT_SECONDS
    pause = 0.1
    while True:
        try:
            return open_connection()
        except StoreUnreachable:
            if time.monotonic() > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 2.0)


class ReconnectingMySQLStore(metadata_store.MetadataStore):
    """ML Metadata on MySQL that survives losing its connection: it drops the dead C++ store
    object and makes a new one (waiting up to MYSQL_RECONNECT_SECONDS for the server), then
    repeats a read (safe: it changes nothing) or raises CommitUnknown for a write, whose fate
    only the ledger can tell (transaction.Transactions.retrying resolves it).

    `read_only`: MLMD has no read-only mode on MySQL, so this client refuses every call but
    MLMD's Get* reads, and never creates the database."""

    def __init__(self, spec: MySQLStore, read_only: bool = False):
        # Not MetadataStore.__init__: it logs the ConnectionConfig (with the password) at DEBUG.
        self.spec = spec
        self.read_only = read_only
        self._config = None
        self._max_num_retries = 5
        self._service_client_wrapper = None
        self._using_db_connection = True
        self._open()

    def _open(self) -> None:
        config = self.spec.config(create_database=not self.read_only)
        try:
            self._metadata_store = mlmd_cc.CreateMetadataStore(
                config.SerializeToString(),
                metadata_store_pb2.MigrationOptions().SerializeToString())
        except (RuntimeError, mlmd_errors.StatusError) as error:
            if "unknown database" in str(error).lower():
                raise StoreRefused(f"store {self.spec}: the database does not exist; create "
                                   f"the ledger with `sage-tfx ledger --store {self.spec} "
                                   "init`") from None
            raise StoreUnreachable(f"store {self.spec}: cannot connect to the MySQL server "
                                   f"({error or 'no answer'})") from None

    def _reconnect(self) -> None:
        self._metadata_store = None  # the dead connection goes with its object
        until_reachable(self._open)

    def _call_method(self, method_name, request, response) -> None:
        reading = method_name.startswith("Get")
        if self.read_only and not reading:
            raise StoreRefused(f"store {self.spec} is opened read-only: {method_name} refused")
        deadline = time.monotonic() + MYSQL_RECONNECT_SECONDS
        while True:
            try:
                if self._metadata_store is None:
                    self._reconnect()
                return super()._call_method(method_name, request, response)
            except (RuntimeError, mlmd_errors.StatusError) as error:
                if reading and is_lock_error(error) and time.monotonic() < deadline:
                    time.sleep(random.uniform(0, 0.02))  # a deadlock victim: read again
                    continue
                if not connection_lost(error):
                    raise
            self._reconnect()
            if not reading:
                raise CommitUnknown(f"{method_name} on {self.spec} lost its connection; it "
                                    "may or may not have committed")


def inspect_mysql(store: MySQLStore) -> str:
    """What the database `store` names is, read in a read-only session: "absent", "empty",
    "mlmd" (ML Metadata without a sage-tfx ledger) or "ledger". StoreRefused for a database
    holding other tables; StoreUnreachable if the server cannot be reached or refuses us."""
    connection = store.pymysql_connection()
    with contextlib.closing(connection), connection.cursor() as cursor:
        cursor.execute("SET SESSION TRANSACTION READ ONLY")
        cursor.execute("SELECT count(*) FROM information_schema.schemata WHERE schema_name = %s",
                       (store.database,))
        if not cursor.fetchone()[0]:
            return "absent"
        cursor.execute("SELECT table_name FROM information_schema.tables "
                       "WHERE table_schema = %s", (store.database,))
        tables = {row[0] for row in cursor.fetchall()}
        if not tables:
            return "empty"
        if not {"Type", "MLMDEnv"} <= tables:
            raise StoreRefused(f"store {store}: the database holds tables that are not an ML "
                               "Metadata store, so it is not a sage-tfx ledger; left unchanged")
        # The name was checked by _MYSQL_DATABASE, so quoting it is safe.
        cursor.execute(f"SELECT count(*) FROM `{store.database}`.`Type` WHERE name = %s",
                       (STATE_TYPE,))
        return "ledger" if cursor.fetchone()[0] else "mlmd"


def inspect_sqlite(path: Union[str, os.PathLike]) -> str:
    """What the file at `path` is, read without changing a byte: "absent", "mlmd" (an ML Metadata
    store without a sage-tfx ledger) or "ledger". StoreRefused for anything else (a directory,
    an empty file, another SQLite database, a damaged file)."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return "absent"
    if os.path.isdir(path):
        raise StoreRefused(f"store {path!r} is a directory; give the ledger's SQLite file")
    try:
        with open(path, "rb") as handle:
            magic = handle.read(len(_SQLITE_MAGIC))
    except OSError as error:
        raise StoreRefused(f"store {path!r} cannot be read: {error.strerror}") from None
    if magic != _SQLITE_MAGIC:
        what = "is empty" if not magic else "is not an SQLite file"
        raise StoreRefused(f"store {path!r} {what}, so it is not a sage-tfx ledger; left unchanged")
    uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as connection:
            tables = {row[0] for row in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not {"Type", "MLMDEnv"} <= tables:
                raise StoreRefused(f"store {path!r} is an SQLite database but not an ML Metadata "
                                   "store, so it is not a sage-tfx ledger; left unchanged")
            found = connection.execute("SELECT count(*) FROM Type WHERE name = ?",
                                       (STATE_TYPE,)).fetchone()[0]
    except sqlite3.DatabaseError as error:
        raise StoreRefused(f"store {path!r} is damaged or truncated ({error}); left unchanged") \
            from None
    return "ledger" if found else "mlmd"


def check_creatable(spec: str) -> None:
    """What `init` checks before it creates a ledger at `spec`: an SQLite file's directory
    exists and the file is absent or an ML Metadata store; a MySQL database is absent, empty or
    an ML Metadata store (never another application's tables)."""
    store = parse(spec)
    if isinstance(store, MySQLStore):
        inspect_mysql(store)
    elif isinstance(store, str) and store != ":memory:":
        parent = os.path.dirname(os.path.abspath(store))
        if not os.path.isdir(parent):
            raise BadRequest(f"directory {parent} does not exist; create it first")
        inspect_sqlite(store)


def require_ledger_store(spec: str) -> None:
    """StoreRefused unless `spec` is a gRPC address, `:memory:`, an existing sage-tfx ledger
    file or MySQL database (checked before MLMD opens it: commands other than `init` never
    create a store)."""
    store = parse(spec)
    if isinstance(store, MySQLStore):
        kind = inspect_mysql(store)
    elif isinstance(store, str) and spec != ":memory:":
        kind = inspect_sqlite(spec)
    else:
        return
    if kind in ("absent", "empty"):
        raise StoreRefused(f"no ledger store at {spec}; create it with `sage-tfx ledger "
                           f"--store {spec} init`")
    if kind == "mlmd":
        raise StoreRefused(f"store {spec!r} is an ML Metadata store without a sage-tfx "
                           f"ledger; create one with `sage-tfx ledger --store {spec} init`")


def connect_read_only(spec: str) -> metadata_store.MetadataStore:
    """An MLMD connection that does not write: a checked SQLite ledger in READONLY mode; a
    checked MySQL ledger whose client refuses writes (the schema was checked to exist, so
    opening creates and upgrades nothing); or a gRPC server (the caller only reads)."""
    require_ledger_store(spec)
    store = parse(spec)
    if isinstance(store, MySQLStore):
        return ReconnectingMySQLStore(store, read_only=True)
    if isinstance(store, str) and store != ":memory:":
        store = sqlite_config(store, read_only=True)
    try:
        return connect(store)
    except mlmd_errors.StatusError as error:
        raise StoreRefused(f"store {spec!r} cannot be opened: {error}") from None
