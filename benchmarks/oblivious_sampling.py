"""One epoch of oblivious SWO and Poisson sampling against shuffle-and-split: time and memory.

    python benchmarks/oblivious_sampling.py --n N [--json] [--repeats R]

Records are N rows of 32 float32 features. SWO and shuffle-and-split use m = 256, Poisson
gamma = 256 / N. Each sampler runs as the pipeline runs it, on data brought to a public size
that is not N (sampling.to_size): SWO and shuffling to N - 1000 (a DP count below n: the data
is cut by an oblivious routing pass) and to N + 1000 (above n: padded); Poisson to
accounting.sized_for(N, eps_count = 0.1), which is always above n (padded).

Time: R runs of each (scheme, size) after one warm-up run, in one process, in wall-clock and in
CPU seconds of the process (page faults included; less sensitive to other processes on a
shared machine); each oblivious sampler's ratio is of medians, against shuffle-and-split
brought to the same size (the cut pass, oblivious in both, is in both).

Memory: each (scheme, size) runs in a fresh process that loads the dataset, resets the kernel's
peak-RSS counter (/proc/self/clear_refs), runs one epoch, and reads the peak (VmHWM). Working
memory = peak minus the RSS just before sampling, divided by the dataset's size: everything
sampling allocates, its output (the samples, their ids and flags) included.

Prints {"n", "dataset_mb", "repeats", "seconds": {"<scheme>_<cut|pad>": {"median", "min",
"max"}}, "ratio": {"<oblivious case>": x}, "max_ratio", the same three with suffix _cpu,
"memory_over_dataset": {"<scheme>_<cut|pad>": x}, "max_memory_over_dataset"}.
Targets (issue 35) at N = 1,000,000: ratios <= 2, working memory <= 2.5x the dataset.
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


def timings(run, repeats: int) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU seconds (this process, page faults included) of `repeats` runs after
    one warm-up run."""
    run()
    wall, cpu = [], []
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return wall, cpu


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


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
    measured = {case: timings(lambda: run_one(case.split("_")[0], records, size), args.repeats)
                for case, size in sizes(args.n).items()}
    result = {"n": args.n, "dataset_mb": round(records.nbytes / 2 ** 20, 1),
              "repeats": args.repeats}
    for clock, suffix in ((0, ""), (1, "_cpu")):
        medians = {case: statistics.median(values[clock]) for case, values in measured.items()}
        ratio = {case: round(value / medians["shuffle_" + case.split("_")[1]], 2)
                 for case, value in medians.items() if not case.startswith("shuffle")}
        result.update({f"seconds{suffix}": {case: spread(values[clock])
                                            for case, values in measured.items()},
                       f"ratio{suffix}": ratio, f"max_ratio{suffix}": max(ratio.values())})
    result["memory_over_dataset"] = memory
    result["max_memory_over_dataset"] = max(memory.values())
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
