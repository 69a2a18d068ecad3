"""BlockLedger throughput and latency on ML Metadata: an SQLite file or MySQL (MariaDB).

    python benchmarks/ledger.py [--backend sqlite|mysql] [--quick] [--json]

* grants/second with 1, 4, 8 and 16 processes granting at once: 5 random blocks of the same 30
  (grants overlap: optimistic concurrency makes the loser redo its work) and, `_own_blocks`,
  each process on 5 blocks of its own (no conflicts: what the backend's locking allows); and
  how many attempts were re-run per grant (`retries_per_grant_*`: a concurrent writer won, or
  the database rolled back a deadlock or a lock wait);
* median latency of a 30-block grant with 10 and with 10,000 blocks registered;
* median latency of the same grant after 2,000 earlier charges on those blocks (history growth;
  `--charges N` for another number, 0 to leave it out);
* the CPU time one such grant costs, client and database server together (`cpu_ms_per_grant_*`):
  unlike wall-clock figures, it hardly depends on what else loads the machine;
* on MySQL, the queries one such grant sends the server (`sql_round_trips_per_grant_*`, counted
  in the server's general log, nothing else running on it: MariaDB.round_trips), each a round
  trip (statements sent together in one batch count once).
Targets: issue 2 (SQLite): <= 20 ms median at 10,000 blocks, no growth with past charges.
Issue 31 (MySQL): grants/s grows with processes up to the core count and is at least 3x SQLite's
at 8 processes; latency <= 10 ms and flat in history. Issue 47: <= 20 ms median at 10,000 blocks
on MySQL, 8 processes on overlapping blocks at least 3x SQLite.
`--processes 1,8` measures throughput with only those numbers of processes.
`--backend mysql` starts a throwaway MariaDB (tests/support/mariadb.py) in a temporary directory
and stops it at the end; each measurement uses a database of its own.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from sage_tfx.sage_access import BlockIds, BlockLedger
from sage_tfx.sage_access.ledger import NewBlock

REPO_ROOT = Path(__file__).resolve().parents[1]
PROCESSES = (1, 4, 8, 16)


def build(path: str, blocks: int, ceiling: float = 1e9) -> BlockLedger:
    """A ledger of `blocks` blocks, registered 500 at a time (the blocks are the same as added
    one by one; on MySQL that took minutes at 10,000)."""
    ledger = BlockLedger.create(path, min_request_epsilon=1e-6)
    for first in range(0, blocks, 500):
        ledger.add_blocks([NewBlock(f"b{index:05d}", ceiling, 0.5)
                           for index in range(first, min(blocks, first + 500))])
    return ledger


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def grant_cpu_ms(ledger: BlockLedger, block_ids: list[str], grants: int,
                 server_pid: Optional[int]) -> float:
    """CPU milliseconds one grant costs, client and database server together: what a grant
    takes on an idle machine, whatever else loads this one (wall-clock latency does not say)."""
    pids = [os.getpid()] + ([server_pid] if server_pid else [])
    before = sum(cpu_seconds(pid) for pid in pids)
    grant_latencies_ms(ledger, block_ids, grants)
    return 1000 * (sum(cpu_seconds(pid) for pid in pids) - before) / grants


def grant_latencies_ms(ledger: BlockLedger, block_ids: list[str], grants: int) -> list[float]:
    latencies = []
    for _ in range(grants):
        started = time.perf_counter()
        ledger.request(BlockIds(block_ids), epsilon=1e-3, delta=0)
        latencies.append(1000 * (time.perf_counter() - started))
    return latencies


_start_together = None  # each pool worker's handle on the shared barrier (_join)


def _join(barrier) -> None:
    global _start_together
    _start_together = barrier


def _worker(args) -> tuple[int, float, int]:
    """Grants of 5 blocks for `seconds`: random ones of the ledger's (overlapping other
    workers'), or with `own_blocks` the worker's own 5 (no conflicts). Starts when every worker
    has opened the ledger, so process start-up (seconds on a loaded machine) is not counted."""
    path, seed, seconds, own_blocks = args
    import random

    rng = random.Random(seed)
    ledger = BlockLedger(path)
    ids = [b.block_id for b in ledger.blocks()]
    _start_together.wait()
    started = time.monotonic()
    done = 0
    while time.monotonic() - started < seconds:
        chosen = ids[5 * seed:5 * seed + 5] if own_blocks else rng.sample(ids, 5)
        ledger.request(BlockIds(chosen), epsilon=1e-3, delta=0)
        done += 1
    return done, time.monotonic() - started, ledger.retries


def throughput(path: str, processes: int, seconds: float,
               own_blocks: bool) -> tuple[float, float]:
    """Grants per second of `processes` workers granting at once (the sum of their rates), and
    the attempts re-run per grant (a concurrent writer won, or a deadlock or lock wait was
    rolled back: BlockLedger.retries)."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes, initializer=_join,
                      initargs=(context.Barrier(processes),)) as pool:
        rates = pool.map(_worker, [(path, seed, seconds, own_blocks)
                                   for seed in range(processes)])
    return (sum(done / elapsed for done, elapsed, _ in rates),
            sum(retries for *_, retries in rates) / max(1, sum(done for done, *_ in rates)))


def measure(new_store, many: int, seconds: float, server_pid: Optional[int] = None,
            processes_counts=PROCESSES, round_trips: Optional[Callable] = None,
            charges: int = 2000) -> dict:
    """The figures on stores made by `new_store(name)` (a path or a mysql:// spec; the
    database server's process id and its `round_trips` counter, if there is one), with
    throughput for each of `processes_counts`, and latency after `charges` charges (none: 0)."""
    result = {}
    for blocks in (10, many):
        ledger = build(new_store(f"latency{blocks}"), blocks)
        width = min(30, blocks)
        ids = [f"b{index:05d}" for index in range(blocks - width, blocks)]
        grant_latencies_ms(ledger, ids, 5)  # warm up
        result[f"median_grant_ms_{width}_blocks_of_{blocks}"] = round(
            statistics.median(grant_latencies_ms(ledger, ids, 50)), 2)
        if blocks == many:
            result[f"cpu_ms_per_grant_{width}_blocks_of_{blocks}"] = round(
                grant_cpu_ms(ledger, ids, 100, server_pid), 2)
            if round_trips is not None:
                with round_trips() as counted:
                    grant_latencies_ms(ledger, ids, 10)
                result[f"sql_round_trips_per_grant_{width}_blocks_of_{blocks}"] = (
                    counted[0] / 10)
            if not charges:
                continue
            made = 5 + 50 + 100 + (10 if round_trips is not None else 0)  # the charges above
            grant_latencies_ms(ledger, ids, max(0, charges - made))
            result[f"median_grant_ms_{width}_blocks_of_{blocks}_after_{charges}_charges"] = round(
                statistics.median(grant_latencies_ms(ledger, ids, 50)), 2)
            result[f"cpu_ms_per_grant_{width}_blocks_of_{blocks}_after_{charges}_charges"] = round(
                grant_cpu_ms(ledger, ids, 100, server_pid), 2)
    for processes in processes_counts:  # a fresh ledger each: every run starts from the same history
        for own_blocks, label in ((False, ""), (True, "_own_blocks")):
            store = new_store(f"throughput{processes}{label}")
            build(store, 5 * max(PROCESSES) if own_blocks else 30)
            key = f"grants_per_second_{processes}_processes{label}"
            try:
                rate, retries = throughput(store, processes, seconds, own_blocks)
                result[key] = round(rate, 1)
                result[f"retries_per_grant_{processes}_processes{label}"] = round(retries, 3)
            except Exception as error:  # a backend that cannot take this many writers: say how
                result[key] = None
                result[f"error_{processes}_processes{label}"] = f"{type(error).__name__}: {error}"
            problems = len(BlockLedger(store).audit().problems)
            result["audit_problems"] = result.get("audit_problems", 0) + problems
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("sqlite", "mysql"), default="sqlite")
    parser.add_argument("--quick", action="store_true", help="fewer blocks and shorter runs")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--processes", default=",".join(map(str, PROCESSES)),
                        help="numbers of processes to measure throughput with (default %(default)s)")
    parser.add_argument("--charges", type=int, default=2000,
                        help="latency after this many charges of the 30 blocks (0: not measured)")
    args = parser.parse_args()
    processes = tuple(int(count) for count in args.processes.split(","))
    many = 1000 if args.quick else 10_000
    seconds = 2.0 if args.quick else 5.0
    result = {"backend": args.backend, "machine_cores": os.cpu_count(),
              "load_average_1min_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory() as directory:
        if args.backend == "sqlite":
            result.update(measure(lambda name: os.path.join(directory, f"{name}.sqlite"),
                                  many, seconds, processes_counts=processes,
                                  charges=args.charges))
        else:
            sys.path.insert(0, str(REPO_ROOT / "tests"))
            from support.mariadb import MariaDB

            server = MariaDB(Path(directory) / "mariadb").start()
            try:
                result.update(measure(server.store, many, seconds, server.process.pid,
                                      processes, server.round_trips, args.charges))
            finally:
                server.stop()
    result["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        for key, value in result.items():
            print(f"{key:60} {value}")


if __name__ == "__main__":
    main()
