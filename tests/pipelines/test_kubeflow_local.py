"""`sage-tfx kubeflow run-local` on small jobs whose tasks are plain Python: the order, the
executor input Kubeflow fills in, artifacts passed through the pipeline root, a failing task
stopping the job, and jobs refused before any task starts. (The taxi job: test_kubeflow_job.py.)"""
import json
import os
import sys

import pytest

from sage_tfx.pipelines.kubeflow_local import (CHARGING_EXECUTOR, JobFailed, JobRefused,
                                               run_local, task_order)

# A task: reads the executor input ({{$}}), writes each output artifact's file and the output
# metadata file; its inputs' files and metadata are copied into what it writes.
TASK = r"""
import json, os, sys
given = json.loads(sys.argv[sys.argv.index("--input") + 1])
fail = int(sys.argv[sys.argv.index("--exit") + 1])
seen = {key: {"text": open(os.path.join(a["artifacts"][0]["uri"], "data")).read(),
              "metadata": a["artifacts"][0]["metadata"]} if a["artifacts"] else None
        for key, a in given["inputs"]["artifacts"].items()}
if fail:
    sys.exit(fail)
written = {}
for key, a in given["outputs"]["artifacts"].items():
    uri = a["artifacts"][0]["uri"]
    os.makedirs(uri)
    with open(os.path.join(uri, "data"), "w") as handle:
        json.dump({"parameters": given["inputs"]["parameterValues"], "seen": seen,
                   "cwd": os.getcwd(), "keras": os.environ.get("TF_USE_LEGACY_KERAS")}, handle)
    written[key] = {"artifacts": [{"uri": uri, "metadata": {"written_by": key}}]}
with open(given["outputs"]["outputFile"], "w") as handle:
    json.dump({"artifacts": written}, handle)
"""
SCHEMA = {"instanceSchema": "title: tfx.Examples\ntype: object\n"}


def _job(tasks: dict) -> dict:
    """A PipelineJob of `tasks` {name: (inputs from {key: producer}, exit code, executor)}."""
    components, executors, dag = {}, {}, {}
    for name, (inputs, exit_code, executor) in tasks.items():
        components[name] = {
            "executorLabel": f"{name}_executor",
            "inputDefinitions": {"artifacts": {key: {"artifactType": SCHEMA} for key in inputs},
                                 "parameters": {"step": {"parameterType": "STRING"}}},
            "outputDefinitions": {"artifacts": {"out": {"artifactType": SCHEMA}}}}
        executors[f"{name}_executor"] = {"container": {
            "image": "example.com/sage-tfx:0.1.0", "command": ["python", "-c", TASK],
            "args": ["--executor_class_path", executor, "--input", "{{$}}",
                     "--exit", str(exit_code)]}}
        dag[name] = {"componentRef": {"name": name}, "taskInfo": {"name": name},
                     "dependentTasks": sorted(set(inputs.values())),
                     "inputs": {"parameters": {"step": {"runtimeValue": {"constant": name}}},
                                "artifacts": {key: {"taskOutputArtifact": {
                                    "producerTask": producer, "outputArtifactKey": "out"}}
                                    for key, producer in inputs.items()}}}
    return {"displayName": "toy", "pipelineSpec": {
        "schemaVersion": "2.1.0", "pipelineInfo": {"name": "toy"}, "components": components,
        "deploymentSpec": {"executors": executors}, "root": {"dag": {"tasks": dag}}}}


def _read(run, task):
    with open(os.path.join(run.tasks[[t.name for t in run.tasks].index(task)].outputs["out"]
                           ["uri"], "data")) as handle:
        return json.load(handle)


def test_tasks_run_in_order_each_given_what_kubeflow_gives(tmp_path):
    job = _job({"c": ({"left": "a", "right": "b"}, 0, "x.Executor"),
                "b": ({"source": "a"}, 0, "x.Executor"), "a": ({}, 0, "x.Executor")})
    run = run_local(job, str(tmp_path), report=lambda line: None, run_id="r1")
    assert [task.name for task in run.tasks] == ["a", "b", "c"]
    assert run.run_root == f"{tmp_path}/toy/r1"
    c = _read(run, "c")
    assert c["parameters"] == {"step": "c"}
    # Each input is the producer's output: its file under the run root, its written metadata.
    assert run.tasks[0].outputs["out"]["uri"] == f"{tmp_path}/toy/r1/a/out"
    assert c["seen"]["right"]["metadata"] == {"written_by": "out"}
    assert json.loads(c["seen"]["left"]["text"])["parameters"] == {"step": "a"}
    assert json.loads(c["seen"]["right"]["text"])["seen"]["source"]["metadata"] == \
        {"written_by": "out"}
    # The image's environment, in an empty directory that is not this one.
    assert c["keras"] == "1" and c["cwd"] != os.getcwd() and not run.charged


def test_a_failing_task_stops_the_job(tmp_path):
    job = _job({"ingest": ({}, 0, "x.Executor"),
                "grant": ({"blocks": "ingest"}, 3, CHARGING_EXECUTOR),
                "train": ({"examples": "grant"}, 0, "x.Executor")})
    lines = []
    with pytest.raises(JobFailed, match="task grant failed \\(exit 3\\); nothing was charged"):
        run_local(job, str(tmp_path), report=lines.append, run_id="r1")
    assert not os.path.exists(tmp_path / "toy" / "r1" / "train")
    assert any("grant: FAILED (exit 3)" in line for line in lines)
    job = _job({"grant": ({}, 0, CHARGING_EXECUTOR), "train": ({"examples": "grant"}, 4,
                                                              "x.Executor")})
    with pytest.raises(JobFailed, match="after|spent") as failed:
        run_local(job, str(tmp_path), report=lambda line: None, run_id="r2")
    assert failed.value.run.charged


def test_jobs_that_cannot_run_are_refused_before_any_task(tmp_path):
    job = _job({"a": ({}, 0, "x.Executor")})
    old = json.loads(json.dumps(job))
    old["pipelineSpec"]["schemaVersion"] = "2.0.0"
    with pytest.raises(JobRefused, match="runtimeValue.constant"):
        run_local(old, str(tmp_path))
    runtime = json.loads(json.dumps(job))
    runtime["pipelineSpec"]["root"]["dag"]["tasks"]["a"]["inputs"]["parameters"]["step"] = {
        "componentInputParameter": "step"}
    with pytest.raises(JobRefused, match="only constants"):
        run_local(runtime, str(tmp_path))
    cycle = _job({"a": ({"x": "b"}, 0, "x.Executor"), "b": ({"y": "a"}, 0, "x.Executor")})
    with pytest.raises(JobRefused, match="cycle"):
        run_local(cycle, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_resolver_task_resolves_nothing_and_its_consumer_runs_with_an_empty_input(tmp_path):
    """TFX's Resolver (the template's latest blessed model) compiles to a task with a
    `resolver` executor, no container: it failed the job before any task ran (KeyError
    'container'). A cluster's driver resolves it from the launcher's ML Metadata records, which
    run-local does not write: nothing, as on a cluster's first run."""
    job = _job({"a": ({}, 0, "x.Executor"), "c": ({"baseline": "r", "source": "a"}, 0,
                                                  "x.Executor")})
    spec = job["pipelineSpec"]
    spec["components"]["r"] = {"executorLabel": "r_executor", "outputDefinitions": {
        "artifacts": {"out": {"artifactType": SCHEMA}}}}
    spec["deploymentSpec"]["executors"]["r_executor"] = {"resolver": {"outputArtifactQueries": {
        "out": {"filter": 'schema_title="tfx.Model" AND state=LIVE'}}}}
    spec["root"]["dag"]["tasks"]["r"] = {"componentRef": {"name": "r"},
                                         "taskInfo": {"name": "r"}}
    lines = []
    run = run_local(job, str(tmp_path), report=lines.append, run_id="r1")
    assert [task.name for task in run.tasks] == ["a", "c"]  # no process for the resolver
    seen = _read(run, "c")["seen"]
    assert seen["baseline"] is None and seen["source"]["metadata"] == {"written_by": "out"}
    assert "  r: resolved nothing (run-local writes no ML Metadata for a resolver to query)" \
        in lines


def test_task_order_is_topological_and_repeatable():
    tasks = {"z": {"dependentTasks": []}, "y": {"dependentTasks": ["z"]},
             "a": {"dependentTasks": ["y"]}, "b": {"dependentTasks": []}}
    assert task_order(tasks) == ["b", "z", "y", "a"]
    with pytest.raises(JobRefused, match="unknown task"):
        task_order({"a": {"dependentTasks": ["nope"]}})


def test_the_cli_exit_codes(tmp_path):
    import subprocess
    path = tmp_path / "job.json"
    path.write_text(json.dumps(_job({"grant": ({}, 0, CHARGING_EXECUTOR),
                                     "train": ({"examples": "grant"}, 5, "x.Executor")})))
    completed = subprocess.run([sys.executable, "-m", "sage_tfx.cli", "kubeflow", "run-local",
                                str(path), "--pipeline-root", str(tmp_path / "root")],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 7, completed.stderr
    assert "task train failed (exit 5); the ledger was charged" in completed.stderr
    path.write_text("{}")
    completed = subprocess.run([sys.executable, "-m", "sage_tfx.cli", "kubeflow", "run-local",
                                str(path), "--pipeline-root", str(tmp_path / "root")],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2 and "no task started" in completed.stderr


def _entrypoint_job(tmp_path, tasks: dict) -> dict:
    """A job of `tasks` {name: extra arguments}, independent of each other, each running
    `python -m support.task_entrypoint` (as TFX's tasks run `python -m` its entrypoint)."""
    job = _job({name: ({}, 0, "x.Executor") for name in tasks})
    executors = job["pipelineSpec"]["deploymentSpec"]["executors"]
    for name, extra in tasks.items():
        executors[f"{name}_executor"]["container"].update(
            command=["python", "-m", "support.task_entrypoint"],
            args=["--out", str(tmp_path / f"{name}.json"), *extra])
    return job


def test_tasks_are_forked_processes_of_one_launcher_that_imported_their_imports(tmp_path,
                                                                               monkeypatch):
    """Each task is its own process, started as `python -m` starts it (argv, sys.path, cwd,
    stdin closed, `__main__`), forked from one launcher per job that imported the
    entrypoint's imports once (pipelines/task_processes.py): a task no longer pays for
    starting TensorFlow and TFX."""
    from support import REPO_ROOT
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [os.path.join(REPO_ROOT, "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    run = run_local(_entrypoint_job(tmp_path, {"a": ["--exit", "0"], "b": ["--exit", "0"]}),
                    str(tmp_path / "root"), report=lambda line: None, run_id="r1")
    seen = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in "ab"}
    assert seen["a"]["pid"] != seen["b"]["pid"] and os.getpid() not in \
        {seen["a"]["parent"], seen["a"]["pid"]}
    assert seen["a"]["parent"] == seen["b"]["parent"]  # the launcher
    for name, task in seen.items():
        assert task["preloaded"] and task["name"] == "__main__"
        assert task["argv0"].endswith(os.path.join("support", "task_entrypoint.py"))
        assert task["cwd"] == task["path0"] == str(tmp_path / "root" / "toy" / "r1" / ".local"
                                                   / name)
        assert task["stdin"] == ""
    assert [task.log for task in run.tasks] == ["task output on stdout\n"] * 2
    # Exit codes and deaths are the task's, as from a fresh process.
    with pytest.raises(JobFailed, match="task a failed \\(exit 3\\)"):
        run_local(_entrypoint_job(tmp_path, {"a": ["--exit", "3"]}), str(tmp_path / "root"),
                  report=lambda line: None, run_id="r2")
    with pytest.raises(JobFailed, match="task a failed \\(exit -9\\)"):
        run_local(_entrypoint_job(tmp_path, {"a": ["--exit", "0", "--kill"]}),
                  str(tmp_path / "root"), report=lambda line: None, run_id="r3")
