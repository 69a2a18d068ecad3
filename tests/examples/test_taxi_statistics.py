"""`make taxi-statistics`: per-community-area statistics from the real taxi sample."""
import pandas as pd

from sage_tfx.examples.taxi import statistics


def test_every_public_area_is_released_with_its_guarantee(tmp_path, capsys):
    workdir = tmp_path / "out"
    assert statistics.main(["--workdir", str(workdir), "--unit-column", "trip_id"]) == 0
    printed = capsys.readouterr().out
    assert "for adding or removing all rows of one trip_id within the blocks read" in printed
    released = pd.read_csv(workdir / "release.csv")
    assert list(released.columns) == ["area", "trips", "mean_fare", "median_trip_seconds"]
    assert list(released["area"]) == list(statistics.COMMUNITY_AREAS)
    assert released["mean_fare"].between(0, 60).all()  # clamped into the query's bounds


def test_a_unit_the_data_lacks_is_refused_with_the_way_out(tmp_path, capsys):
    assert statistics.main(["--workdir", str(tmp_path / "out")]) == 2
    assert "--unit-column trip_id" in capsys.readouterr().err
