"""What a user sees of a pipeline run by default: one compact line per outcome, nothing else.

`report(...)` prints a line on stderr (prefixed "sage-tfx:") through the `sage_tfx` logger, which
is shown at INFO without any logging setup (absl's INFO lines are hidden by default). Set
SAGE_TFX_QUIET=1 to hide them. Only public facts and DP outputs may be reported: a grant, the
epsilon spent after an epoch (public parameters), the validator's DP metric and interval; never
an exact count or a non-DP loss.

`progress(what, total)` covers a long step whose length is public (DP-SGD's steps): a live bar
(tqdm) when stderr is a terminal, otherwise a line at each quarter; silenced by SAGE_TFX_QUIET.
It shows counts of public things only (steps, epochs), never a loss or a record count.

`install()` also drops third-party warnings that say nothing to a user of this project and repeat
at every step (they are listed in NOISE with the reason).
"""
from __future__ import annotations

import logging
import math
import os
import sys
from typing import Optional, TextIO

LOGGER = logging.getLogger("sage_tfx")
# (logger, message prefix): why it is noise here.
NOISE = (
    # TFX's input resolution warns at every step that it ignores property predicates; sage-tfx's
    # pipelines use none, so the warning never describes a problem of theirs.
    ("absl", "ArtifactQuery.property_predicate is not supported"),
    ("absl", "ContextQuery.property_predicate is not supported"),
    # AutoGraph falls back to running a user function as-is, which is correct for the plain
    # tensor code module files hold; TensorFlow asks to report it upstream, not to the user.
    ("tensorflow", "AutoGraph could not transform"),
    ("absl", "AutoGraph could not transform"),
    # DPTransform runs TFT's analysis in tf.compat.v1 mode and reads instance dicts on purpose
    # (its DP analyzers are graph-mode); TFT warns about both at every stage.
    ("absl", "Tensorflow Transform is running in tf.compat.v1 mode"),
    ("absl", "You are outputting instance dicts from `TransformDataset`"),
    # TFX's publisher warns whenever an executor returns its one output artifact at a URI of its
    # own choosing (TFX's own TODO b/175426744 says its data binder does the same); the artifact
    # is published as returned, so the warning reports no problem.
    ("absl", "When there is one artifact to publish, the URI of it should be identical"),
)


class _DropNoise(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a line is written, not as it was at install(): a
    replaced stderr (a test's capture, a redirect) gets every line."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _ignored) -> None:
        pass


def install() -> None:
    """Idempotent: a stderr handler for `sage_tfx` and the noise filters."""
    if getattr(LOGGER, "_sage_tfx_installed", False):
        return
    LOGGER._sage_tfx_installed = True
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("sage-tfx: %(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.WARNING if os.environ.get("SAGE_TFX_QUIET") else logging.INFO)
    LOGGER.propagate = False  # absl's root handler would print it a second time
    for name in {logger for logger, _ in NOISE}:
        prefixes = tuple(prefix for logger, prefix in NOISE if logger == name)
        logging.getLogger(name).addFilter(_DropNoise(prefixes))


def report(message: str, *args) -> None:
    """One line for the user (public facts and DP outputs only; see the module docstring)."""
    install()
    LOGGER.info(message, *args)


class Progress:
    """Progress of `total` public units (see `progress`); `update(done)` takes the count so far."""

    LINES = 4  # without a terminal: one line per quarter

    def __init__(self, what: str, total: int, unit: str = "step",
                 stream: Optional[TextIO] = None, start: int = 0):
        self.what, self.total, self.unit = what, int(total), unit
        self.stream = sys.stderr if stream is None else stream
        quiet = bool(os.environ.get("SAGE_TFX_QUIET")) or self.total <= 0
        live = not quiet and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = None
        if live:
            from tqdm import tqdm  # pinned in requirements; imported only for a terminal
            self._bar = tqdm(total=self.total, desc=f"sage-tfx: {what}", unit=unit,
                             file=self.stream, mininterval=0.5, leave=True, dynamic_ncols=True,
                             initial=start)
        # Counts at which a line is written when there is no terminal (none when quiet); a
        # resumed task (`start` done already) writes only the marks after it.
        self._marks = [] if quiet or live else sorted(
            {math.ceil(self.total * k / self.LINES) for k in range(1, self.LINES + 1)} - set(
                range(start + 1)))
        self._done = start

    def update(self, done: int) -> None:
        if self._bar is not None:
            self._bar.update(done - self._done)
        while self._marks and done >= self._marks[0]:
            self.stream.write(f"sage-tfx: {self.what}: {self._marks.pop(0)}/{self.total} "
                              f"{self.unit}s\n")
            self.stream.flush()
        self._done = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *_) -> None:
        self.close()


def progress(what: str, total: int, unit: str = "step",
             stream: Optional[TextIO] = None, start: int = 0) -> Progress:
    """`with progress("DPTrainer DP-SGD", steps) as bar: ... bar.update(done)`: see Progress.
    `what`, `total`, `start` (units done before, e.g. by a resumed run) and every count given
    must be public (never data-dependent)."""
    return Progress(what, total, unit, stream, start)
