"""The JSON workload spec and the histogram over its declared domain (the record rule)."""
import warnings

import numpy as np
import pytest

from sage_tfx.dp_statistics.matrix import DomainError, eigen_design, expected_rmse
from sage_tfx.dp_statistics.matrix.spec import Attribute, parse_spec

TAXI_LIKE = {
    "attributes": [
        {"name": "duration", "feature": "trip_seconds", "bins": [0, 300, 600, 1200, 3600]},
        {"name": "hour", "feature": "trip_start_hour", "size": 4},
        {"name": "payment", "feature": "payment_type", "categories": ["Cash", "Credit Card"],
         "default": 1}],
    "queries": [{"kind": "all_ranges", "attributes": ["duration"]},
                {"kind": "marginals", "attributes": ["hour", "payment"], "way": 2}],
}


def test_the_spec_builds_the_workload_it_names():
    spec = parse_spec(TAXI_LIKE)
    target = spec.workload
    assert target.sizes == (4, 4, 2)
    # 10 duration ranges (summed over hour and payment) + 8 (hour, payment) counts.
    assert target.query_count == 10 + 8
    assert expected_rmse(target, eigen_design(target), 1.0, 1e-6) > 0


def test_each_record_counts_once_and_bad_values_go_to_the_default_cell():
    spec = parse_spec(TAXI_LIKE)
    columns = {"trip_seconds": [10, 650, None, 99999, "x"],
               "trip_start_hour": [0, 3, 7, 2.5, 1],
               "payment_type": [b"Cash", "Credit Card", "Bitcoin", None, "Cash"]}
    histogram = spec.histogram(columns)
    assert histogram.sum() == 5 and histogram.dtype.kind == "i"
    cube = histogram.reshape(4, 4, 2)
    assert cube[0, 0, 0] == 1        # 10 s, hour 0, cash
    assert cube[2, 3, 1] == 1        # 650 s, hour 3, card
    # None / 99999 / "x" -> duration 0; hour 7 and 2.5 -> hour 0; "Bitcoin", None -> payment 1.
    assert cube[0, 0, 1] == 2 and cube[0, 1, 0] == 1


@pytest.mark.parametrize("change, message", [
    ({"queries": [{"kind": "all_ranges", "attributes": ["distance"]}]}, "outside the declared"),
    ({"queries": [{"kind": "cube"}]}, "unknown query kind"),
    ({"queries": [{"kind": "marginals", "way": 4}]}, "way must be"),
    ({"attributes": [{"name": "hour", "size": 0}]}, "positive integer"),
    ({"attributes": [{"name": "d", "bins": [5, 1]}]}, "increasing"),
])
def test_a_spec_outside_its_domain_is_refused(change, message):
    with pytest.raises(DomainError, match=message):
        parse_spec({**TAXI_LIKE, **change})


def test_extreme_values_fall_in_the_default_cell_without_a_data_dependent_warning():
    # A RuntimeWarning from casting inf or 1e300 would be a log line that one record controls.
    attribute = Attribute(name="hour", feature="hour", size=24, default=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codes = attribute.codes([3, 23.0, float("inf"), -float("inf"), 1e300, float("nan"),
                                 2.5, -1, 24, None, "x"])
    assert codes.tolist() == [3, 23, 0, 0, 0, 0, 0, 0, 0, 0, 0]
