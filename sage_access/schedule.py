"""Blocks keyed by a public attribute (Sage §4.4): calendar months, days or hours of a timestamp,
or fixed-width ranges of an integer user id, and the public schedule of a stream's blocks.

Shared by BlockExampleGen (components/block_example_gen) and `sage-tfx ingest`
(dp_statistics/ingest.py); no TensorFlow here, so the CLI starts fast.
"""
from __future__ import annotations

import datetime as dt

TIME_UNITS = ("month", "day", "hour")


def block_of(value: float, block_by: str, users_per_block: int) -> tuple[str, int, str, str]:
    """(block id, span, start, end) of a key value. Spans increase with the key."""
    if block_by == "users":
        index = int(value) // users_per_block
        low, high = index * users_per_block, (index + 1) * users_per_block
        return f"users-{low:09d}-{high - 1:09d}", index, str(low), str(high)
    moment = dt.datetime.fromtimestamp(int(value), tz=dt.timezone.utc)
    if block_by == "month":
        start = moment.replace(day=1, hour=0, minute=0, second=0)
        end = (start + dt.timedelta(days=32)).replace(day=1)
        return (start.strftime("%Y-%m"), start.year * 12 + start.month - 1, start.isoformat(),
                end.isoformat())
    if block_by == "day":
        start = moment.replace(hour=0, minute=0, second=0)
        end = start + dt.timedelta(days=1)
        return (start.strftime("%Y-%m-%d"), int(start.timestamp()) // 86400, start.isoformat(),
                end.isoformat())
    start = moment.replace(minute=0, second=0)
    end = start + dt.timedelta(hours=1)
    return (start.strftime("%Y-%m-%dT%H"), int(start.timestamp()) // 3600, start.isoformat(),
            end.isoformat())


MAX_SCHEDULED_BLOCKS = 100_000


def schedule(start: int, end: int, block_by: str, users_per_block: int) -> list[tuple]:
    """The blocks (id, span, start, end) of the public key range [start, end), in key order;
    both ends must be block boundaries."""
    blocks, value = [], start
    while value < end:
        block = block_of(value, block_by, users_per_block)
        if not blocks and _boundary(block, block_by) != value:
            raise ValueError(f"schedule_start {start} is not the start of a {block_by} block "
                             f"(that block starts at {_boundary(block, block_by)})")
        blocks.append(block)
        value = _boundary(block, block_by, end=True)
        if value > end:
            raise ValueError(f"schedule_end {end} is not the end of a {block_by} block (the "
                             f"last block ends at {value})")
        if len(blocks) > MAX_SCHEDULED_BLOCKS:
            raise ValueError(f"the schedule [{start}, {end}) holds more than "
                             f"{MAX_SCHEDULED_BLOCKS} blocks")
    if not blocks:
        raise ValueError(f"the schedule [{start}, {end}) holds no block")
    return blocks


def _boundary(block: tuple, block_by: str, end: bool = False) -> int:
    text = block[3] if end else block[2]
    if block_by == "users":
        return int(text)
    return int(dt.datetime.fromisoformat(text).timestamp())
