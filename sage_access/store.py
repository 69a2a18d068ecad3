"""Connecting to ML Metadata: an embedded SQLite file by default, any MLMD config otherwise.

`connect(store)` accepts:
* a path (str or Path): an SQLite MLMD file, created if missing;
* `":memory:"`: MLMD's in-memory fake database (one process only; simulators and unit tests);
* a `metadata_store_pb2.ConnectionConfig` (SQLite, MySQL, ...);
* a `metadata_store_pb2.MetadataStoreClientConfig`: an MLMD gRPC server, e.g. Kubeflow's
  metadata-grpc-service on port 8080 (see `kubeflow_grpc_config`);
* an already open `MetadataStore`.
"""
from __future__ import annotations

import os
from typing import Union

from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2

StoreSpec = Union[str, os.PathLike, metadata_store_pb2.ConnectionConfig,
                  metadata_store_pb2.MetadataStoreClientConfig, metadata_store.MetadataStore]


def sqlite_config(path: Union[str, os.PathLike]) -> metadata_store_pb2.ConnectionConfig:
    config = metadata_store_pb2.ConnectionConfig()
    config.sqlite.filename_uri = os.fspath(path)
    config.sqlite.connection_mode = metadata_store_pb2.SqliteMetadataSourceConfig.READWRITE_OPENCREATE
    return config


def kubeflow_grpc_config(host: str = "metadata-grpc-service",
                         port: int = 8080) -> metadata_store_pb2.MetadataStoreClientConfig:
    """The client config for Kubeflow Pipelines' MLMD service (in-cluster defaults)."""
    return metadata_store_pb2.MetadataStoreClientConfig(host=host, port=port)


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
    """Inverse of `describe`: `grpc://host:port`, `:memory:` or an SQLite path."""
    if spec.startswith("grpc://"):
        host, _, port = spec[len("grpc://"):].rpartition(":")
        return kubeflow_grpc_config(host, int(port))
    return spec


def connect(store: StoreSpec) -> metadata_store.MetadataStore:
    if isinstance(store, metadata_store.MetadataStore):
        return store
    if isinstance(store, str) and store.startswith("grpc://"):
        store = parse(store)
    if isinstance(store, str) and store == ":memory:":
        config = metadata_store_pb2.ConnectionConfig()
        config.fake_database.SetInParent()
        return metadata_store.MetadataStore(config)
    if isinstance(store, (str, os.PathLike)):
        parent = os.path.dirname(os.path.abspath(os.fspath(store)))
        os.makedirs(parent, exist_ok=True)
        store = sqlite_config(store)
    return metadata_store.MetadataStore(store)
