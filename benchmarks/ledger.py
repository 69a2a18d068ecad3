"""BlockLedger throughput and latency on an SQLite ML Metadata file. Prints JSON.

    python benchmarks/ledger.py [--quick]

* grants/second with 1, 4 and 8 processes granting on the same 30 blocks-wide ledger;
* median latency of a 30-block grant with 10 and with 10,000 blocks registered;
* median latency of the same grant after 2,000 earlier charges on those blocks (history growth).
Target (issue 2): <= 20 ms median at 10,000 blocks, no growth with the number of past charges.
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

from sage_tfx.sage_access import BlockIds, BlockLedger


def build(path: str, blocks: int, ceiling: float = 1e9) -> BlockLedger:
    ledger = BlockLedger.create(path, min_request_epsilon=1e-6)
    for index in range(blocks):
        ledger.add_block(f"b{index:05d}", ceiling, 0.5)
    return ledger


def grant_latencies_ms(ledger: BlockLedger, block_ids: list[str], grants: int) -> list[float]:
    latencies = []
    for _ in range(grants):
        started = time.perf_counter()
        ledger.request(BlockIds(block_ids), epsilon=1e-3, delta=0)
        latencies.append(1000 * (time.perf_counter() - started))
    return latencies


def _worker(args) -> int:
    path, seed, seconds = args
    import random

    rng = random.Random(seed)
    ledger = BlockLedger(path)
    ids = [b.block_id for b in ledger.blocks()]
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ledger.request(BlockIds(rng.sample(ids, 5)), epsilon=1e-3, delta=0)
        done += 1
    return done


def throughput(path: str, processes: int, seconds: float) -> float:
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        started = time.monotonic()
        done = sum(pool.map(_worker, [(path, seed, seconds) for seed in range(processes)]))
        return done / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and shorter runs")
    args = parser.parse_args()
    many = 1000 if args.quick else 10_000
    seconds = 2.0 if args.quick else 5.0
    result = {"machine_cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as directory:
        for blocks in (10, many):
            path = os.path.join(directory, f"latency-{blocks}.sqlite")
            ledger = build(path, blocks)
            width = min(30, blocks)
            ids = [f"b{index:05d}" for index in range(blocks - width, blocks)]
            grant_latencies_ms(ledger, ids, 5)  # warm up
            result[f"median_grant_ms_{width}_blocks_of_{blocks}"] = round(
                statistics.median(grant_latencies_ms(ledger, ids, 50)), 2)
            if blocks == many:
                grant_latencies_ms(ledger, ids, 2000)
                result[f"median_grant_ms_{width}_blocks_of_{blocks}_after_2000_charges"] = round(
                    statistics.median(grant_latencies_ms(ledger, ids, 50)), 2)
        path = os.path.join(directory, "throughput.sqlite")
        build(path, 30)
        for processes in (1, 4, 8):
            result[f"grants_per_second_{processes}_processes"] = round(
                throughput(path, processes, seconds), 1)
        result["audit_problems"] = len(BlockLedger(path).audit().problems)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
