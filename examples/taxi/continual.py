"""The taxi trips replayed as a stream: a DP count of trips per community area, refreshed 48
times over 2013-2016 (about monthly), for one grant (`sage-tfx stream`, the DP-SQLP operator).

    python -m sage_tfx.examples.taxi.continual [--workdir DIR] [--epsilon 1] [--delta 1e-6]
                                               [--unit-column trip_id]

The trips are ingested as the monthly blocks of table `taxi` (as `make taxi-statistics` does),
then written as one CSV file per month under DIR/arriving/ (the files a stream delivers, in name
order) and replayed: the window is the 48 monthly blocks, cut into 48 equal micro-batches of
about 30.4 days (the public trigger times: equal parts of the window, which calendar months are
not), the key `pickup_community_area`.

The unit. On Chicago's full trip data it is `taxi_id`: each release is then DP for all trips of
one taxi within the window's blocks. The sample that ships with tfx has no taxi id, so, as in
`make taxi-statistics` (statistics.py), the unit is `trip_id`, a row number added here: each
trip is its own unit and contributes one record (--contribution-limit 1).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

from sage_tfx.examples.taxi.statistics import ADDED_UNIT, ingest_trips
from sage_tfx.examples.taxi.stream import _month

MONTHS = [f"{year}-{month:02d}" for year in range(2013, 2017) for month in range(1, 13)]
TIME_COLUMN = "trip_start_timestamp"
KEY_COLUMN = "pickup_community_area"


def write_arriving_files(trips_csv: str, directory: str) -> None:
    """One CSV per month of the trips' start time (name order = arrival order)."""
    os.makedirs(directory)
    writers, handles = {}, []
    with open(trips_csv, newline="") as reading:
        rows = csv.reader(reading)
        header = next(rows)
        at = header.index(TIME_COLUMN)
        for row in rows:
            month = _month(int(row[at])) if row[at].strip().isdigit() else "undated"
            if month not in writers:
                handle = open(os.path.join(directory, f"{month}.csv"), "w", newline="")
                handles.append(handle)
                writers[month] = csv.writer(handle)
                writers[month].writerow(header)
            writers[month].writerow(row)
    for handle in handles:
        handle.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="out/taxi-stream")
    parser.add_argument("--csv", help="the trips (default: the sample inside tfx)")
    parser.add_argument("--unit-column", default=ADDED_UNIT,
                        help=f"the privacy unit (default {ADDED_UNIT}, a row number: the sample "
                             "has no taxi_id)")
    parser.add_argument("--contribution-limit", type=int, default=1,
                        help="trips a unit contributes over the window (default 1: a trip)")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    args = parser.parse_args(argv)

    from sage_tfx.cli import main as sage_tfx

    code, store = ingest_trips(args.workdir, args.csv, args.unit_column)
    if code:
        return code
    arriving = os.path.join(args.workdir, "arriving")
    write_arriving_files(os.path.join(args.workdir, "taxi.csv"), arriving)
    return sage_tfx([
        "stream", "--store", store, "--window-blocks", ",".join(f"taxi.{m}" for m in MONTHS),
        "--epsilon", str(args.epsilon), "--delta", str(args.delta), "--input", arriving,
        # The unit and time columns are the table's (ingest recorded them): not repeated.
        "--micro-batches", str(len(MONTHS)), "--key-column", KEY_COLUMN,
        "--contribution-limit", str(args.contribution_limit),
        "--out", os.path.join(args.workdir, "releases")])


if __name__ == "__main__":
    sys.exit(main())
