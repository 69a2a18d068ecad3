"""A container entrypoint for run-local's tests (`python -m support.task_entrypoint --exit N
--out FILE`): writes what its process saw at start (before its own imports ran) to FILE, then
exits N; --kill kills its process instead."""
import sys

# Before this module's imports below: whether the launcher had imported them already.
PRELOADED = "support.task_dependency" in sys.modules

import json  # noqa: E402
import os  # noqa: E402

import support.task_dependency  # noqa: E402,F401

arguments = sys.argv[1:]
if "--kill" in arguments:
    os.kill(os.getpid(), 9)
with open(arguments[arguments.index("--out") + 1], "w") as handle:
    json.dump({"pid": os.getpid(), "parent": os.getppid(), "preloaded": PRELOADED,
               "argv0": sys.argv[0], "path0": sys.path[0], "cwd": os.getcwd(),
               "stdin": sys.stdin.read(), "name": __name__}, handle)
print("task output on stdout")
sys.exit(int(arguments[arguments.index("--exit") + 1]))
