"""DPTuner's search in a process of its own: everything whose state depends on the secret
number of trials K stays there.

Why: every eager op advances TensorFlow's process-wide uid counter (ops.uid), and a SavedModel
written later in the same process numbers its functions from it (`__inference_..._<uid>`): a
search run in the executor's process would leave K in DPTrainer's saved_model.pb under
LocalDagRunner (all components in one process). Other per-process state (allocator, caches,
Keras name counters) could carry K the same way. So the executor starts a fresh interpreter
(`python -c`, not multiprocessing's spawn, which re-runs the parent's `__main__` script in the
child: a pipeline script without a main guard would run again), sends it only public inputs
(paths, DPTuner's parameters, the plan, the test seed) and gets back only the release: the
best candidate's settings and its DP score, whose pickle has the same length for every K.

Nothing of the child's reaches the parent's log: its stdout and stderr (Python's and the C++
runtime's) go to /dev/null from its start, and the result comes back on a pipe of its own.
A failure comes back as its exception's type and message (what an in-process search raised
too; the silencing there never hid an exception), or as the exit status if the child died;
the parent raises SearchFailed, after the charge a failure like any other: the grant records
the step failed and its share spent.

The parent's state after `run_search` is the same for every K: it starts one process, writes
one payload, reads one result of fixed size and waits (its duration grows with K: the timing
channel docs/privacy-guarantee.md leaves open for every release)."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from sage_tfx.components.dp_tuner import tuning


class SearchFailed(RuntimeError):
    """The search's process raised or died; nothing was released."""


@dataclass(frozen=True)
class SearchTask:
    """What the search's process needs, all public: the module and DPTuner's parameters
    (`given`, as executor.load reads them), the Examples and TFTransform graph paths, the plan
    made in the parent (the grant checked its event) and the test seed."""
    module_file: str
    given: Mapping[str, Any]
    examples_uri: str
    transform_graph_uri: Optional[str]
    plan: tuning.SearchPlan
    seed: Optional[int]


def run_search(task: SearchTask) -> tuning.Best:
    """The search of `task` in a fresh interpreter; its best setting and DP score."""
    results, child_end = os.pipe()
    env = {**os.environ,
           # The child imports sage_tfx (and the user's module's imports) as this process does.
           "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", "from sage_tfx.components.dp_tuner.search_process import "
             f"child_main; child_main({child_end})"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(child_end,), env=env, close_fds=True)
    except BaseException:
        os.close(results)
        raise
    finally:
        os.close(child_end)
    try:
        with os.fdopen(results, "rb") as reply:
            try:
                child.stdin.write(pickle.dumps(task))
                child.stdin.close()
            except BrokenPipeError:
                pass  # the child died before reading: its status says so below
            answer = reply.read()
        status = child.wait()
    except BaseException:  # interrupted: no search outlives its executor
        child.kill()
        child.wait()
        raise
    if not answer:
        raise SearchFailed(f"DPTuner's search process ended with status {status} and no "
                           "result; nothing was released")
    outcome, *values = pickle.loads(answer)
    if outcome == "error":
        kind, message = values
        raise SearchFailed(f"DPTuner's search failed: {kind}: {message}; nothing was released")
    settings, score = values
    return tuning.Best(settings, score)


def search_records(task: SearchTask) -> tuning.Best:
    """The search on the task's Examples' train split, decoded as DPTrainer decodes them (the
    child's work; the parent checked the module on public stand-ins before the child started)."""
    from sage_tfx.components.dp_tuner.executor import load
    from sage_tfx.components.util.examples_io import TRAIN_SPLIT, read_split
    from sage_tfx.components.util.user_module import RecordDecoder, declared_inputs

    transform_output = None
    if task.transform_graph_uri is not None:
        import tensorflow_transform as tft
        transform_output = tft.TFTransformOutput(task.transform_graph_uri)
    module, candidates, _ = load(task.module_file, task.given, transform_output is not None)
    decoder = RecordDecoder(module, transform_output,
                            None if module.model_inputs is not None
                            else declared_inputs(module.build_model()))
    inputs, labels = decoder.decode(list(read_split(task.examples_uri, TRAIN_SPLIT).numpy()))
    best, _ = tuning.search(module, inputs, labels, candidates, task.plan, task.seed)
    return best


def child_main(results_fd: int) -> None:
    """The search's process: reads the SearchTask on stdin, writes ("ok", settings, score) or
    ("error", type, message) on `results_fd`. Its stdout and stderr are /dev/null already."""
    with os.fdopen(results_fd, "wb") as results:
        try:
            best = search_records(pickle.load(sys.stdin.buffer))
            # Floats only: the pickle's length does not depend on the values' history.
            answer = ("ok", {name: float(value) for name, value in best.settings.items()},
                      float(best.score))
        except BaseException as error:  # noqa: BLE001: reported to the parent, which raises
            answer = ("error", type(error).__name__, str(error))
        results.write(pickle.dumps(answer))
