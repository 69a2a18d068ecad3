"""Start a compiled job's task processes from one warm interpreter (`sage-tfx kubeflow
run-local`, pipelines/kubeflow_local.py).

Each task of a taxi job is `python -m tfx.orchestration.kubeflow.v2.container.
kubeflow_v2_run_executor ...`, and most of a task's time was its process importing TensorFlow,
Beam and TFX (about 7 CPU-seconds of each task's 10-15). `TaskProcesses` starts one launcher
process per job that imports the job's entrypoint modules' imports and its executors' modules
once, then forks one child per task. The child is still the task's own process, as on a
cluster: it runs the container command's module as `__main__` (as `python -m` does; `-c` code
likewise) with the command's arguments, in the task's directory, its stdout and stderr in the
task's log, stdin closed; its exit status is the task's. Nothing the tasks compute passes
through the launcher: it forks before any task runs, so each child starts from the state the
imports left, the state a fresh process reaches after importing the same modules (imports do
not depend on the task: no task's arguments, directory or data are seen before the fork).
Forking after the imports is safe here: the launcher then runs its main Python thread only
(checked with the taxi job's modules: the other threads are native, e.g. jemalloc's background
thread, idle at the fork), and tests/pipelines/test_kubeflow_job.py runs the taxi jobs this way
(Beam, TF Transform, Keras DP-SGD, the ledger over gRPC, each in a forked task).

A command that is not this interpreter's `python -m MODULE` or `python -c CODE` runs as a fresh
process (subprocess), as does every task when the launcher could not start; a launcher that dies
while a task runs fails that task (it is not run again: it may have charged the ledger).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import runpy
import shutil
import subprocess
import sys
import traceback
import types
from typing import Iterable, Mapping, Optional

__all__ = ["TaskProcesses"]

# The option of TFX's Kubeflow V2 entrypoint that names the task's executor class.
EXECUTOR_CLASS_OPTION = "--executor_class_path"


def _warm_argv(command: list[str], environment: Mapping[str, str]) -> Optional[list[str]]:
    """The interpreter arguments (["-m", MODULE, ...] or ["-c", CODE, ...]) when `command` runs
    this interpreter (`python` first on the task's PATH is sys.executable), else None."""
    if len(command) < 3 or command[1] not in ("-m", "-c"):
        return None
    # The same directory, not only the same binary: a virtual environment is its bin directory.
    program = shutil.which(command[0], path=environment.get("PATH"))
    if program is None or not os.path.samefile(os.path.dirname(os.path.abspath(program)),
                                               os.path.dirname(sys.executable)):
        return None
    return command[1:]


def _preload(argv_of_tasks: Iterable[list[str]]) -> list[str]:
    """The modules a launcher imports before forking: what each `-m` entrypoint imports at its
    top level (not the entrypoint itself: it runs as `__main__` in the child, as `python -m`
    runs it) and the module of the executor class it is given (TFX's option); none for `-c`."""
    modules: list[str] = []
    for argv in argv_of_tasks:
        if argv[0] == "-m":
            spec = importlib.util.find_spec(argv[1])
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                with open(spec.origin) as handle:
                    tree = ast.parse(handle.read())
                for node in tree.body:
                    if isinstance(node, ast.Import):
                        modules += [alias.name for alias in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        modules.append(node.module)
        if argv[0] == "-m" and EXECUTOR_CLASS_OPTION in argv[:-1]:
            modules.append(argv[argv.index(EXECUTOR_CLASS_OPTION) + 1].rpartition(".")[0])
    return list(dict.fromkeys(module for module in modules if module))


class TaskProcesses:
    """Runs tasks' commands, each in its own process (module docstring); a context manager."""

    def __init__(self, commands: Iterable[list[str]], environment: Mapping[str, str],
                 directory: str):
        """Start the launcher for the warm-startable `commands` (the job's), if any, with the
        tasks' `environment`, in `directory` (its log: directory/launcher.log)."""
        self._environment = dict(environment)
        warm = [argv for argv in (_warm_argv(list(c), environment) for c in commands) if argv]
        self._launcher: Optional[subprocess.Popen] = None
        self.why_cold = "" if warm else "no task runs this interpreter's python -m/-c"
        if not warm:
            return
        with open(os.path.join(directory, "launcher.log"), "w") as log:
            self._launcher = subprocess.Popen(
                [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, env=self._environment, cwd=directory, text=True)
        self._launcher.stdin.write(json.dumps(warm) + "\n")
        self._launcher.stdin.flush()
        if self._launcher.stdout.readline().strip() != "ready":
            self.close()
            self.why_cold = f"the launcher did not start (its log: {directory}/launcher.log)"

    def run(self, command: list[str], cwd: str, log: str) -> int:
        """Run `command` in its own process in `cwd`, its stdout and stderr written to `log`;
        its exit status (negative: killed by that signal)."""
        argv = _warm_argv(command, self._environment)
        if self._launcher is None or argv is None:
            with open(log, "w") as handle:
                return subprocess.run(command, cwd=cwd, env=self._environment,
                                      stdin=subprocess.DEVNULL, stdout=handle,
                                      stderr=subprocess.STDOUT).returncode
        self._launcher.stdin.write(json.dumps({"argv": argv, "cwd": cwd, "log": log}) + "\n")
        self._launcher.stdin.flush()
        answer = self._launcher.stdout.readline()
        if not answer:  # the launcher died with the task: fail it (not run again)
            self.close()
            with open(log, "a") as handle:
                handle.write("\nsage-tfx run-local: the task launcher died while this task "
                             "ran\n")
            return -1
        return json.loads(answer)["returncode"]

    def close(self) -> None:
        if self._launcher is not None:
            self._launcher.stdin.close()
            self._launcher.wait()
            self._launcher.stdout.close()
            self._launcher = None

    def __enter__(self) -> "TaskProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _exit_status(code) -> int:
    """A SystemExit's code as the process's exit status (what the interpreter does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_python(argv: list[str]) -> int:
    """Run `python ARGV` here: `-m MODULE args` or `-c CODE args`, as the interpreter runs them
    (sys.argv and sys.path[0] as it sets them, the code as `__main__`)."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module sets sys.argv[0] to the module's path
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    except SystemExit as exit:
        return _exit_status(exit.code)
    except BaseException:  # noqa: B036 (the interpreter's own behaviour: traceback, status 1)
        traceback.print_exc()
        return 1
    return 0


def _child(task: Mapping, answers: int) -> None:
    """The forked task process: never returns."""
    status = 1
    try:
        os.close(answers)
        os.chdir(task["cwd"])
        log = os.open(task["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(os.devnull)
        status = _run_python(task["argv"])
    except BaseException:  # noqa: B036 (a failure to start the task is the task's failure)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 (a closed stream: nothing left to flush)
                pass
        os._exit(status)


def _launcher() -> None:
    """The launcher process: one JSON line of the tasks' interpreter arguments (it imports what
    _preload names for them), "ready", then one JSON task per line, answered with its exit
    status, until stdin closes."""
    answers = os.dup(1)
    os.dup2(2, 1)  # anything the imports print goes to the launcher's log, not the answers
    requests = sys.stdin
    for module in _preload(json.loads(requests.readline())):
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 (the task that needs it fails by itself)
            print(f"preloading {module} failed: {error!r}", file=sys.stderr)
    os.write(answers, b"ready\n")
    for line in requests:
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            _child(json.loads(line), answers)
        _, status = os.waitpid(child, 0)
        os.write(answers, (json.dumps({"returncode": os.waitstatus_to_exitcode(status)})
                           + "\n").encode())


if __name__ == "__main__":
    _launcher()
