"""Beam's portable runner on this machine: the Python job service and an external SDK worker
pool, each a separate process, so a pipeline's workers are processes of their own that receive
everything over the Fn API (pickled DoFns, coded elements), as on Flink or Dataflow.

    with PortableRunner(workers=2) as runner:
        with beam.Pipeline(options=PipelineOptions(runner.options())) as pipeline: ...

Run as a script it is one of the two services (``job-service PORT_FILE`` or ``worker-pool
PORT_FILE``): each binds port 0 and writes the port it got to PORT_FILE, so there is no race for a
free port. Two differences from Beam's own mains (``local_job_service_main``,
``worker_pool_main``), both needed to test what the docs claim:
- Beam's job service runs every job with one SDK worker (its ``FnApiRunner`` never reads the
  options' worker count); here it reads ``--sdk_worker_parallelism`` (the portable option Flink's
  and Spark's job servers read too) and the runner then splits every stage's input among that
  many workers (``fn_runner.ParallelBundleManager``).
- Beam's worker pool kills its workers in an ``atexit`` hook, which SIGTERM skips; here SIGTERM
  exits through ``sys.exit`` so the hook runs. The harness also kills the pool's whole process
  group, so a worker survives neither way.
The worker pool starts each worker as ``python`` from PATH: the harness puts this interpreter's
directory first, so workers run the project's virtualenv, and ``tests/`` on PYTHONPATH.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
STARTUP_SECONDS = 60.0
STOP_SECONDS = 10.0


class PortableRunner:
    """The job service and a worker pool of ``workers`` workers per job, started on entry and
    stopped on exit (SIGTERM to each process group, SIGKILL after ``STOP_SECONDS``)."""

    def __init__(self, workers: int = 2):
        self.workers = workers
        self._processes: list[subprocess.Popen] = []
        self._directory = None
        self.job_port = self.pool_port = None

    def __enter__(self) -> "PortableRunner":
        self._directory = tempfile.TemporaryDirectory(prefix="beam-portable-")
        try:
            self.job_port = self._start("job-service")
            self.pool_port = self._start("worker-pool")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def options(self, *extra: str) -> list[str]:
        """Pipeline arguments (``beam_pipeline_args`` in TFX) that run on these services."""
        return ["--runner=PortableRunner", f"--job_endpoint=localhost:{self.job_port}",
                "--environment_type=EXTERNAL", f"--environment_config=localhost:{self.pool_port}",
                f"--sdk_worker_parallelism={self.workers}", *extra]

    @property
    def pool_pid(self) -> int:
        return self._processes[1].pid

    def cpu_seconds(self) -> dict:
        """CPU time (user + system) used so far by the job service (which runs the shuffles
        and moves every element to and from the workers) and by the worker pool with its
        workers (the DoFns), once the last job's workers have exited."""
        import psutil

        def seconds(process) -> float:
            times = process.cpu_times()  # readable for a zombie too
            return times.user + times.system + times.children_user + times.children_system

        def running(process) -> bool:
            try:
                return process.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        pool = psutil.Process(self.pool_pid)
        deadline = time.monotonic() + STOP_SECONDS
        while any(map(running, pool.children())) and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = 0.0
        for child in pool.children():  # exited but not reaped: their time is not the pool's yet
            try:
                workers += seconds(child)
            except psutil.NoSuchProcess:
                pass  # reaped meanwhile: counted in the pool's children times below
        return {"job_service": seconds(psutil.Process(self._processes[0].pid)),
                "workers": seconds(pool) + workers}

    def workers_started(self) -> int:
        """How many SDK workers the pool has started so far (``workers`` per job)."""
        log = Path(self._directory.name) / "worker-pool.log"
        return log.read_text(errors="replace").count("Starting worker with command")

    def _start(self, service: str) -> int:
        directory = Path(self._directory.name)
        port_file = directory / f"{service}.port"
        environment = dict(os.environ)
        # the pool starts workers as `python`: this interpreter (the project's venv) first
        environment["PATH"] = os.path.dirname(sys.executable) + os.pathsep + environment["PATH"]
        # and the tests' modules importable (`support.*`, DoFns defined in test files), as a
        # real cluster needs the job's own modules installed on its workers
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(TESTS), environment.get("PYTHONPATH")]))
        log = open(directory / f"{service}.log", "wb")
        process = subprocess.Popen([sys.executable, __file__, service, str(port_file)],
                                   stdout=log, stderr=subprocess.STDOUT, env=environment,
                                   # its own process group: stop() kills the workers too
                                   start_new_session=True)
        log.close()
        self._processes.append(process)
        deadline = time.monotonic() + STARTUP_SECONDS
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Beam {service} did not start:\n"
                                   + (directory / f"{service}.log").read_text(errors="replace"))
            time.sleep(0.05)
        return int(port_file.read_text())

    def stop(self) -> None:
        for process in self._processes:
            _signal_group(process, signal.SIGTERM)
        for process in self._processes:
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            # the group, not only its leader: a worker the pool failed to stop dies here
            _signal_group(process, signal.SIGKILL)
            process.wait()
        self._processes = []
        if self._directory is not None:
            self._directory.cleanup()
            self._directory = None


def _signal_group(process: subprocess.Popen, number: int) -> None:
    try:
        os.killpg(process.pid, number)
    except ProcessLookupError:
        pass  # the whole group is gone already


def _write_port(port_file: str, port: int) -> None:
    # written then renamed: the harness never reads half a number
    Path(port_file + ".tmp").write_text(str(port))
    os.replace(port_file + ".tmp", port_file)


def _serve_jobs(port_file: str) -> None:
    from apache_beam.options.pipeline_options import PortableOptions
    from apache_beam.portability.api import beam_job_api_pb2
    from apache_beam.runners.portability import local_job_service
    from apache_beam.runners.portability.fn_api_runner import fn_runner

    def invoke_runner(job):
        # BeamJob._invoke_runner, with the worker count read from the job's options
        job.set_state(beam_job_api_pb2.JobState.RUNNING)
        runner = fn_runner.FnApiRunner(provision_info=job._provision_info)
        # (the options arrive through the job API as strings)
        parallelism = job.pipeline_options().view_as(PortableOptions).sdk_worker_parallelism
        runner._num_workers = max(int(parallelism or 1), 1)
        return runner.run_via_runner_api(job._pipeline_proto, job.pipeline_options())

    local_job_service.BeamJob._invoke_runner = invoke_runner
    servicer = local_job_service.LocalJobServicer()
    _write_port(port_file, servicer.start_grpc_server(0))
    try:
        while True:
            time.sleep(3600)
    finally:
        servicer.stop()


def _serve_workers(port_file: str) -> None:
    from apache_beam.runners.worker.worker_pool_main import BeamFnExternalWorkerPoolServicer

    address, server = BeamFnExternalWorkerPoolServicer.start(use_process=True, port=0)
    _write_port(port_file, int(address.rsplit(":", 1)[1]))
    try:
        while True:
            time.sleep(3600)
    finally:
        server.stop(0)


if __name__ == "__main__":
    # SIGTERM exits through sys.exit: `finally` and atexit hooks (the pool kills its workers) run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    service, port_file = sys.argv[1:]
    {"job-service": _serve_jobs, "worker-pool": _serve_workers}[service](port_file)
