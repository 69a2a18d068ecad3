"""The portable-runner harness itself: a job's elements really are processed by 2 separate worker
processes, and stopping the harness leaves no process behind."""
import os
import threading
import time

import apache_beam as beam
import psutil
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from support.portable_runner import PortableRunner

pytestmark = pytest.mark.slow


class _RecordWorker(beam.DoFn):
    """Appends each element to a file named after the worker process that saw it."""

    def __init__(self, directory: str):
        self._directory = directory

    def process(self, element):
        with open(os.path.join(self._directory, str(os.getpid())), "a") as file:
            file.write(f"{element}\n")
        yield element


def _run_recording(options: list[str], directory) -> dict[int, int]:
    with beam.Pipeline(options=PipelineOptions(options)) as pipeline:
        _ = (pipeline | beam.Create(range(200)) | beam.Reshuffle()
             | beam.ParDo(_RecordWorker(str(directory))))
    return {int(name): len((directory / name).read_text().split())
            for name in os.listdir(directory)}


def test_a_job_runs_on_two_worker_processes_started_by_the_pool(portable_runner, tmp_path):
    seen = _run_recording(portable_runner.options(), tmp_path)
    assert len(seen) == 2 and sum(seen.values()) == 200
    assert os.getpid() not in seen  # not in this process (the DirectRunner's place)
    # both are (finished) children of the worker pool, not of the job service
    pool_children = {child.pid for child in psutil.Process(portable_runner.pool_pid).children()}
    assert set(seen) <= pool_children


def test_stopping_the_harness_leaves_no_process_behind(tmp_path):
    runner = PortableRunner(workers=2)
    with runner:
        _run_recording(runner.options(), tmp_path)
        services = [psutil.Process(process.pid) for process in runner._processes]
        started = services + [child for service in services
                              for child in service.children(recursive=True)]
        assert len(started) >= 2
    for process in started:
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE, process


class _Stall(beam.DoFn):
    def process(self, element):
        time.sleep(600)
        yield element


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_stopping_the_harness_mid_job_kills_the_running_workers():
    """Stopped while a job runs (a test timing out, Ctrl-C), the harness takes the job's
    workers down with the pool: none is left sleeping in its DoFn."""
    runner = PortableRunner(workers=2)
    with runner:
        job = threading.Thread(target=_run_quietly, args=(runner.options(),), daemon=True)
        job.start()
        pool = psutil.Process(runner.pool_pid)
        deadline = time.monotonic() + 60
        while len(workers := [child for child in pool.children()
                              if child.status() != psutil.STATUS_ZOMBIE]) < 2:
            assert time.monotonic() < deadline, "the job's workers did not start"
            time.sleep(0.1)
    for worker in workers:
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, worker


def _run_quietly(options):
    try:
        with beam.Pipeline(options=PipelineOptions(options)) as pipeline:
            _ = pipeline | beam.Create(range(4)) | beam.Reshuffle() | beam.ParDo(_Stall())
    except Exception:  # the job dies with the services: expected
        pass
