"""DP SQL as an analyst coming from BigQuery expects it (issue 33): NULLs skipped by each
aggregate, BigQuery's spelling, stated accuracy, monotone quantiles, and messages that say why.

Noise: tests that compare values use the `seeded_noise` fixture (the OpenDP law and scale,
drawn from seeded numpy), so they repeat exactly; bounds are a few noise scales wide."""
import csv

import numpy as np
import pandas as pd
import pytest

from sage_tfx.cli import main
from sage_tfx.sage_access import BlockLedger


def ingest(store, tmp_path, name, header, rows, types, **options):
    path = tmp_path / f"{name}.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    arguments = ["ingest", "--store", store, "--csv", str(path), "--unit-column", "uid",
                 "--user-blocks", "1", "--types", types, "--epsilon", "100", "--delta", "1e-3",
                 "--out", str(tmp_path / f"blocks-{name}")]
    for option, value in options.items():
        arguments += [f"--{option.replace('_', '-')}", value]
    return main(arguments)


def query(store, sql, *flags, epsilon="20", delta="1e-5", out=None):
    arguments = ["query", "--store", store, "--window", "1", "--epsilon", epsilon,
                 "--delta", delta, *flags]
    if out is not None:
        arguments += ["--out", str(out)]
    return main(arguments + [sql])


@pytest.fixture
def speeds(tmp_path, store_path):
    """The issue's table: 60% of the speed cells are NaN, empty or "fast"; the others are
    uniform on [40, 60] (mean 50). 600 units of 2 rows each, in region r1 or r2."""
    BlockLedger.create(store_path)
    rng = np.random.default_rng(7)
    rows = []
    for unit in range(600):
        for _ in range(2):
            bad = rng.random() < 0.6
            cell = rng.choice(["NaN", "", "fast"]) if bad else f"{rng.uniform(40, 60):.3f}"
            rows.append((f"u{unit}", f"r{1 + unit % 2}", cell))
    assert ingest(store_path, tmp_path, "drives", ["uid", "region", "speed"], rows,
                  "speed:float") == 0
    valid = sum(1 for row in rows if row[2] not in ("NaN", "", "fast"))
    return store_path, valid


def test_null_nan_and_unparseable_cells_are_skipped_by_each_aggregate(speeds, tmp_path,
                                                                     seeded_noise, capsys):
    store, valid = speeds
    out = tmp_path / "release.csv"
    assert query(store, "SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1, "
                        "public_groups = ('r1', 'r2')) region, ANON_COUNT(*) AS rows_, "
                        "ANON_COUNT(speed) AS speeds, ANON_AVG(speed, 0, 100) AS mean_speed, "
                        "ANON_SUM(speed, 0, 200) AS total FROM drives GROUP BY region",
                 out=out) == 0, capsys.readouterr().err
    released = pd.read_csv(out)
    # Before issue 33 the bad cells were stored as 0: the mean was about 20 and COUNT(speed)
    # counted every row. Now they are NULL: the mean is of the valid speeds (about 50) and
    # COUNT(speed) counts the valid cells only (noise scale of each a few units here).
    assert released["mean_speed"].between(47, 53).all(), released
    assert abs(released["speeds"].sum() - valid) < 40, (released, valid)
    assert abs(released["rows_"].sum() - 1200) < 40, released
    assert released["total"].sum() == pytest.approx(50 * valid, rel=0.1)
