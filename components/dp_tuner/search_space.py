"""DPTuner's search space: the candidate settings a module's `tuner_fn` describes, and TFX's
`best_hyperparameters` file.

What `tuner_fn(fn_args)` may return (called once, before the charge, with a public FnArgs: no
data paths, `custom_config` only; it describes a space, it never reads data):
* a list of candidate settings, each a dict {name: value};
* a dict {name: [values]}: every combination (the grid, in the order the names are given);
* TFX's TunerFnResult (`.tuner`, `.fit_kwargs`) whose KerasTuner tuner holds the space in
  `tuner.oracle.hyperparameters`: its Choice, Fixed and Boolean hyperparameters, and Int with a
  step, become the grid. A continuous Float (or Int without a step) has no finite grid, which
  the selection needs (it draws a candidate uniformly): refused, naming it. keras-tuner is not
  installed on the platform (STACK.md); the space is read through `get_config()`, so an object
  that quacks like it works, and nothing here imports keras_tuner.

The names are DP-SGD's public settings that do not change a trial's privacy event:
`learning_rate` and `l2_norm_clip` (the noise is sigma * C, so the clip norm scales signal and
noise together). Epochs, batch size and the noise multiplier set the event, which every trial
must share (Papernot-Steinke's trial Q is one mechanism): they are DPTuner's parameters, not
candidates. Any other name is refused before the charge.

The file is what TFX's Tuner writes (tfx/components/tuner/executor.py,
write_best_hyperparameters): `best_hyperparameters.txt`, the JSON of KerasTuner's
HyperParameters.get_config(), {"space": [...], "values": {name: best value}}. The space is the
user's (public); the values are the selected candidate's. TFX's Trainer passes the JSON as
fn_args.hyperparameters; DPTrainer reads `values` (`read_best_hyperparameters`).
"""
from __future__ import annotations

import itertools
import json
import math
import os
from typing import Any, Mapping, Sequence

from sage_tfx.components.dp_trainer.parameters import TUNABLE
from sage_tfx.sage_access.errors import BadRequest

BEST_HYPERPARAMETERS_FILE = "best_hyperparameters.txt"  # TFX's Tuner's name
MAX_CANDIDATES = 10_000
DEFAULT_TUNER_FN = "tuner_fn"


def candidates_from(result: Any) -> list[dict[str, float]]:
    """The candidate settings `tuner_fn` returned (module docstring), checked: BadRequest for
    an empty space, an unknown name or a value that is not a positive finite number."""
    if hasattr(result, "tuner"):
        result = _keras_tuner_grid(result.tuner)
    if isinstance(result, Mapping):
        names = list(result)
        for name in names:
            if not isinstance(result[name], (list, tuple)):
                raise BadRequest(f"tuner_fn's space gives {name!r} {result[name]!r}; give a list "
                                 "of values")
        result = [dict(zip(names, values))
                  for values in itertools.product(*(result[name] for name in names))]
    if not isinstance(result, (list, tuple)) or not all(isinstance(c, Mapping) for c in result):
        raise BadRequest("tuner_fn must return a list of candidate settings (dicts), a dict "
                         "{name: [values]}, or a TunerFnResult; got "
                         f"{type(result).__name__}")
    if not result:
        raise BadRequest("tuner_fn returned no candidate setting: nothing to tune")
    if len(result) > MAX_CANDIDATES:
        raise BadRequest(f"tuner_fn returned {len(result)} candidates; at most {MAX_CANDIDATES}")
    return [_checked(candidate) for candidate in result]


def _checked(candidate: Mapping) -> dict[str, float]:
    unknown = sorted(set(candidate) - set(TUNABLE))
    if unknown:
        raise BadRequest(f"unknown hyperparameter name(s) {unknown}: DPTuner tunes {list(TUNABLE)} "
                         "(epochs, batch size and noise set every trial's privacy event: they "
                         "are DPTuner's parameters)")
    checked = {}
    for name, value in candidate.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not (math.isfinite(value) and value > 0):
            raise BadRequest(f"hyperparameter {name!r} must be a positive number, got {value!r}")
        checked[name] = float(value)
    return checked


def _keras_tuner_grid(tuner: Any) -> dict[str, list]:
    """{name: values} of a KerasTuner tuner's space (module docstring), via get_config()."""
    grid = {}
    for hyperparameter in tuner.oracle.hyperparameters.space:
        kind, config = type(hyperparameter).__name__, hyperparameter.get_config()
        name = config["name"]
        if kind == "Choice":
            grid[name] = list(config["values"])
        elif kind == "Fixed":
            grid[name] = [config["value"]]
        elif kind == "Int" and config.get("step"):
            grid[name] = list(range(config["min_value"], config["max_value"] + 1, config["step"]))
        else:
            raise BadRequest(f"KerasTuner hyperparameter {name!r} ({kind}) has no finite set of "
                             "values; private selection draws among finitely many candidates: "
                             "use Choice (or Int with a step)")
    return grid


def load_candidates(module_file: str, tuner_fn: str, custom_config: Mapping | None = None
                    ) -> list[dict[str, float]]:
    """Import `module_file`, call its `tuner_fn` with a public FnArgs (no data), and check what it
    returns. BadRequest naming the cause (a module that does not import, lacks the function or
    raises in it): this runs before the charge."""
    from tfx.components.trainer.fn_args_utils import FnArgs

    from sage_tfx.components.util.user_module import import_module_file

    try:
        module = import_module_file(module_file)
    except Exception as error:  # the user's module raised while it was imported
        raise BadRequest(f"module file {module_file!r} does not import: "
                         f"{type(error).__name__}: {error}") from error
    function = getattr(module, tuner_fn, None)
    if not callable(function):
        raise BadRequest(f"module file {module_file!r} defines no function {tuner_fn!r}")
    try:
        result = function(FnArgs(custom_config=dict(custom_config or {})))
    except Exception as error:
        raise BadRequest(f"{tuner_fn} in {module_file!r} raised {type(error).__name__}: "
                         f"{error}") from error
    return candidates_from(result)


def space_config(candidates: Sequence[Mapping[str, float]]) -> list[dict]:
    """KerasTuner's `space` for the candidates: one Choice per name, its values in first-seen
    order (public: the user's space)."""
    names = [name for name in TUNABLE if any(name in c for c in candidates)]
    space = []
    for name in names:
        values = list(dict.fromkeys(c[name] for c in candidates if name in c))
        space.append({"class_name": "Choice",
                      "config": {"name": name, "default": values[0], "conditions": [],
                                 "values": values, "ordered": True}})
    return space


def write_best_hyperparameters(directory: str, candidates: Sequence[Mapping[str, float]],
                               best: Mapping[str, float]) -> str:
    """Write TFX's best_hyperparameters.txt (module docstring); returns its path."""
    from tfx.utils import io_utils

    path = os.path.join(directory, BEST_HYPERPARAMETERS_FILE)
    io_utils.write_string_file(path, json.dumps({"space": space_config(candidates),
                                                 "values": dict(best)}))
    return path


def read_best_hyperparameters(directory: str) -> dict[str, float]:
    """The `values` of the one file in a HyperParameters artifact's directory (as TFX's Trainer
    finds it: io_utils.get_only_uri_in_dir), checked like candidates."""
    from tfx.dsl.io import fileio
    from tfx.utils import io_utils

    with fileio.open(io_utils.get_only_uri_in_dir(directory)) as handle:
        config = json.loads(handle.read())
    if not isinstance(config, Mapping) or not isinstance(config.get("values"), Mapping):
        raise BadRequest(f"the hyperparameters at {directory} hold no KerasTuner config "
                         "{'space': ..., 'values': {...}}")
    return _checked(config["values"])
