"""An ML Metadata gRPC server in front of a ledger's store, for running compiled jobs off-cluster.

    python -m sage_tfx.sage_access.grpc_server --store ledger.sqlite [--socket PATH]
    python -m sage_tfx.sage_access.grpc_server --store ledger.sqlite --host HOST [--port 0]
                                               [--tls DIR]

On Kubeflow, pods reach ML Metadata through `metadata-grpc-service:8080`, Google's C++
`metadata_store_server`. That binary is in no package we can install (shared STACK.md), so this
serves the same service, `ml_metadata.MetadataStoreService` from ml_metadata's own definitions
(metadata_store_service_pb2_grpc), by handing each request to ML Metadata's C++ store, the
library the binary itself wraps; the standard client talks to it unchanged. Calls run one at a
time (one worker thread), as each is one transaction of one store connection.

Who may write. Whoever can call the service can rewrite every balance (a plain MLMD client set a
block's spent back to 0 and the block paid again), so the server listens only where callers are
known:
* by default on a Unix socket (`--socket`, default STORE.sock beside the store), 0600: only the
  server's own user can connect. Clients name it `grpc+unix:///PATH`;
* on TCP (`--host`): off the loopback interface only with `--tls DIR`, mutual TLS, where every
  client must present a certificate of the ledger's own CA (grpc_tls.py makes the set; clients
  name it `grpc://HOST:PORT?tls=CLIENT_DIR`). A loopback address without TLS is allowed (any
  user of this machine can then write the ledger: it says so on stderr) for local test runs.
Prints `listening on ADDRESS` once ready: grpc+unix:///PATH, or grpc://HOST:PORT (the port
chosen when --port is 0; clients add ?tls=CLIENT_DIR when the server has --tls).
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import threading
from concurrent import futures

import grpc
from ml_metadata.metadata_store.pywrap.metadata_store_extension import (
    metadata_store as metadata_store_serialized)
from ml_metadata.proto import metadata_store_pb2, metadata_store_service_pb2
from ml_metadata.proto import metadata_store_service_pb2_grpc as service_grpc

from sage_tfx.sage_access import grpc_tls
from sage_tfx.sage_access.store import UNIX_SOCKET_SCHEME, sqlite_config
from sage_tfx.private_files import PRIVATE_FILE_MODE

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


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (127.0.0.0/8, ::1): a name
    that resolves to anything else, or not at all, is not."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


class InsecureListen(ValueError):
    """Listening here would let anyone who reaches the address write the ledger."""


def serve(connection_config: metadata_store_pb2.ConnectionConfig, host: str = "127.0.0.1",
          port: int = 0, tls: str | None = None, unix_socket: str | None = None
          ) -> tuple[grpc.Server, str]:
    """A started server over `connection_config` and the store spec clients pass: on the Unix
    socket `unix_socket` (0600), or on host:port (mutual TLS from the server directory `tls`;
    InsecureListen off loopback without it)."""
    if unix_socket is None and tls is None and not is_loopback(host):
        raise InsecureListen(
            f"refusing to listen on {host} without --tls: anyone reaching it could rewrite the "
            "ledger's balances. Make certificates with `python -m "
            "sage_tfx.sage_access.grpc_tls DIR --name HOST` and pass --tls DIR/server, or "
            "listen on a Unix socket (--socket) or a loopback address")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    service_grpc.add_MetadataStoreServiceServicer_to_server(_servicer(connection_config), server)
    if unix_socket is not None:
        path = os.path.abspath(unix_socket)
        # Created under umask 077, so the socket is never connectable by others, not even
        # between bind and the chmod (Linux checks write permission on a socket's connect).
        previous = os.umask(0o077)
        try:
            bound = server.add_insecure_port(f"unix:{path}")
        finally:
            os.umask(previous)
        if bound == 0:
            raise OSError(f"cannot listen on the Unix socket {path} (does it exist already?)")
        os.chmod(path, PRIVATE_FILE_MODE)
        server.start()
        return server, f"{UNIX_SOCKET_SCHEME}{path}"
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", grpc_tls.server_credentials(tls))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, f"grpc://{host}:{bound}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="the SQLite ML Metadata file to serve")
    parser.add_argument("--socket", help="the Unix socket to listen on (default, without "
                                         "--host: STORE.sock)")
    parser.add_argument("--host", help="listen on TCP at this address instead of a socket "
                                       "(off loopback only with --tls)")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--tls", metavar="DIR",
                        help="mutual TLS: the server directory grpc_tls made (ca.pem, "
                             "server.pem, server.key); clients must hold the CA's client "
                             "certificate")
    args = parser.parse_args(argv)
    if args.socket and (args.host or args.tls):
        parser.error("--socket listens on a Unix socket: give it without --host and --tls")
    if args.tls and not args.host:
        parser.error("--tls is for TCP: give --host too")
    unix_socket = None if args.host else (args.socket or f"{args.store}.sock")
    try:
        server, address = serve(sqlite_config(args.store), args.host, args.port, args.tls,
                                unix_socket)
    except (InsecureListen, ValueError, OSError) as error:
        print(f"grpc_server: {error}", file=sys.stderr)
        return 2
    if args.host and not args.tls:
        print(f"grpc_server: warning: {args.host} has no TLS: any user of this machine can "
              "write the ledger (use --socket, or --tls)", file=sys.stderr)
    print(f"listening on {address}", flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    stopped.wait()
    server.stop(grace=5).wait()
    if unix_socket is not None and os.path.exists(unix_socket):
        os.unlink(unix_socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
