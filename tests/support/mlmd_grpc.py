"""An ML Metadata gRPC server process in front of an SQLite ledger file, as Kubeflow's
metadata-grpc-service stands in front of its database (sage_tfx.sage_access.grpc_server)."""
import contextlib
import re
import subprocess
import sys


@contextlib.contextmanager
def grpc_store(path: str, *options: str):
    """Yield the store spec (`grpc://127.0.0.1:PORT` by default; what the server prints) of a
    new server process over the file at `path`, started with `options` (default: --host
    127.0.0.1, the address compiled Kubeflow jobs name); the process is stopped on exit."""
    server = subprocess.Popen([sys.executable, "-m", "sage_tfx.sage_access.grpc_server",
                               "--store", path, *(options or ("--host", "127.0.0.1"))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        listening = re.match(r"listening on (\S+)$", server.stdout.readline().strip())
        assert listening, server.stderr.read()[-3000:]
        yield listening[1]
    finally:
        server.terminate()
        server.wait(timeout=30)
