"""Three monthly blocks of synthetic trips and the first two steps of every sage pipeline on them
(BlockExampleGen, then a BlockLedger grant), for the tests that run components after a grant."""
import csv
import datetime as dt
import os

from sage_tfx.components.block_example_gen import BlockExampleGen, month_schedule
from sage_tfx.components.block_ledger import BlockLedger as BlockLedgerComponent
from sage_tfx.sage_access import BlockLedger

MONTHS = ["2024-01", "2024-02", "2024-03"]
TYPES = {"trip_start_timestamp": "int", "trip_seconds": "int", "trip_miles": "float"}


def write_csv(directory, trips_per_month=40):
    os.makedirs(directory)
    with open(os.path.join(directory, "trips.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trip_start_timestamp", "trip_seconds", "trip_miles"])
        for month in MONTHS:
            first = dt.datetime.fromisoformat(f"{month}-01T00:00:00+00:00")
            for trip in range(trips_per_month):
                moment = first + dt.timedelta(minutes=(7 * 60 * 40 // trips_per_month) * trip + 60)
                # Duration grows with distance (200 s a mile) plus up to 10 s of jitter.
                miles = 0.5 + (trip % 40) / 10
                writer.writerow([int(moment.timestamp()), 100 + int(200 * miles) + trip * 7 % 11,
                                 miles])


def ingest_and_grant(root: str, store_path: str, trips_per_month: int = 40,
                     block_epsilon: float = 1.0, **grant_options):
    """The first two steps of every sage pipeline on three monthly blocks: BlockExampleGen
    registers the blocks, BlockLedger grants (0.4, 1e-7) on the two most recent unless
    grant_options say otherwise."""
    write_csv(os.path.join(root, "data"), trips_per_month)
    BlockLedger.create(store_path, min_request_epsilon=0.05)
    gen = BlockExampleGen(input_base=os.path.join(root, "data"), block_key="trip_start_timestamp",
                          block_by="month", ledger_store=store_path, block_epsilon=block_epsilon,
                          schedule_start=month_schedule(MONTHS[0], MONTHS[-1])[0],
                          schedule_end=month_schedule(MONTHS[0], MONTHS[-1])[1],
                          block_delta=1e-6, columns=TYPES)
    options = {"window": 2, "epsilon": 0.4, "delta": 1e-7, **grant_options}
    grant = BlockLedgerComponent(ledger_store=store_path, new_blocks=gen.outputs["examples"],
                                 **options)
    return gen, grant
