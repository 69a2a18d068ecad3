"""The taxi example's workloads (examples/taxi/workloads) on the real Chicago Taxi sample."""
import csv
import os

import numpy as np
import pytest
from support import REPO_ROOT

from sage_tfx.dp_statistics.matrix.granted import granted_histogram
from sage_tfx.release import GuaranteeUnit

from sage_tfx.dp_statistics.matrix import (answer_workload, eigen_design, expected_rmse,
                                           identity, svd_lower_bound_rmse)
from sage_tfx.dp_statistics.matrix.spec import parse_spec
from sage_tfx.examples.taxi import workload_answers
from sage_tfx.examples.taxi.stream import sample_path
from sage_tfx.sage_access.ledger import BlockLedger


@pytest.mark.parametrize("name, kronecker", [("trip_durations.json", False),
                                             ("hour_area_payment.json", True)])
def test_taxi_workloads_count_every_trip_once_and_beat_the_identity(name, kronecker):
    with open(os.path.join(REPO_ROOT, "examples", "taxi", "workloads", name)) as handle:
        spec = parse_spec(handle.read())
    with open(sample_path(), newline="") as handle:
        rows = list(csv.DictReader(handle))
    histogram = spec.histogram({a.feature: [row[a.feature] for row in rows]
                                for a in spec.attributes})
    assert histogram.sum() == len(rows) == 15002
    target = spec.workload
    chosen = eigen_design(target)
    assert (len(chosen.factors) > 1) == kronecker  # 13104 cells: a product of per-attribute
    error = expected_rmse(target, chosen, 1.0, 1e-6)
    assert svd_lower_bound_rmse(target, 1.0, 1e-6) <= error < expected_rmse(
        target, identity(target), 1.0, 1e-6)
    release = answer_workload(target, chosen, histogram, epsilon=1.0, delta=1e-6)
    assert release.answers.shape == (target.query_count,)


def test_the_taxi_workloads_run_on_ingested_trips_with_their_columns(tmp_path):
    """`make taxi-workloads`: the trips ingested as blocks keep hour, area and payment type,
    so the marginals' histogram is the sample's, not every trip in the default cells."""
    workdir = str(tmp_path / "taxi-workloads")
    assert workload_answers.main(["--workdir", workdir, "--epsilon", "0.5"]) == 0
    with open(workload_answers.workload_path("hour_area_payment.json")) as handle:
        spec = parse_spec(handle.read())
    ledger = BlockLedger(os.path.join(workdir, "ledger.sqlite"), read_only=True)
    granted = granted_histogram(spec, ledger, [block.block_id for block in ledger.blocks()])
    assert granted.units == ((GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ, "trip_id"),)
    histogram = granted.vector
    with open(sample_path(), newline="") as handle:
        rows = list(csv.DictReader(handle))
    direct = spec.histogram({a.feature: [row[a.feature] for row in rows]
                             for a in spec.attributes})
    assert np.array_equal(histogram, direct)  # every trip, in the cell its columns name
    cells = histogram.reshape(spec.workload.sizes)
    area, payment = spec.attributes[1], spec.attributes[2]
    in_default = cells[:, area.default, payment.default].sum()
    assert in_default < 0.1 * histogram.sum()  # the demo stream's ledger had all 15002 there
    assert np.count_nonzero(cells.sum(axis=(0, 2))) > 50  # trips from many community areas
    assert np.count_nonzero(cells.sum(axis=(0, 1))) >= 3  # cash, credit card, ...
    for out in workload_answers.WORKLOADS.values():
        with open(os.path.join(workdir, out), newline="") as handle:
            answers = list(csv.DictReader(handle))
        assert answers and all(np.isfinite(float(r["answer"])) for r in answers)
    assert all(block.spent[0] == pytest.approx(1.0) for block in ledger.blocks())
