"""An ML Metadata gRPC server in front of a ledger's store, for running compiled jobs off-cluster.

    python -m sage_tfx.sage_access.grpc_server --store ledger.sqlite [--host 127.0.0.1] [--port 0]

On Kubeflow, pods reach ML Metadata through `metadata-grpc-service:8080`, Google's C++
`metadata_store_server`. That binary is in no package we can install (shared STACK.md), so this
serves the same service, `ml_metadata.MetadataStoreService` from ml_metadata's own definitions
(metadata_store_service_pb2_grpc), by handing each request to ML Metadata's C++ store, the
library the binary itself wraps; the standard client (`grpc://HOST:PORT` in sage-tfx) talks to it
unchanged. Calls run one at a time (one worker thread), as each is one transaction of one store
connection. Prints `listening on HOST:PORT` once ready (the port chosen when --port is 0).
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from concurrent import futures

import grpc
from ml_metadata.metadata_store.pywrap.metadata_store_extension import (
    metadata_store as metadata_store_serialized)
from ml_metadata.proto import metadata_store_pb2, metadata_store_service_pb2
from ml_metadata.proto import metadata_store_service_pb2_grpc as service_grpc

from sage_tfx.sage_access.store import sqlite_config

SERVICE = metadata_store_service_pb2.DESCRIPTOR.services_by_name["MetadataStoreService"]


def _servicer(connection_config: metadata_store_pb2.ConnectionConfig):
    """A MetadataStoreServiceServicer forwarding each method the C++ library binds to one
    store; the few it does not bind (e.g. GetParentContextsByContexts in 1.17.1) stay the base
    class's UNIMPLEMENTED, which the Python client never calls."""
    store = metadata_store_serialized.CreateMetadataStore(
        connection_config.SerializeToString(),
        metadata_store_pb2.MigrationOptions().SerializeToString())

    def forward(name: str, response_class):
        call = getattr(metadata_store_serialized, name)

        def method(self, request, context):
            response, message, code = call(store, request.SerializeToString())
            if code != 0:  # ML Metadata's status codes are gRPC's
                context.abort(grpc.StatusCode(_STATUS[code]), message.decode("utf-8"))
            return response_class.FromString(response)
        method.__name__ = name
        return method

    methods = {m.name: forward(m.name, getattr(metadata_store_service_pb2, m.output_type.name))
               for m in SERVICE.methods if hasattr(metadata_store_serialized, m.name)}
    return type("LedgerStoreServicer", (service_grpc.MetadataStoreServiceServicer,), methods)()


# grpc.StatusCode by its integer code (absl status codes and gRPC's are the same numbers).
_STATUS = {code.value[0]: code.value for code in grpc.StatusCode}


def serve(connection_config: metadata_store_pb2.ConnectionConfig, host: str = "127.0.0.1",
          port: int = 0) -> tuple[grpc.Server, int]:
    """A started server over `connection_config`, and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    service_grpc.add_MetadataStoreServiceServicer_to_server(_servicer(connection_config), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="the SQLite ML Metadata file to serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    args = parser.parse_args(argv)
    server, port = serve(sqlite_config(args.store), args.host, args.port)
    print(f"listening on {args.host}:{port}", flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    stopped.wait()
    server.stop(grace=5).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
