"""The statistics commands never import TensorFlow (issue 29): `sage-tfx ingest`, `query`,
`stream` and `workload-answer` on an ingested table. Importing it costs about 10 s and prints
oneDNN/CUDA start-up lines that say nothing to a user of a SQL query.

One fresh interpreter runs the four commands in turn, as a user would, and reports after each
whether TensorFlow is loaded; an import hook keeps the stack of the first import, so a failure
names the project's line that pulled it in."""
import csv
import json
import os
import subprocess
import sys

JAN = 1356998400  # 2013-01-01 UTC

SCRIPT = r"""
import importlib.abc, json, sys, traceback

first_import = []


class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" and not first_import:
            # The project's frames (not importlib's or the libraries'): the line to blame.
            first_import.append("".join(traceback.format_list(
                [frame for frame in traceback.extract_stack()
                 if "site-packages" not in frame.filename and "<frozen" not in frame.filename])))
        return None  # the import itself goes on as usual


sys.meta_path.insert(0, Watch())
from sage_tfx.cli import main

report = []
for name, argv in json.loads(sys.argv[1]):
    code = main(argv)
    report.append([name, code, "tensorflow" in sys.modules])
print(json.dumps({"commands": report, "first import": first_import}))
"""


def _commands(tmp_path):
    """(name, argv) of the four commands on one ledger: ingest a table cut by month, then
    query it, answer a workload over it and stream it."""
    store, table = str(tmp_path / "ledger.sqlite"), str(tmp_path / "trips.csv")
    with open(table, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "key", "fare", "time"])
        writer.writerows([f"u{unit}", "ab"[unit % 2], 3 + unit % 7, JAN + 3600 * unit]
                         for unit in range(50))
    spec = str(tmp_path / "spec.json")
    with open(spec, "w") as handle:
        json.dump({"attributes": [{"name": "fare", "feature": "fare", "bins": [0, 5, 10]},
                                  {"name": "key", "feature": "key", "categories": ["a", "b"]}],
                   "queries": [{"kind": "marginals", "way": 2}]}, handle)
    budget = ["--epsilon", "1", "--delta", "1e-6"]
    return [
        ("ledger init", ["ledger", "--store", store, "init"]),
        ("ingest", ["ingest", "--store", store, "--csv", table, "--unit-column", "uid",
                    "--time-column", "time", "--period", "month", "--start", "2013-01",
                    "--end", "2013-03", "--types", "fare:float,time:int", "--epsilon", "10",
                    "--delta", "1e-5", "--out", str(tmp_path / "blocks")]),
        ("query", ["query", "--store", store, "--window", "2", *budget,
                   "SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1, "
                   "public_groups = ('a', 'b')) key, ANON_COUNT(*) AS n FROM trips "
                   "GROUP BY key"]),
        ("workload-answer", ["workload-answer", "--store", store, "--window", "2", *budget,
                             "--spec", spec, "--out", str(tmp_path / "answers.csv")]),
        ("stream", ["stream", "--store", store, "--window-blocks",
                    "trips.2013-01,trips.2013-02", *budget, "--micro-batches", "2",
                    "--out", str(tmp_path / "stream")]),
    ]


def test_the_statistics_commands_do_not_import_tensorflow(tmp_path):
    commands = _commands(tmp_path)
    environment = {k: v for k, v in os.environ.items() if k != "SAGE_TFX_DEBUG"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(commands)],
                            capture_output=True, text=True, env=environment, timeout=300,
                            cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    # Every command ran to its end (exit 0), so each was checked doing its whole job.
    assert found["commands"] == [[name, 0, False] for name, _ in commands], (
        result.stderr + "\nTensorFlow was first imported from:\n"
        + "".join(found["first import"]))
