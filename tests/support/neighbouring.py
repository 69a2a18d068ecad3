"""What the platform stores and prints about a run, for comparing neighbouring datasets.

Issue 16 §1: every value stored, logged or printed must not change when one record is added or
removed, unless a DP mechanism produced it. `fingerprint` collects, after a run under `root`
with its ML Metadata store at `store_path`:
* every artifact, execution and context in ML Metadata with its properties and custom
  properties, and every event (creation times, which differ between any two runs, left out);
* every file under the run's outputs, with its content, except the records themselves
  (`Split-*` data files of Examples: the data, inside the platform) and DP releases;
* what the platform's own code logged.
Values that differ between any two runs whatever the data (random grant ids, TFX run ids with
their timestamps) are replaced by placeholders, so only data-dependent differences remain.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re

from ml_metadata.proto import metadata_store_pb2 as pb

import sage_tfx
from sage_tfx.sage_access import connect

# (artifact type, custom property) pairs that DP mechanisms release within the grant's budget.
DP_PROPERTIES = {
    ("ModelBlessing", "dp_metric"), ("ModelBlessing", "lower_bound"),
    ("ModelBlessing", "upper_bound"), ("ModelBlessing", "outcome"),
    ("ModelBlessing", "blessed"), ("ModelBlessing", "baseline_gap"),
    ("ModelBlessing", "baseline_gap_lower_bound"), ("PushedModel", "pushed"),
}
# Files that hold DP releases (model weights, DP transform statistics) or records.
DP_OR_DATA_FILES = re.compile(
    r"(/Split-[^/]+/[^/]+$)|(/Format-Serving/)|(/transform_fn/)|(/transformed_metadata/)"
    r"|(/BLESSED$)|(/NOT_BLESSED$)|(/pushed/)|(/model_run/)|(/ModelRun/)"
    r"|(/evaluation/\d+/metrics\.tfrecord$)")  # SLAedValidator's DP metrics, as TFMA reads them

_UUID = re.compile(r"[0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?"
                        r"|(?<=tfevents\.)\d+\.[^.]+\.\d+\.\d+")  # TensorBoard: time.host.pid.n
# Values in the platform's log lines that DP mechanisms released: AdaSSP's ridge (from its noisy
# smallest eigenvalue), and the SLAed validator's outcome, DP metric and interval.
DP_LOG_VALUES = re.compile(r"(?<=ridge )[-+0-9.e]+"
                           r"|(?<=SLAedValidator: )(ACCEPT|REJECT|RETRY)"
                           r"|(?<=\(DP loss )[-+0-9.e]+|(?<=\(DP accuracy )[-+0-9.e]+"
                           r"|(?<= in )\[[-+0-9.e]+, [-+0-9.einf]+\]"
                           r"|(?<=DP gap )[-+0-9.e]+|(?<=population gap > )[-+0-9.einf]+")


class PlatformLog(logging.Handler):
    """What the platform's own code logs while in use (TFX's and Beam's logs are theirs), with
    absl's INFO lines let through for the time."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines, self._package = [], os.path.dirname(sage_tfx.__file__)

    def emit(self, record):
        # The project's virtual environment may live inside the checkout (make test's .venv):
        # TFX's and Beam's files there are not the platform's.
        if record.pathname.startswith(self._package) and "site-packages" not in record.pathname:
            self.lines.append(record.getMessage())

    def __enter__(self):
        # sage_tfx.console's logger does not propagate to the root logger: listen to both.
        for logger in (logging.getLogger(), logging.getLogger("sage_tfx")):
            logger.addHandler(self)
        absl_logger = logging.getLogger("absl")
        self._absl_level = absl_logger.level
        absl_logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        logging.getLogger("absl").setLevel(self._absl_level)
        for logger in (logging.getLogger(), logging.getLogger("sage_tfx")):
            logger.removeHandler(self)


def normalize(text: str, root: str) -> str:
    return _TIMESTAMP.sub("<time>", _UUID.sub("<uuid>", text.replace(root, "<root>")))


def masked_table(header: list, rows: list, public_columns) -> list:
    """A released table as a reader may compare it: its header, and its rows with every cell
    outside `public_columns` masked (all rows, when `public_columns` is None: which rows exist
    is itself a DP release, e.g. keys that passed a DP threshold)."""
    if public_columns is None:
        return [header, "<dp rows>"]
    return [header] + [[cell if column in public_columns else "<dp>"
                        for column, cell in zip(header, row)] for row in rows]


def _value(value: pb.Value, root: str):
    kind = value.WhichOneof("value")
    raw = getattr(value, kind) if kind else None
    return normalize(raw, root) if isinstance(raw, str) else str(raw)


def _properties(node, type_name: str, root: str) -> dict:
    found = {}
    for field in ("properties", "custom_properties"):
        for key, value in getattr(node, field).items():
            if (type_name, key) not in DP_PROPERTIES:
                found[f"{field}.{key}"] = _value(value, root)
    return found


def fingerprint(store_path: str, root: str, log_lines: list[str] = ()) -> dict:
    store = connect(store_path)
    artifacts = sorted(store.get_artifacts(), key=lambda a: a.id)
    executions = sorted(store.get_executions(), key=lambda e: e.id)
    contexts = sorted(store.get_contexts(), key=lambda c: c.id)
    events = store.get_events_by_execution_ids([e.id for e in executions]) if executions else []
    stored = {
        "artifacts": [(a.id, a.type, normalize(a.name, root), normalize(a.uri, root), a.state,
                       _properties(a, a.type, root)) for a in artifacts],
        "executions": [(e.id, e.type, normalize(e.name, root), e.last_known_state,
                        _properties(e, e.type, root)) for e in executions],
        "contexts": [(c.id, c.type, normalize(c.name, root), _properties(c, c.type, root))
                     for c in contexts],
        "events": sorted((e.artifact_id, e.execution_id, e.type,
                          str(e.path).replace("\n", " ")) for e in events),
    }
    files = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            relative = normalize(path, root)
            if path == store_path or DP_OR_DATA_FILES.search(relative):
                files[relative] = "<data or DP release>"
                continue
            with open(path, "rb") as handle:
                content = handle.read()
            try:
                files[relative] = normalize(content.decode(), root)
            except UnicodeDecodeError:
                files[relative] = hashlib.sha256(content).hexdigest()
    stored["files"] = files
    stored["logs"] = [DP_LOG_VALUES.sub("<dp>", normalize(line, root)) for line in log_lines]
    return stored


def differences(first: dict, second: dict) -> list[str]:
    """Readable differences between two fingerprints (empty when they agree)."""
    found = []
    for section in first:
        a, b = first[section], second[section]
        if section == "files":
            for path in sorted(set(a) | set(b)):
                if a.get(path) != b.get(path):
                    found.append(f"file {path}")
            continue
        if len(a) != len(b):
            found.append(f"{section}: {len(a)} vs {len(b)} entries")
        for x, y in zip(a, b):
            if x != y:
                if isinstance(x, tuple) and isinstance(x[-1], dict):
                    keys = sorted(k for k in set(x[-1]) | set(y[-1])
                                  if x[-1].get(k) != y[-1].get(k))
                    found.append(f"{section} {x[1]}: {keys or x[:-1]}")
                else:
                    found.append(f"{section}: {x} vs {y}")
    return found


def one_more(longer: list, shorter: list) -> bool:
    """Whether `longer` is `shorter` with at most one item inserted (order kept): what one added
    record may change in a list of records."""
    if longer == shorter:
        return True
    return len(longer) == len(shorter) + 1 and any(
        longer[:i] + longer[i + 1:] == shorter for i in range(len(longer)))
