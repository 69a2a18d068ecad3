"""TFX's own Chicago taxi template, converted by a diff: where the installed files are, and the
module with `taxi_utils_native_keras.diff` applied.

The template (`taxi_pipeline_native_keras.py`, `taxi_utils_native_keras.py`, its data and
schema) ships inside the tfx package and is never copied into this repository: the diff is
what a user reads (docs/tfx-pipeline.md), and `write_module` applies it to the installed
module at run time. A hunk whose context does not match the installed file (another tfx
release) is refused, naming the hunk, rather than applied somewhere else.
"""
from __future__ import annotations

import os
import re

DIFF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "taxi_utils_native_keras.diff")
MODULE_NAME = "taxi_utils_native_keras.py"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def template_dir() -> str:
    """tfx/examples/chicago_taxi_pipeline in the installed tfx."""
    import tfx

    path = os.path.join(os.path.dirname(tfx.__file__), "examples", "chicago_taxi_pipeline")
    if not os.path.isfile(os.path.join(path, MODULE_NAME)):
        raise FileNotFoundError(f"TFX's taxi template is not in the installed tfx ({path})")
    return path


def data_root() -> str:
    """The directory of the template's data.csv (15,002 trips; CsvExampleGen's input_base)."""
    return os.path.join(template_dir(), "data", "simple")


def schema_file() -> str:
    """The template's user-provided schema (what ImportSchemaGen would read)."""
    return os.path.join(template_dir(), "data", "user_provided_schema", "schema.pbtxt")


def apply_diff(original: str, diff: str) -> str:
    """`original` with the unified diff `diff` applied; ValueError naming the first hunk whose
    context or removed lines differ from `original`."""
    source = original.splitlines(keepends=True)
    result, position = [], 0
    lines = diff.splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith("@@"))
    while index < len(lines):
        header = _HUNK.match(lines[index])
        if header is None:
            raise ValueError(f"diff line {index + 1} is not a hunk header: {lines[index]!r}")
        start = int(header.group(1)) - 1
        result.extend(source[position:start])
        position = start
        index += 1
        while index < len(lines) and not lines[index].startswith("@@"):
            kind, text = lines[index][:1], lines[index][1:]
            if kind in (" ", "-"):
                if position >= len(source) or source[position] != text:
                    raise ValueError(f"the installed {MODULE_NAME} differs from the diff's "
                                     f"hunk {header.group(0)} at its line {position + 1}: "
                                     "is this the tfx release the diff was made for?")
                position += 1
            if kind in (" ", "+"):
                result.append(text)
            index += 1
    return "".join(result + source[position:])


def changed_lines(diff: str | None = None) -> int:
    """The lines the diff removes or adds (the guide's count)."""
    if diff is None:
        with open(DIFF) as handle:
            diff = handle.read()
    return sum(1 for line in diff.splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def converted_source() -> str:
    """The installed template module with the diff applied."""
    with open(os.path.join(template_dir(), MODULE_NAME)) as handle:
        original = handle.read()
    with open(DIFF) as handle:
        return apply_diff(original, handle.read())


def write_module(directory: str) -> str:
    """The converted module, written as `directory/taxi_utils_native_keras.py`; its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MODULE_NAME)
    with open(path, "w") as handle:
        handle.write(converted_source())
    return path
