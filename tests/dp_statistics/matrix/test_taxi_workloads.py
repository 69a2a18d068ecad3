"""The taxi example's workloads (examples/taxi/workloads) on the real Chicago Taxi sample."""
import csv
import os

import pytest
from support import REPO_ROOT

from sage_tfx.dp_statistics.matrix import (answer_workload, eigen_design, expected_rmse,
                                           identity, svd_lower_bound_rmse)
from sage_tfx.dp_statistics.matrix.spec import parse_spec
from sage_tfx.examples.taxi.stream import sample_path


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
