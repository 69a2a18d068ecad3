"""Issue 29: `sage-tfx ingest` then `sage-tfx workload-answer` on two tables that differ by one
unit give identical everything a reader can see except the DP values: the exit code, stdout (the
summary JSON, its noisy answers aside: there are none in it), stderr, the CSV's shape, labels,
expected errors and format, its guarantee sidecar (FILE.csv.guarantee.json), and everything
ML Metadata holds (blocks, the table, grants with their outcome and request, denials) or the
run's directory holds (tests/support/neighbouring.py says exactly what is compared). The extra
unit is an ordinary one, one with many rows, one whose values fall outside the spec's domain,
and one whose values are huge, NaN, infinite, unreadable or on a malformed line; a request the
blocks cannot pay is denied alike (exit 3, the denial recorded)."""
import csv
import json
import os
import shutil

import pytest
from support.trip_blocks import TRIP_SPEC

from sage_tfx.cli import main
from sage_tfx.dp_statistics.ingest import USER_HASH_KEY_FILE
from sage_tfx.sage_access import BlockLedger
from sage_tfx.sage_access.records import DENIAL_TYPE, GRANT_TYPE, RELEASE_OUTCOME_TYPE

from support.neighbouring import differences, fingerprint, masked_table, normalize

HEADER = ["uid", "trip_seconds", "payment_type"]
TRIPS = [(f"u{unit}", 30 + 41 * unit % 280, ("Cash", "Credit Card")[unit % 2])
         for unit in range(40)]
# The neighbour's one more unit, by what its rows hold. Its rows come first in the CSV, so a
# rule that took a table-wide decision from the first rows would show.
EXTRA_UNITS = {
    "an ordinary unit": [("extra", 90, "Cash")],
    "a unit with many rows": [("extra", 30 + 7 * i, "Credit Card") for i in range(60)],
    "values outside the domain": [("extra", 5000, "Bitcoin"), ("extra", -3, ""),
                                  ("extra", 300, "cash")],
    "huge, NaN and unreadable values": [("extra", "1e308", "Cash"), ("extra", "NaN", "Cash"),
                                        ("extra", "-inf", "\x00"), ("extra", "ten", "Cash"),
                                        ("extra", 1, "Cash", "a cell too many")],
}
# The answers are the DP values; everything else in the CSV (its header, the query labels and
# their expected RMSE, which follow from the public spec and budget) must be equal.
PUBLIC_CSV_COLUMNS = {"query", "expected_rmse"}


def run_workload_answer(root: str, rows, capsys, epsilon: str = "1") -> dict:
    """Ingest `rows` by uid into 2 user blocks, answer TRIP_SPEC's workload at (epsilon, 1e-6)
    on both, and return what anyone but the DP values could tell apart."""
    for directory in (root, root + "-input"):
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
    store = os.path.join(root, "ledger.sqlite")
    BlockLedger.create(store)
    source = os.path.join(root + "-input", "trips.csv")  # the data: outside the run
    with open(source, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(HEADER)
        writer.writerows(rows)
    spec = os.path.join(root, "spec.json")
    with open(spec, "w") as handle:
        json.dump(TRIP_SPEC, handle)
    assert main(["ingest", "--store", store, "--csv", source, "--unit-column", "uid",
                 "--user-blocks", "2", "--types", "trip_seconds:float", "--epsilon", "10",
                 "--delta", "1e-5", "--out", os.path.join(root, "blocks")]) == 0
    capsys.readouterr()
    out = os.path.join(root, "answers.csv")
    code = main(["workload-answer", "--store", store, "--window", "2", "--epsilon", epsilon,
                 "--delta", "1e-6", "--spec", spec, "--out", out])
    printed = capsys.readouterr()
    released = []
    if os.path.exists(out):
        with open(out, newline="") as handle:
            header, *rows = csv.reader(handle)
        released = masked_table(header, rows, PUBLIC_CSV_COLUMNS)
        os.remove(out)  # the DP values: compared above, masked
    stored = fingerprint(store, root)  # holds answers.csv.guarantee.json, compared whole
    # The blocks' rows (the data) and the table's secret hash key are the table's private
    # state inside the platform, not something released.
    stored["files"] = {path: content for path, content in stored["files"].items()
                       if not path.endswith(("rows.parquet", USER_HASH_KEY_FILE))}
    return {"exit code": [code], "printed": [normalize(printed.out, root)],
            "messages": [normalize(printed.err, root)], "csv": released, **stored}


def _compare(tmp_path, capsys, extra_rows, epsilon="1") -> dict:
    root = str(tmp_path / "run")  # the same path for both runs
    first = run_workload_answer(root, TRIPS, capsys, epsilon)
    second = run_workload_answer(root, extra_rows + TRIPS, capsys, epsilon)
    found = differences(first, second)
    assert found == [], "\n".join(found)
    return first


@pytest.mark.parametrize("extra", list(EXTRA_UNITS))
def test_neighbouring_tables_give_the_same_answers_file_but_for_the_dp_values(tmp_path, capsys,
                                                                              extra):
    first = _compare(tmp_path, capsys, EXTRA_UNITS[extra])
    assert first["exit code"] == [0] and first["messages"] == [""]
    # The comparison sees what it must: the CSV's 12 queries, the sidecar, the grant released.
    assert len(first["csv"]) == 1 + 6 + 6 and first["csv"][0] == ["query", "answer",
                                                                  "expected_rmse"]
    [sidecar] = [path for path in first["files"] if path.endswith("answers.csv.guarantee.json")]
    assert "all rows of one uid" in first["files"][sidecar]
    assert [e for e in first["executions"] if e[1] == GRANT_TYPE]
    [outcome] = [a[-1] for a in first["artifacts"] if a[1] == RELEASE_OUTCOME_TYPE]
    assert "released" in outcome.values() and "sage-tfx workload-answer" in outcome.values()
    assert json.loads(first["printed"][0])["unit"] == "all rows of one uid"


def test_a_request_the_blocks_cannot_pay_is_denied_alike(tmp_path, capsys):
    # epsilon 20 > the blocks' 10: exit 3, nothing charged, nothing written, the denial recorded.
    first = _compare(tmp_path, capsys, EXTRA_UNITS["a unit with many rows"], epsilon="20")
    assert first["exit code"] == [3] and first["csv"] == [] and first["printed"] == [""]
    assert "workload-answer" in first["messages"][0]
    assert not any(e[1] == GRANT_TYPE for e in first["executions"])
    [denial] = [e[-1] for e in first["executions"] if e[1] == DENIAL_TYPE]
    assert "sage-tfx workload-answer" in denial.values()
