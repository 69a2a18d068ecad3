"""The matrix mechanism's data vector counts each privacy unit once: one row of each unit of an
ingested table, chosen uniformly among its rows; each record of a block that is no table."""
import csv
import json

import numpy as np
from support.trip_blocks import TRIP_SPEC, write_block

from sage_tfx.dp_statistics.matrix.granted import granted_histogram
from sage_tfx.release import Guarantee, GuaranteeUnit
from sage_tfx.dp_statistics.aggregation.aggregators import rows_per_unit
from sage_tfx.dp_statistics.ingest import ingest
from sage_tfx.dp_statistics.matrix.spec import parse_spec
from sage_tfx.randomness import secret_rng
from sage_tfx.sage_access.ledger import BlockLedger

SPEC = parse_spec(json.dumps(TRIP_SPEC))


def test_user_blocks_count_each_unit_once_and_state_the_unit(tmp_path):
    ledger = BlockLedger.create(str(tmp_path / "ledger.sqlite"))
    # u0: 30 short cash trips and 30 long card trips; u1..u5: one medium cash trip each.
    rows = [("u0", 30 if i % 2 else 200, "Cash" if i % 2 else "Credit Card") for i in range(60)]
    rows += [(f"u{i}", 90, "Cash") for i in range(1, 6)]
    with open(tmp_path / "trips.csv", "w", newline="") as handle:
        csv.writer(handle).writerows([("uid", "trip_seconds", "payment_type")] + rows)
    _, blocks = ingest(ledger, str(tmp_path / "trips.csv"), str(tmp_path / "rows"), "uid", 1.0,
                       1e-6, table_name="trips", user_blocks=3,
                       types={"trip_seconds": "float"})
    granted = granted_histogram(SPEC, ledger, blocks, rng=secret_rng(3))
    assert granted.units == ((GuaranteeUnit.UNIT, "uid"),)
    cells = granted.vector.reshape(SPEC.workload.sizes)
    assert granted.vector.sum() == 6 and cells[1, 0] == 5  # u0 once, in one of its two cells
    assert cells[0, 0] + cells[2, 1] == 1

    # A block that is no table (BlockExampleGen's Examples) counts each of its 4 records.
    write_block(str(tmp_path / "examples"))
    ledger.add_block("examples", 1.0, 1e-6, data_uri=str(tmp_path / "examples"))
    mixed = granted_histogram(SPEC, ledger, blocks + ["examples"], rng=secret_rng(3))
    assert mixed.vector.sum() == 6 + 4
    assert mixed.units == ((GuaranteeUnit.UNIT, "uid"), (GuaranteeUnit.RECORD, None))
    (unit, column), *others = mixed.units
    assert Guarantee(1.0, 1e-6, unit, column, "g", ("b",), other_units=others).neighbours == (
        "all rows of one uid or one record of the granted blocks")


def test_each_row_of_a_unit_is_kept_equally_often():
    # Unit 0 owns rows 0, 2 and 4; units 1 and 2 one row each. Over 3000 draws each of unit 0's
    # rows is kept 1000 times in expectation (sd 25.8); 5 sd either side fails with
    # probability 6e-7 per row, 2e-6 for the three. Keeping a unit's first row always (a
    # deterministic choice) gives 3000, 0, 0 and fails.
    units = np.array([0, 1, 0, 2, 0])
    rng = secret_rng(11)
    kept = np.array([rows_per_unit(units, 1, rng) for _ in range(3000)])
    assert kept.shape == (3000, 3)
    assert all({1, 3} <= set(draw) for draw in kept)  # the one-row units always count
    counts = np.array([np.sum(kept == row) for row in (0, 2, 4)])
    assert np.all(np.abs(counts - 1000) < 5 * 25.8), counts
