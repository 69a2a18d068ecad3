"""Issue 29: `sage-tfx ingest` then `sage-tfx query` on two inputs that differ by one unit give
identical everything (printed keys and layout, the CSV's keys and format, exit code, messages,
everything stored in ML Metadata and under the run's directory) except the DP values, as
tests/test_neighbouring.py checks for the training pipeline (tests/support/neighbouring.py).

The DP values are the released aggregates: in the printed table and the CSV every cell after
the group keys is masked; everything else must be equal, byte for byte."""
import csv
import io
import os
import shutil

import pytest

from sage_tfx.cli import main
from sage_tfx.dp_statistics.ingest import USER_HASH_KEY_FILE
from sage_tfx.sage_access import BlockLedger
from sage_tfx.sage_access.records import GRANT_TYPE

from support.neighbouring import differences, fingerprint, normalize

PUBLIC = "OPTIONS(max_groups_contributed = 1, max_rows_contributed_per_group = 1, "


def _write(path, header, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def _masked_table(lines: list[str], keys: int) -> list[str]:
    """The printed release with every cell after the `keys` group keys masked (the header
    kept): what the printout says apart from the DP values."""
    if not lines or lines[0] == "(no group released)":
        return lines
    # The header's spacing follows the printed width of the DP values: compare its words.
    return [" ".join(lines[0].split())] + [
        " ".join(line.split()[:keys] + ["<dp>"] * (len(line.split()) - keys))
        for line in lines[1:]]


def _masked_csv(text: str, keys: int) -> list[list[str]]:
    rows = list(csv.reader(io.StringIO(text)))
    return rows[:1] + [row[:keys] + ["<dp>"] * (len(row) - keys) for row in rows[1:]]


def run_query(root, tables, sql, keys, capsys, epsilon="1"):
    """Ingest `tables` ({name: (header, rows, types)}) by uid into 2 user blocks each, run `sql`
    at (epsilon, 1e-6) on all blocks, and return what anyone but the DP values could tell
    apart: exit code, printout, messages, the CSV's keys, ML Metadata and the run's files."""
    for directory in (root, root + "-input"):
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
    store = os.path.join(root, "ledger.sqlite")
    BlockLedger.create(store)
    for name, (header, rows, types) in tables.items():
        source = os.path.join(root + "-input", f"{name}.csv")  # the data: outside the run
        _write(source, header, rows)
        assert main(["ingest", "--store", store, "--csv", source, "--unit-column", "uid",
                     "--user-blocks", "2", "--types", types, "--epsilon", "10", "--delta",
                     "1e-5", "--out", os.path.join(root, "blocks")]) == 0
    capsys.readouterr()
    out = os.path.join(root, "release.csv")
    code = main(["query", "--store", store, "--window", "2", "--epsilon", epsilon, "--delta",
                 "1e-6", "--out", out, sql])
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    table = [line for line in lines if not line.startswith("guarantee:")]
    released = None
    if os.path.exists(out):
        with open(out, newline="") as handle:
            released = _masked_csv(handle.read(), keys)
        os.remove(out)
    stored = fingerprint(store, root)
    # The blocks' rows (the data) and each table's secret hash key are the table's private
    # state inside the platform, not something released.
    stored["files"] = {path: content for path, content in stored["files"].items()
                       if not path.endswith(("rows.parquet", USER_HASH_KEY_FILE))}
    return {"exit code": [code],
            "printed": [normalize(line, root) for line in _masked_table(table, keys)
                        + [line for line in lines if line.startswith("guarantee:")]],
            "messages": [normalize(printed.err, root)], "csv": released or [], **stored}


def _compare(tmp_path, capsys, tables, neighbour_tables, sql, keys, epsilon="1"):
    root = str(tmp_path / "run")  # the same path for both runs
    first = run_query(root, tables, sql, keys, capsys, epsilon)
    second = run_query(root, neighbour_tables, sql, keys, capsys, epsilon)
    found = differences(first, second)
    assert found == [], "\n".join(found)
    return first


def _trips(units, keys="abc", rows_per_unit=1):
    return [(f"u{unit}", keys[unit % len(keys)], 1.0) for unit in range(units)
            for _ in range(rows_per_unit)]


def test_a_unit_whose_key_holds_a_nul_changes_no_label_and_no_format(tmp_path, capsys):
    """Without public groups the labels are the data's (selected with DP): a unit whose key is
    "a\\x00" placed first used to label the merged partition "a\\x00"."""
    header, types = ["uid", "key", "fare"], "fare:float"
    rows = _trips(150)
    sql = ("SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1) key, ANON_COUNT(*) "
           "AS n FROM trips GROUP BY key")
    first = _compare(tmp_path, capsys, {"trips": (header, rows, types)},
                     {"trips": (header, [("nul", "a\x00", 1.0)] + rows, types)}, sql, keys=1)
    assert first["csv"][1:] == [["a", "<dp>"], ["b", "<dp>"], ["c", "<dp>"]]


def _joined(areas, extra_unit_only_in_a=False):
    """Tables a (uid, fare) and b (uid, area: int) of the same 60 units; the neighbour adds
    one unit present only in a (its area is NULL after a LEFT JOIN)."""
    units = [f"u{i}" for i in range(60)] + (["only_a"] if extra_unit_only_in_a else [])
    return {"a": (["uid", "fare"], [(unit, 1.0) for unit in units], "fare:float"),
            "b": (["uid", "area"], [(f"u{i}", areas[i % len(areas)]) for i in range(60)],
                  "area:int")}


@pytest.mark.parametrize("areas", [(1, 2, 3), (2 ** 53, 2 ** 53 + 1)],
                         ids=["small", "beyond_2^53"])
def test_a_left_join_null_key_changes_no_key_format(tmp_path, capsys, areas):
    """An integer key holding a NULL used to become float: 1,2,3 printed 1.0,2.0,3.0, and
    2^53 and 2^53 + 1 were merged into one partition."""
    public = ", ".join(str(area) for area in areas)
    sql = (f"SELECT WITH ANONYMIZATION OPTIONS(public_groups = ({public})) area, "
           "ANON_COUNT(*) AS n, ANON_SUM(fare, 0, 2) AS total FROM a LEFT JOIN b USING (uid) "
           "GROUP BY area")
    first = _compare(tmp_path, capsys, _joined(areas), _joined(areas, True), sql, keys=1)
    assert first["csv"][1:] == [[str(area), "<dp>", "<dp>"] for area in areas]


def test_a_nul_key_does_not_merge_into_a_public_group(tmp_path):
    """Public groups a, b, c, COUNT(*) at epsilon 2 with one row per unit (noise scale 0.5):
    a unit whose row "a\\x00" comes first used to take a's 20 rows into a partition that no
    public key matched (a's count about 0). Now that row is dropped by its own content."""
    import pandas as pd
    import pyarrow as pa

    from sage_tfx.dp_statistics.aggregation import frontend, sql as dp_sql
    from sage_tfx.release import charge
    from sage_tfx.sage_access.ledger import BlockIds

    rows = pd.DataFrame(_trips(60), columns=["uid", "key", "fare"])
    with_nul = pd.concat([pd.DataFrame([("nul", "a\x00", 1.0)], columns=rows.columns), rows],
                         ignore_index=True)
    sql = ("SELECT WITH ANONYMIZATION " + PUBLIC + "public_groups = ('a', 'b', 'c'), "
           "privacy_unit_column = uid) key, ANON_COUNT(*) AS n FROM t GROUP BY key")
    schema = pa.Schema.from_pandas(rows, preserve_index=False)
    planned = frontend.plan_query(dp_sql.parse(sql), {"t": dp_sql.TableSchema("uid", {
        "uid": "string", "key": "string", "fare": "float"})}, {"t": schema}, 2.0, 0.0)
    ledger = BlockLedger.create(str(tmp_path / "ledger.sqlite"))
    ledger.add_block("b1", 100.0, 1e-5)
    for frame in (rows, with_nul):
        grant = charge(ledger, planned.release_plan("test", sql), BlockIds(["b1"])).grant
        release = frontend.dp_aggregate(frame, sql, grant, ledger)
        counts = dict(zip(release.table["key"], release.table["n"]))
        assert list(counts) == ["a", "b", "c"]
        # |Laplace(0.5)| > 8 with probability e^-16 per check (false-failure rate < 1e-6)
        assert all(abs(count - 20) < 8 for count in counts.values()), counts


@pytest.mark.parametrize("bound, refused", [("1e308", True), ("1e300", False)])
def test_a_huge_sum_exits_alike_with_one_unit_more(tmp_path, capsys, bound, refused):
    """ANON_SUM(x, 0, 1e308) with one group per unit: one unit's 1e308 summed (exit 0), two
    units' overflowed to inf and the charged run failed ("values must be finite", exit 1).
    Now such bounds are refused before the charge (exit 2, nothing charged), and bounds that
    pass give sums that saturate instead of overflowing."""
    header, types = ["uid", "key", "x"], "x:float"
    one = [("u0", "a", 1.7e308)]
    sql = ("SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1, public_groups = "
           f"('a')) key, ANON_SUM(x, 0, {bound}) AS total FROM trips GROUP BY key")
    first = _compare(tmp_path, capsys, {"trips": (header, one, types)},
                     {"trips": (header, one + [("u1", "a", 1.7e308)], types)}, sql, keys=1)
    assert first["exit code"] == [2 if refused else 0]
    if refused:
        assert "aggregate 'total': bounds [0.0, 1e+308]" in first["messages"][0]
        assert not any(e[1] == GRANT_TYPE for e in first["executions"])  # nothing charged
