"""Draws per second of each sage_tfx.mechanisms mechanism for 10^6 draws in one vectorised call,
and the CPU cost of one short call (two values: a validator's count and sum).

    python benchmarks/noise.py [--draws N] [--repeats R] [--json]

``draws_per_second`` is wall clock, the best of R runs; ``cpu_draws_per_second`` counts this
process's CPU time only, so it does not fall when other processes load the machine (on a loaded
2-core machine the wall rate is several times lower). The selection rules draw one value per
partition (the truncated geometric draws one exact Bernoulli bit per partition below its sure
count; here all partitions hold 5 units).
"""
import argparse
import json
import time

import numpy as np

from sage_tfx import mechanisms

MECHANISMS = {
    "laplace": lambda n: mechanisms.laplace(np.zeros(n), l1_sensitivity=1.0, epsilon=1.0),
    "discrete_laplace": lambda n: mechanisms.discrete_laplace(np.zeros(n, np.int64),
                                                              l1_sensitivity=1, epsilon=1.0),
    "gaussian": lambda n: mechanisms.gaussian(np.zeros(n), l2_sensitivity=1.0, epsilon=1.0,
                                              delta=1e-6),
    "discrete_gaussian": lambda n: mechanisms.discrete_gaussian(
        np.zeros(n, np.int64), l2_sensitivity=1.0, epsilon=1.0, delta=1e-6),
    "laplace_threshold": lambda n: mechanisms.laplace_threshold(
        np.full(n, 5), max_partitions_per_unit=4, epsilon=1.0, delta=1e-6),
    "gaussian_threshold": lambda n: mechanisms.gaussian_threshold(
        np.full(n, 5), max_partitions_per_unit=4, epsilon=1.0, delta=1e-6),
    "truncated_geometric_selection": lambda n: mechanisms.truncated_geometric_selection(
        np.full(n, 5), max_partitions_per_unit=4, epsilon=1.0, delta=1e-6),
}


def _timed(run, size):
    wall, cpu = time.perf_counter(), time.process_time()
    run(size)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draws", type=int, default=10 ** 6)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    wall_rates, cpu_rates, small_call_us = {}, {}, {}
    for name, run in MECHANISMS.items():
        run(2)  # calibration and measurement built once, as in a long-running process
        small = [_timed(run, 2)[1] for _ in range(20)]
        small_call_us[name] = 1e6 * float(np.median(small))
        runs = [_timed(run, args.draws) for _ in range(args.repeats)]
        wall_rates[name] = args.draws / min(wall for wall, _ in runs)
        cpu_rates[name] = args.draws / min(cpu for _, cpu in runs)
    if args.json:
        print(json.dumps({"draws": args.draws, "repeats": args.repeats,
                          "draws_per_second": wall_rates, "cpu_draws_per_second": cpu_rates,
                          "small_call_cpu_us": small_call_us}))
    else:
        print(f"{'mechanism':30s} {'wall draws/s':>14s} {'CPU draws/s':>14s} {'2-value call':>14s}")
        for name in MECHANISMS:
            print(f"{name:30s} {wall_rates[name]:14,.0f} {cpu_rates[name]:14,.0f} "
                  f"{small_call_us[name]:11,.0f} us")


if __name__ == "__main__":
    main()
