"""DP statistics from the taxi trips: per community area, trip counts, mean fare and median trip
duration, through `sage-tfx ingest` and `sage-tfx query` on a fresh ledger.

    python -m sage_tfx.examples.taxi.statistics [--workdir DIR] [--csv FILE]
                                                [--unit-column taxi_id] [--epsilon 1]

The unit of the guarantee is the column the trips are ingested with. On Chicago's full trip
data it is `taxi_id`: every released number is then DP for adding or removing all trips of one
taxi within the blocks read. The sample that ships with tfx (15,002 trips) has no taxi id (nor
any other per-driver column: its `company` has 61 values, too few units for any statistic), so
`make taxi-statistics` runs with `--unit-column trip_id`, a row number this script adds: each
trip is its own unit, Sage's record-level guarantee.

Chicago's 77 community areas are public, so the query lists them (`public_groups`): every area
is released, none is selected from the data, and no budget goes to selection.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys

from sage_tfx.examples.taxi.stream import sample_path

COMMUNITY_AREAS = range(1, 78)
ADDED_UNIT = "trip_id"


def statistics_query(unit_is_trip: bool) -> str:
    # A trip touches one area with one row; a taxi touches several areas with many rows.
    bounds = "max_groups_contributed = 1, max_rows_contributed_per_group = 1" if unit_is_trip \
        else "max_groups_contributed = 4, max_rows_contributed_per_group = 8"
    areas = ", ".join(str(area) for area in COMMUNITY_AREAS)
    return (f"SELECT WITH ANONYMIZATION OPTIONS({bounds}, public_groups = ({areas})) "
            "pickup_community_area AS area, ANON_COUNT(*) AS trips, "
            "ANON_AVG(fare, 0, 60) AS mean_fare, "
            "ANON_MEDIAN(trip_seconds, 0, 3600) AS median_trip_seconds "
            "FROM taxi GROUP BY area")


def _with_trip_ids(source: str, target: str) -> None:
    with open(source, newline="") as reading, open(target, "w", newline="") as writing:
        rows, writer = csv.reader(reading), csv.writer(writing)
        writer.writerow([ADDED_UNIT] + next(rows))
        for number, row in enumerate(rows):
            writer.writerow([f"trip-{number}"] + row)


def ingest_trips(workdir: str, csv_path: str | None, unit_column: str) -> tuple[int, str]:
    """A fresh ledger in ``workdir`` with the trips (default: the sample inside tfx) ingested
    as the monthly blocks of table `taxi` (every column kept): (exit code, ledger path)."""
    from sage_tfx.cli import main as sage_tfx
    from sage_tfx.sage_access import BlockLedger

    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    trips = os.path.join(workdir, "taxi.csv")
    source = csv_path or sample_path()
    with open(source, newline="") as handle:
        header = next(csv.reader(handle))
    store = os.path.join(workdir, "ledger.sqlite")
    if unit_column == ADDED_UNIT and ADDED_UNIT not in header:
        _with_trip_ids(source, trips)
    elif unit_column in header:
        shutil.copyfile(source, trips)
    else:
        print(f"{source} has no column {unit_column!r} (the tfx sample has no taxi id); "
              f"use --unit-column {ADDED_UNIT} for a record-level release", file=sys.stderr)
        return 2, store
    BlockLedger.create(store)
    return sage_tfx([
        "ingest", "--store", store, "--csv", trips, "--unit-column", unit_column,
        "--time-column", "trip_start_timestamp", "--period", "month", "--start", "2013-01",
        "--end", "2017-01", "--types",
        "pickup_community_area:int,fare:float,trip_seconds:float,trip_start_hour:int",
        "--epsilon", "4", "--delta", "1e-5", "--out", os.path.join(workdir, "blocks")]), store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="out/taxi-statistics")
    parser.add_argument("--csv", help="the trips (default: the sample inside tfx)")
    parser.add_argument("--unit-column", default="taxi_id",
                        help=f"the privacy unit; {ADDED_UNIT} adds a row number (each trip its "
                             "own unit)")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    args = parser.parse_args(argv)

    from sage_tfx.cli import main as sage_tfx

    code, store = ingest_trips(args.workdir, args.csv, args.unit_column)
    if code:
        return code
    return sage_tfx(["query", "--store", store, "--window", "48", "--epsilon",
                     str(args.epsilon), "--delta", str(args.delta), "--out",
                     os.path.join(args.workdir, "release.csv"),
                     statistics_query(args.unit_column == ADDED_UNIT)])


if __name__ == "__main__":
    sys.exit(main())
