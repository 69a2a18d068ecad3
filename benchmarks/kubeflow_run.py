"""What benchmarks/kubeflow_local.py and benchmarks/tfx_taxi.py share: a ledger behind ML
Metadata's gRPC service (sage_tfx.sage_access.grpc_server in front of its own SQLite file), as a
Kubeflow cluster's tasks reach it, and one compiled job run by `sage-tfx kubeflow run-local`
(a process per task), timed."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from typing import Iterator

SAGE = [sys.executable, "-m", "sage_tfx.cli"]


@contextlib.contextmanager
def ledger_server(workdir: str) -> Iterator[str]:
    """Serve `workdir`/ledger.sqlite over gRPC on 127.0.0.1; yields the store address the
    tasks connect to, and stops the server on exit."""
    server = subprocess.Popen([sys.executable, "-m", "sage_tfx.sage_access.grpc_server",
                               "--store", os.path.join(workdir, "ledger.sqlite"),
                               "--host", "127.0.0.1"], stdout=subprocess.PIPE, text=True)
    try:
        yield re.match(r"listening on (\S+)", server.stdout.readline())[1]
    finally:
        server.terminate()
        server.wait(timeout=30)


def run_local(job: str, pipeline_root: str) -> dict:
    """Run the compiled `job` with `sage-tfx kubeflow run-local`: its wall time, exit status,
    each task's time as run-local reports it, and the log's tail when it failed."""
    started = time.monotonic()
    ran = subprocess.run([*SAGE, "kubeflow", "run-local", job, "--pipeline-root", pipeline_root],
                         capture_output=True, text=True)
    seconds = time.monotonic() - started
    tasks = {name: float(task_seconds) for name, task_seconds in
             re.findall(r"^  (\S+): done in ([\d.]+) s$", ran.stdout, re.M)}
    return {"run_seconds": round(seconds, 1), "exit": ran.returncode, "task_seconds": tasks,
            **({"log_tail": (ran.stdout + ran.stderr)[-3000:]} if ran.returncode else {})}
