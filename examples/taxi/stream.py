"""The real Chicago Taxi sample that ships inside the tfx package, replayed as a monthly stream.

The sample (15,002 trips, 2013-2016) is read from the installed package, never copied into the
repository. `TaxiStream.release(months)` writes the next months' trips as one CSV for
BlockExampleGen, which cuts them into monthly blocks; trips without a duration are dropped at
ingestion (the label is missing), and only the columns the task uses are kept.
"""
from __future__ import annotations

import csv
import datetime as dt
import os
from dataclasses import dataclass, field

# The columns of the released CSV and their types (BlockExampleGen's `columns`).
COLUMNS = {"trip_start_timestamp": "int", "trip_start_hour": "int", "trip_miles": "float",
           "trip_seconds": "int"}


def sample_path() -> str:
    import tfx
    path = os.path.join(os.path.dirname(tfx.__file__), "examples", "chicago_taxi_pipeline",
                        "data", "simple", "data.csv")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the Chicago Taxi sample is not in the installed tfx ({path})")
    return path


def _month(timestamp: int) -> str:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.timezone.utc).strftime("%Y-%m")


@dataclass
class TaxiStream:
    """Months of trips in time order; `release` hands out the next ones."""
    trips_by_month: dict[str, list[tuple]] = field(default_factory=dict)
    released: int = 0

    @classmethod
    def load(cls, path: str | None = None) -> "TaxiStream":
        trips: dict[str, list[tuple]] = {}
        with open(path or sample_path(), newline="") as handle:
            for row in csv.DictReader(handle):
                if not all(row[column] for column in COLUMNS):
                    continue
                timestamp = int(row["trip_start_timestamp"])
                trips.setdefault(_month(timestamp), []).append(
                    (timestamp, int(row["trip_start_hour"]), float(row["trip_miles"]),
                     int(float(row["trip_seconds"]))))
        return cls(dict(sorted(trips.items())))

    @property
    def months(self) -> list[str]:
        return list(self.trips_by_month)

    def remaining(self) -> int:
        return len(self.trips_by_month) - self.released

    def release(self, months: int, directory: str) -> list[str]:
        """Write the next `months` months to `directory`/trips.csv; returns their names."""
        if months < 1 or months > self.remaining():
            raise ValueError(f"cannot release {months} month(s): {self.remaining()} remain")
        names = self.months[self.released:self.released + months]
        os.makedirs(directory, exist_ok=False)
        with open(os.path.join(directory, "trips.csv"), "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(COLUMNS)
            for name in names:
                for timestamp, hour, miles, seconds in self.trips_by_month[name]:
                    writer.writerow([timestamp, hour, f"{miles:.2f}", seconds])
        self.released += months
        return names
