"""Run a compiled Kubeflow PipelineJob on this machine, task by task, as the cluster would.

    sage-tfx kubeflow run-local JOB.json --pipeline-root DIR

For each task of the job's root DAG, in topological order, one process runs the container
command and arguments the JSON gives (TFX's `kubeflow_v2_run_executor`) with the `{{$}}`
placeholder filled as Kubeflow Pipelines 2's driver and launcher fill it: an ExecutorInput JSON
holding the task's constant parameters (`parameterValues`), its input artifacts (what the
producing task's executor wrote in its output metadata file, else the artifact it was given) and
one output artifact per output, at `<run root>/<task>/<output>` (the launcher's
generateOutputURI), where the run root is `DIR/<pipeline name>/<run id>`. The executor's output
metadata file is read back, as the launcher reads it, to pass the artifacts on. A resolver task
(TFX's Resolver, e.g. the latest blessed model) starts no process: on a cluster the driver
queries the launcher's ML Metadata records, which run-local does not write, so it resolves no
artifact, as on a cluster's first run, and its consumers get an empty input. Nothing else is
shared between tasks: every artifact travels through the pipeline root, and the ledger is
reached only through the store the job names (on a cluster `grpc://metadata-grpc-service:8080`;
compile with `--ledger-store grpc://HOST:PORT` to point a job at another MLMD server).

What differs from a cluster: the processes run this interpreter's `python` (first on PATH), not
the image's, in an empty working directory; the environment is the Dockerfile's
(TF_USE_LEGACY_KERAS=1); a task whose command is `python -m`/`-c` is forked from one launcher
process per job that imported the entrypoint's imports and the job's executors first
(pipelines/task_processes.py: each task still its own process, started as `python -m` starts
it, without paying seconds of TensorFlow and TFX imports each); the launcher's own MLMD records
of the run (executions, the system.PipelineRun context) are not written; no caching or
retries. The first failing task
stops the job: later tasks never start. Why not `kfp.local`: docs/pipelines.md.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import sys
import time
import uuid
from typing import Callable, Mapping, Optional

from sage_tfx.pipelines.task_processes import TaskProcesses

__all__ = ["JOB_SCHEMA_VERSION", "JobFailed", "JobRefused", "LocalRun", "TaskRun",
           "run_local", "task_order"]

# Kubeflow Pipelines 2's driver takes constant parameters only as `runtimeValue.constant`, which
# TFX writes for pipeline spec 2.1.0 (pipelines/kubeflow.py compiles with it).
JOB_SCHEMA_VERSION = "2.1.0"
EXECUTOR_PLACEHOLDER = "{{$}}"
# The component whose task charges the ledger (one grant per job).
CHARGING_EXECUTOR = "sage_tfx.components.block_ledger.executor.Executor"
LOG_TAIL_LINES = 30


class JobRefused(ValueError):
    """The job cannot be run as given; no task was started."""


@dataclasses.dataclass
class TaskRun:
    name: str
    seconds: float
    returncode: int
    log: str                      # the task's stdout and stderr
    charges: bool                 # the task is the job's BlockLedger (it charges the ledger)
    outputs: dict = dataclasses.field(default_factory=dict)  # output key -> RuntimeArtifact JSON


@dataclasses.dataclass
class LocalRun:
    run_id: str
    run_root: str
    tasks: list[TaskRun]

    @property
    def charged(self) -> bool:
        """Whether a task that charges the ledger completed."""
        return any(task.charges and task.returncode == 0 for task in self.tasks)


class JobFailed(RuntimeError):
    """A task exited non-zero; the tasks after it did not run."""

    def __init__(self, run: LocalRun):
        failed = run.tasks[-1]
        self.run = run
        super().__init__(f"task {failed.name} failed (exit {failed.returncode}); "
                         + ("the ledger was charged by an earlier task: that budget is spent"
                            if run.charged else "nothing was charged (the job's BlockLedger task "
                                               "had not run)"))


def _dependencies(task: Mapping) -> set[str]:
    producers = {spec["taskOutputArtifact"]["producerTask"]
                 for spec in task.get("inputs", {}).get("artifacts", {}).values()
                 if "taskOutputArtifact" in spec}
    return set(task.get("dependentTasks", [])) | producers


def task_order(tasks: Mapping[str, Mapping]) -> list[str]:
    """The tasks in an order where each comes after every task it depends on (ties by name, so
    a job always runs in the same order); JobRefused for a cycle or an unknown task."""
    needs = {name: _dependencies(task) for name, task in tasks.items()}
    for name, dependencies in needs.items():
        unknown = dependencies - set(tasks)
        if unknown:
            raise JobRefused(f"task {name} depends on unknown task(s) {sorted(unknown)}")
    order: list[str] = []
    while len(order) < len(tasks):
        ready = sorted(name for name in tasks if name not in order and needs[name] <= set(order))
        if not ready:
            raise JobRefused("the tasks' dependencies form a cycle: "
                             f"{sorted(set(tasks) - set(order))}")
        order.append(ready[0])
    return order


def _parameter_values(name: str, task: Mapping) -> dict:
    values = {}
    for key, spec in task.get("inputs", {}).get("parameters", {}).items():
        runtime = spec.get("runtimeValue", {})
        if "constant" not in runtime:
            raise JobRefused(f"task {name}'s parameter {key} is {json.dumps(spec)}: only "
                             "constants (runtimeValue.constant) are supported")
        values[key] = runtime["constant"]
    return values


def _executor_input(name: str, task: Mapping, component: Mapping, run_root: str,
                    scratch: str, produced: Mapping[tuple[str, str], Optional[dict]]) -> dict:
    """What Kubeflow's driver and launcher hand the task's container as `{{$}}`."""
    artifacts = {}
    definitions = component.get("inputDefinitions", {}).get("artifacts", {})
    for key, spec in task.get("inputs", {}).get("artifacts", {}).items():
        if "taskOutputArtifact" not in spec:
            raise JobRefused(f"task {name}'s input artifact {key} is {json.dumps(spec)}: only "
                             "other tasks' outputs are supported")
        source = spec["taskOutputArtifact"]
        resolved = produced[source["producerTask"], source["outputArtifactKey"]]
        if resolved is None:  # a resolver's output: nothing resolved
            artifacts[key] = {"artifacts": []}
            continue
        artifact = dict(resolved)
        artifact["type"] = definitions[key]["artifactType"]
        artifacts[key] = {"artifacts": [artifact]}
    outputs = {}
    for key, definition in component.get("outputDefinitions", {}).get("artifacts", {}).items():
        outputs[key] = {"artifacts": [{
            # A name for the artifact, as the launcher gives each the MLMD name it registers.
            "name": f"{os.path.basename(run_root)}/{name}/{key}",
            "type": definition["artifactType"], "uri": f"{run_root}/{name}/{key}",
            "metadata": definition.get("metadata", {})}]}
    if component.get("outputDefinitions", {}).get("parameters"):
        raise JobRefused(f"task {name} has output parameters, which TFX components do not have")
    return {"inputs": {"parameterValues": _parameter_values(name, task), "artifacts": artifacts},
            "outputs": {"artifacts": outputs,
                        "outputFile": os.path.join(scratch, "output_metadata.json")}}


def _command(name: str, container: Mapping, executor_input: dict) -> list[str]:
    filled = json.dumps(executor_input)
    command = list(container.get("command", [])) + list(container.get("args", []))
    for part in command:
        if "{{$" in part and part != EXECUTOR_PLACEHOLDER:
            raise JobRefused(f"task {name}'s container argument {part!r} holds a placeholder "
                             f"other than {EXECUTOR_PLACEHOLDER}, which TFX does not write")
    return [filled if part == EXECUTOR_PLACEHOLDER else part for part in command]


def _task_environment() -> dict:
    """This environment as the image's: its `python` first on PATH, the Dockerfile's ENV."""
    environment = dict(os.environ)
    environment["PATH"] = os.path.dirname(sys.executable) + os.pathsep + environment.get("PATH", "")
    environment.update(TF_USE_LEGACY_KERAS="1", PYTHONUNBUFFERED="1")
    return environment


def run_local(job: Mapping, pipeline_root: str, report: Callable[[str], None] = print,
              run_id: Optional[str] = None) -> LocalRun:
    """Run every task of the PipelineJob `job` (the JSON `sage-tfx compile --kubeflow` wrote);
    JobRefused before any task starts if the job cannot run here, JobFailed when a task fails."""
    spec = job.get("pipelineSpec", {})
    if spec.get("schemaVersion") != JOB_SCHEMA_VERSION:
        raise JobRefused(f"the job is pipeline spec {spec.get('schemaVersion')!r}; Kubeflow "
                         f"Pipelines 2 runs {JOB_SCHEMA_VERSION} (parameters as "
                         "runtimeValue.constant): compile it again with `sage-tfx compile "
                         "--kubeflow`")
    tasks = spec["root"]["dag"]["tasks"]
    order = task_order(tasks)
    executors = spec["deploymentSpec"]["executors"]
    plans = {}
    for name in order:  # every refusal before the first task starts
        component = spec["components"][tasks[name]["componentRef"]["name"]]
        executor = executors[component["executorLabel"]]
        if "container" not in executor and "resolver" not in executor:
            raise JobRefused(f"task {name}'s executor is {sorted(executor)}: only containers "
                             "and resolvers are supported")
        plans[name] = (component, executor.get("container"))
        _parameter_values(name, tasks[name])
    run_id = run_id or (dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S-")
                        + uuid.uuid4().hex[:8])
    name = spec["pipelineInfo"]["name"]
    run_root = f"{pipeline_root.rstrip('/')}/{name}/{run_id}"
    os.makedirs(run_root)
    run = LocalRun(run_id, run_root, [])
    os.makedirs(os.path.join(run_root, ".local"))
    environment = _task_environment()
    commands = [_command(task_name, container, {}) for task_name, (_, container) in plans.items()
                if container is not None]
    report(f"run {run_id} of {name}: {len(order)} tasks, artifacts under {run_root}")
    started = time.monotonic()
    with TaskProcesses(commands, environment, os.path.join(run_root, ".local")) as processes:
        report(f"  each task starts a fresh interpreter: {processes.why_cold}"
               if processes.why_cold else
               f"  task launcher: imported the tasks' entrypoint and executors in "
               f"{time.monotonic() - started:.1f} s")
        _run_tasks(run, order, tasks, plans, processes, report)
    return run


def _run_tasks(run: LocalRun, order: list[str], tasks: Mapping, plans: Mapping,
               processes: TaskProcesses, report: Callable[[str], None]) -> None:
    produced: dict[tuple[str, str], Optional[dict]] = {}
    for task_name in order:
        component, container = plans[task_name]
        if container is None:  # a resolver (module docstring)
            produced.update({(task_name, key): None for key in
                             component.get("outputDefinitions", {}).get("artifacts", {})})
            report(f"  {task_name}: resolved nothing (run-local writes no ML Metadata for a "
                   "resolver to query)")
            continue
        scratch = os.path.join(run.run_root, ".local", task_name)
        os.makedirs(scratch)
        executor_input = _executor_input(task_name, tasks[task_name], component, run.run_root,
                                         scratch, produced)
        command = _command(task_name, container, executor_input)
        log_path = os.path.join(scratch, "log.txt")
        started = time.monotonic()
        returncode = processes.run(command, scratch, log_path)
        with open(log_path, errors="replace") as handle:
            log = handle.read()
        task = TaskRun(task_name, time.monotonic() - started, returncode, log,
                       CHARGING_EXECUTOR in command)
        run.tasks.append(task)
        if returncode != 0:
            tail = "\n".join(log.splitlines()[-LOG_TAIL_LINES:])
            report(f"  {task_name}: FAILED (exit {returncode}) after "
                   f"{task.seconds:.1f} s; the end of its log ({log_path}):\n{tail}")
            raise JobFailed(run)
        task.outputs = _read_outputs(executor_input)
        produced.update({(task_name, key): artifact for key, artifact in task.outputs.items()})
        report(f"  {task_name}: done in {task.seconds:.1f} s")


def _read_outputs(executor_input: dict) -> dict[str, dict]:
    """Each output artifact as the launcher publishes it: what the executor wrote in its output
    metadata file (uri, metadata: TFX's properties and custom properties), else what it got."""
    given = {key: value["artifacts"][0]
             for key, value in executor_input["outputs"]["artifacts"].items()}
    path = executor_input["outputs"]["outputFile"]
    written = {}
    if os.path.exists(path):
        with open(path) as handle:
            written = json.load(handle).get("artifacts", {})
    outputs = {}
    for key, artifact in given.items():
        reported = (written.get(key, {}).get("artifacts") or [{}])[0]
        outputs[key] = {"name": artifact["name"], "uri": reported.get("uri") or artifact["uri"],
                        "metadata": reported.get("metadata", artifact.get("metadata", {}))}
    return outputs
