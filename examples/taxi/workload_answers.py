"""The taxi example's counting-query workloads, answered by the matrix mechanism from the trips
ingested as ledger blocks (every column kept, unlike the demo's training stream).

    python -m sage_tfx.examples.taxi.workload_answers [--workdir DIR] [--csv FILE]
                                                      [--epsilon 0.5] [--delta 1e-6]

`make taxi-workloads` runs it: `sage-tfx ingest` of the trips (as `make taxi-statistics`, each
trip its own unit on the tfx sample), then one `sage-tfx workload-answer` grant per workload in
examples/taxi/workloads: all ranges of the trip-duration histogram (durations.csv) and the
2-way marginals of (hour, pickup community area, payment type) (hour_area_payment.csv). Each
grant spends (epsilon, delta) on all 48 monthly blocks; the answers are DP for adding or
removing one trip.
"""
from __future__ import annotations

import argparse
import os
import sys

from sage_tfx.examples.taxi.statistics import ADDED_UNIT, ingest_trips

WORKLOADS = {"trip_durations.json": "durations.csv",
             "hour_area_payment.json": "hour_area_payment.csv"}
MONTHS = 48


def workload_path(name: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads", name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="out/taxi-workloads")
    parser.add_argument("--csv", help="the trips (default: the sample inside tfx)")
    parser.add_argument("--unit-column", default=ADDED_UNIT,
                        help=f"the privacy unit (default {ADDED_UNIT}: each trip its own)")
    parser.add_argument("--epsilon", type=float, default=0.5, help="per workload")
    parser.add_argument("--delta", type=float, default=1e-6, help="per workload")
    args = parser.parse_args(argv)

    from sage_tfx.cli import main as sage_tfx

    code, store = ingest_trips(args.workdir, args.csv, args.unit_column)
    for spec, out in WORKLOADS.items():
        if code:
            return code
        code = sage_tfx(["workload-answer", "--store", store, "--window", str(MONTHS),
                         "--epsilon", str(args.epsilon), "--delta", str(args.delta),
                         "--spec", workload_path(spec), "--out",
                         os.path.join(args.workdir, out), "--pipeline", "taxi-workloads"])
    return code


if __name__ == "__main__":
    sys.exit(main())
