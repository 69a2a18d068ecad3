"""`sage-tfx stream` on neighbouring inputs (issue 29): two streams that differ by all records
of one unit give identical everything a reader can see except the DP values: the files written
under --out (the release CSVs' contents are the DP values), ML Metadata (grant, share, trigger
pins, and the pattern of equal pin values), what is printed (progress on stderr, the summary
line) and the exit code; first runs, re-runs that bring the unit as late records, and denials.
The private state lives outside the compared directory (--state-dir), as docs/streaming.md
asks. tests/support/neighbouring.py says exactly what is compared."""
import csv
import re

import pytest

from sage_tfx.cli import main as sage_tfx
from sage_tfx.sage_access import BlockLedger, connect

from support.neighbouring import differences, fingerprint

JAN, FEB = 1356998400, 1359676800  # 2013-01-01, 2013-02-01 UTC
WEEK = 7 * 86400
BLOCKS = "s.2013-01,s.2013-02"
RELEASE_CSV = re.compile(r"/release-\d{6}\.csv$")


def base_rows():
    """Records in the first half of January only: micro-batches 2-4 of 4 are empty."""
    return [[f"u{user}", "busy" if user % 3 else "calm", JAN + week * 86400 + user]
            for week in range(7) for user in range(60)]


def with_one_unit(rows):
    """The neighbour: one more unit, with records in otherwise empty micro-batches (weeks 3 and
    6) under a key no other unit has."""
    return rows + [["intruder", "secret", JAN + 3 * WEEK], ["intruder", "busy", FEB + 2 * WEEK]]


def write_rows(path, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "key", "time"])
        writer.writerows(rows)
    return str(path)


def new_ledger(store, block_epsilon=10.0):
    BlockLedger.create(store)
    ledger = BlockLedger(store)
    for block, start, end in (("s.2013-01", "2013-01-01", "2013-02-01"),
                              ("s.2013-02", "2013-02-01", "2013-03-01")):
        ledger.add_block(block, block_epsilon, 1e-4, f"{start}T00:00:00+00:00",
                         f"{end}T00:00:00+00:00")


def run_stream(root, input_path, state_dir, capsys, epsilon=4):
    """One `sage-tfx stream` run; (exit code, stdout and stderr lines)."""
    code = sage_tfx(["stream", "--store", str(root / "metadata.sqlite"), "--window-blocks",
                     BLOCKS, "--epsilon", str(epsilon), "--delta", "1e-5", "--micro-batches",
                     "4", "--contribution-limit", "4", "--out", str(root / "out"),
                     "--state-dir", str(state_dir), "--input", input_path])
    captured = capsys.readouterr()
    return code, captured.out.splitlines() + captured.err.splitlines()


def seen(root, lines):
    """The run's fingerprint with the DP values masked, plus the pins' equality pattern."""
    store = str(root / "metadata.sqlite")
    found = fingerprint(store, str(root), lines)
    found["files"] = {path: "<dp release>" if RELEASE_CSV.search(path) else content
                      for path, content in found["files"].items()}
    pins = sorted(connect(store).get_artifacts_by_type("sage_tfx.GrantPin"),
                  key=lambda pin: pin.name)
    values = [pin.custom_properties["digest"].string_value for pin in pins]
    # Pin values are masked as random ids above; which of them are equal is not.
    found["pin pattern"] = [values.index(value) for value in values]
    return found


def release_files(out):
    return {path.name: path.read_bytes() for path in sorted(out.glob("release-*"))}


def runs(tmp_path, name, rows, capsys, epsilon=4, late_rows=None):
    """A fresh ledger and a run on `rows` (then, with `late_rows`, a re-run of the same out on
    them); the fingerprint, the exit codes and the release files after each run."""
    root, private = tmp_path / name / "root", tmp_path / name / "private"
    root.mkdir(parents=True)
    new_ledger(str(root / "metadata.sqlite"))
    codes, lines, releases = [], [], []
    for number, these in enumerate([rows] + ([late_rows] if late_rows is not None else [])):
        path = write_rows(tmp_path / name / f"input-{number}.csv", these)
        code, output = run_stream(root, path, private, capsys, epsilon)
        codes.append(code)
        lines += output
        releases.append(release_files(root / "out"))
    return seen(root, lines), codes, releases


@pytest.mark.parametrize("case", ["first run", "re-run with the unit as late records",
                                  "denied"])
def test_neighbouring_streams_are_indistinguishable_but_for_the_dp_values(tmp_path, capsys,
                                                                          case):
    base = base_rows()
    if case == "first run":
        a, b = (runs(tmp_path, name, rows, capsys)
                for name, rows in (("a", base), ("b", with_one_unit(base))))
        expected_codes = [0]
    elif case == "denied":  # epsilon 20 > the blocks' 10: nothing charged, nothing written
        a, b = (runs(tmp_path, name, rows, capsys, epsilon=20)
                for name, rows in (("a", base), ("b", with_one_unit(base))))
        expected_codes = [3]
    else:  # the unit's records arrive after every micro-batch was released
        a, b = (runs(tmp_path, name, base, capsys, late_rows=late)
                for name, late in (("a", base), ("b", with_one_unit(base))))
        expected_codes = [0, 0]
    (first, first_codes, first_releases), (second, second_codes, second_releases) = a, b
    assert first_codes == second_codes == expected_codes
    assert differences(first, second) == []
    if case != "denied":
        assert first["pin pattern"] == [0, 1, 2, 3]  # every pin its own value
        assert any("continual release: 4/4 triggers" in line for line in first["logs"])
        assert sum(1 for path in first["files"] if RELEASE_CSV.search(path)) == 4
    if case == "re-run with the unit as late records":
        # The late unit changed nothing: the releases stay the published ones, bit for bit.
        assert second_releases[1] == second_releases[0] and len(second_releases[0]) == 8
