"""One epoch of oblivious SWO and Poisson sampling against shuffle-and-split: time and memory.

    python benchmarks/oblivious_sampling.py --n N [--json] [--repeats R]

Records are N rows of 32 float32 features. SWO and shuffle-and-split use m = 256, Poisson
gamma = 256 / N. Each sampler runs as the pipeline runs it, on data brought to a public size
that is not N (sampling.to_size): SWO and shuffling to N - 1000 (a DP count below n: the data
is cut by an oblivious routing pass) and to N + 1000 (above n: padded); Poisson to
accounting.sized_for(N, eps_count = 0.1), which is always above n (padded).

Time: the median of R runs of each (scheme, size) after one warm-up run, in one process; each
oblivious sampler's ratio is against shuffle-and-split brought to the same size (the cut pass,
oblivious in both, is in both).

Memory: each (scheme, size) runs in a fresh process that loads the dataset, resets the kernel's
peak-RSS counter (/proc/self/clear_refs), runs one epoch, and reads the peak (VmHWM). Working
memory = peak minus the RSS just before sampling, divided by the dataset's size: everything
sampling allocates, its output (the samples, their ids and flags) included.

Prints {"n", "dataset_mb", "seconds": {"<scheme>_<cut|pad>": s}, "ratio": {"<oblivious
case>": x}, "max_ratio", "memory_over_dataset": {"<scheme>_<cut|pad>": x},
"max_memory_over_dataset"}.
Targets (issue 17) at N = 1,000,000: ratios <= 5, working memory <= 3x the dataset.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

FEATURES = 32
SAMPLE_SIZE = 256
COUNT_EPSILON = 0.1
OFFSET = 1000  # how far the sizes of the cut and pad cases lie from n


def sizes(n: int) -> dict[str, int]:
    from sage_tfx.components.oblivious_sample_gen import accounting
    poisson_size, _ = accounting.sized_for("poisson", n, COUNT_EPSILON)
    return {"swo_cut": n - OFFSET, "swo_pad": n + OFFSET, "shuffle_cut": n - OFFSET,
            "shuffle_pad": n + OFFSET, "poisson_pad": poisson_size}


def run_one(scheme: str, records: np.ndarray, size: int):
    from sage_tfx.components.oblivious_sample_gen.sampling import (samples_poisson, samples_swo,
                                                                   shuffle_and_split)
    if scheme == "poisson":
        return samples_poisson(records, SAMPLE_SIZE / records.shape[0], size=size)
    sampler = samples_swo if scheme == "swo" else shuffle_and_split
    return sampler(records, SAMPLE_SIZE, size=size)


def dataset(n: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, FEATURES), dtype=np.float32)


def status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_memory(case: str, n: int) -> float:
    """In this process: working memory of one epoch of `case`, in units of the dataset."""
    records = dataset(n)
    run_one("swo", records[:1000], 1000)  # imports and first-call allocations, not sampling's
    scheme, size = case.split("_")[0], sizes(n)[case]
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current RSS
    before_kb = status_kb("VmRSS")
    samples = run_one(scheme, records, size)
    peak_kb = status_kb("VmHWM")
    del samples
    return (peak_kb - before_kb) * 1024 / records.nbytes


def median_seconds(run, repeats: int) -> float:
    run()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # the child process's case
    args = parser.parse_args()
    if args.memory_of:
        print(measure_memory(args.memory_of, args.n))
        return

    memory = {}
    for case in sizes(args.n):
        child = subprocess.run([sys.executable, __file__, "--n", str(args.n), "--memory-of", case],
                               capture_output=True, text=True, check=True)
        memory[case] = round(float(child.stdout.strip().splitlines()[-1]), 2)

    records = dataset(args.n)
    seconds = {case: round(median_seconds(lambda: run_one(case.split("_")[0], records, size),
                                          args.repeats), 4)
               for case, size in sizes(args.n).items()}
    ratio = {case: round(value / seconds["shuffle_" + case.split("_")[1]], 2)
             for case, value in seconds.items() if not case.startswith("shuffle")}
    result = {"n": args.n, "dataset_mb": round(records.nbytes / 2 ** 20, 1), "seconds": seconds,
              "ratio": ratio, "max_ratio": max(ratio.values())}
    result["memory_over_dataset"] = memory
    result["max_memory_over_dataset"] = max(memory.values())
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
