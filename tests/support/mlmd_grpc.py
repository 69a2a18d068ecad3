"""An ML Metadata gRPC server process in front of an SQLite ledger file, as Kubeflow's
metadata-grpc-service stands in front of its database (sage_tfx.sage_access.grpc_server)."""
import contextlib
import re
import subprocess
import sys


@contextlib.contextmanager
def grpc_store(path: str):
    """Yield `grpc://127.0.0.1:PORT` served by a new server process over the file at `path`;
    the process is stopped on exit."""
    server = subprocess.Popen([sys.executable, "-m", "sage_tfx.sage_access.grpc_server",
                               "--store", path], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        listening = re.match(r"listening on (\S+:\d+)$", server.stdout.readline().strip())
        assert listening, server.stderr.read()[-3000:]
        yield f"grpc://{listening[1]}"
    finally:
        server.terminate()
        server.wait(timeout=30)
