"""`make taxi-stream`: the real taxi sample replayed as a stream, 48 releases over 4 years."""
import json

import pandas as pd

from sage_tfx.examples.taxi import continual
from sage_tfx.sage_access import BlockLedger


def test_48_triggers_release_the_busy_areas_under_one_grant(tmp_path):
    workdir = tmp_path / "out"
    assert continual.main(["--workdir", str(workdir)]) == 0
    [grant] = BlockLedger(str(workdir / "ledger.sqlite")).grant_records()
    assert len(grant["blocks"]) == 48
    releases = workdir / "releases"
    for month in (1, 24, 48):
        line = json.loads((releases / f"release-{month:06d}.json").read_text())
        assert line["grant_id"] == grant["grant_id"]
        assert line["neighbours"] == "all rows of one trip_id within the blocks read"
        assert line["blocks"][0] == "taxi.2013-01"
    true = pd.read_csv(workdir / "taxi.csv")["pickup_community_area"].value_counts()
    final = pd.read_csv(releases / "release-000048.csv").set_index("key")["value"]
    # The two busiest areas (about 4,900 and 3,300 trips). A released value lags the truth by
    # the round's unreleased count, below R(l) = tau_l - Z(l) (tau_l <= 171, Z's std <= 29 at
    # (1, 1e-6), T = 48, C = 1), and carries the value tree's noise (std <= 29): 600 is more
    # than 6 standard deviations of both, a false failure below 1e-6.
    for area in (8, 32):
        assert abs(final[area] - true[area]) < 600
