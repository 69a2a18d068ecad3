"""Connecting to ML Metadata: an embedded SQLite file by default, any MLMD config otherwise.

`connect(store)` accepts:
* a path (str or Path): an SQLite MLMD file, created if missing;
* `":memory:"`: MLMD's in-memory fake database (one process only; simulators and unit tests);
* `"grpc://HOST:PORT"`: an MLMD gRPC server, e.g. Kubeflow's metadata-grpc-service on port 8080;
* a `metadata_store_pb2.ConnectionConfig` (SQLite, MySQL, ...);
* a `metadata_store_pb2.MetadataStoreClientConfig` (see `kubeflow_grpc_config`);
* an already open `MetadataStore`.
Any other `scheme://` string is refused (it is not silently taken for a relative path).

`connect_read_only(store)` is what inspecting commands use: an SQLite file is opened in MLMD's
READONLY mode after `inspect_sqlite` has checked, with Python's own read-only SQLite, that it
is an ML Metadata store holding sage-tfx's types; a file that is not is never handed to MLMD,
which would add its tables to it.
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import sqlite3
import time
import urllib.parse
from typing import Union

from ml_metadata import errors as mlmd_errors
from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2

from sage_tfx.sage_access.errors import BadRequest

StoreSpec = Union[str, os.PathLike, metadata_store_pb2.ConnectionConfig,
                  metadata_store_pb2.MetadataStoreClientConfig, metadata_store.MetadataStore]

_SQLITE_MAGIC = b"SQLite format 3\x00"
# An artifact type every sage-tfx ledger store has (`BlockLedger.create` registers it; the
# ledger names it from here).
STATE_TYPE = "sage_tfx.LedgerState"
# Kubeflow Pipelines' own ML Metadata, where a ledger on the cluster lives.
KUBEFLOW_LEDGER_STORE = "grpc://metadata-grpc-service:8080"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# How long a gRPC call may wait for an MLMD server before the store counts as unreachable.
GRPC_TIMEOUT_SECONDS = 30


class StoreRefused(BadRequest):
    """The store is not one sage-tfx may use for this command; nothing was read or written."""


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
    if isinstance(store, metadata_store_pb2.MetadataStoreClientConfig):
        return f"grpc://{store.host}:{store.port}"
    if isinstance(store, metadata_store_pb2.ConnectionConfig) and store.HasField("sqlite"):
        return store.sqlite.filename_uri
    raise ValueError(f"cannot describe store {store!r} as a string")


def parse(spec: str) -> StoreSpec:
    """Inverse of `describe`: `grpc://HOST:PORT`, `:memory:` or an SQLite path; StoreRefused
    for any other scheme or a gRPC address without a host or a valid port."""
    if spec.startswith("grpc://"):
        host, colon, port = spec[len("grpc://"):].rpartition(":")
        if not colon or not host or "/" in host or not port.isdigit() \
                or not 0 < int(port) < 65536:
            raise StoreRefused(f"store {spec!r}: a gRPC store is grpc://HOST:PORT "
                               "(e.g. grpc://metadata-grpc-service:8080)")
        return kubeflow_grpc_config(host, int(port))
    if _SCHEME.match(spec):
        raise StoreRefused(f"store {spec!r}: only a file path or grpc://HOST:PORT is supported")
    return spec


def connect(store: StoreSpec) -> metadata_store.MetadataStore:
    if isinstance(store, metadata_store.MetadataStore):
        return store
    if isinstance(store, str):
        store = parse(store)
    if isinstance(store, str) and store == ":memory:":
        config = metadata_store_pb2.ConnectionConfig()
        config.fake_database.SetInParent()
        return metadata_store.MetadataStore(config)
    if isinstance(store, (str, os.PathLike)):
        parent = os.path.dirname(os.path.abspath(os.fspath(store)))
        os.makedirs(parent, exist_ok=True)
        return _open_sqlite(sqlite_config(store))
    return metadata_store.MetadataStore(store)


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


def require_ledger_store(spec: str) -> None:
    """StoreRefused unless `spec` is a gRPC address, `:memory:` or an existing sage-tfx ledger
    file (checked before MLMD opens it: commands other than `init` never create a store)."""
    if isinstance(parse(spec), str) and spec != ":memory:":
        kind = inspect_sqlite(spec)
        if kind == "absent":
            raise StoreRefused(f"no ledger store at {spec}; create it with `sage-tfx ledger "
                               f"--store {spec} init`")
        if kind == "mlmd":
            raise StoreRefused(f"store {spec!r} is an ML Metadata store without a sage-tfx "
                               f"ledger; create one with `sage-tfx ledger --store {spec} init`")


def connect_read_only(spec: str) -> metadata_store.MetadataStore:
    """An MLMD connection that cannot write: a checked SQLite ledger in READONLY mode, or a
    gRPC server (the caller only reads)."""
    require_ledger_store(spec)
    store = parse(spec)
    if isinstance(store, str) and store != ":memory:":
        store = sqlite_config(store, read_only=True)
    try:
        return connect(store)
    except mlmd_errors.StatusError as error:
        raise StoreRefused(f"store {spec!r} cannot be opened: {error}") from None
