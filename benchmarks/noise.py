"""Draws per second of each sage_tfx.mechanisms mechanism for 10^6 draws in one vectorised call.

    python benchmarks/noise.py [--draws N] [--json]
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
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draws", type=int, default=10 ** 6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rates = {}
    for name, run in MECHANISMS.items():
        start = time.perf_counter()
        run(args.draws)
        rates[name] = args.draws / (time.perf_counter() - start)
    if args.json:
        print(json.dumps({"draws": args.draws, "draws_per_second": rates}))
    else:
        for name, rate in rates.items():
            print(f"{name:18s} {rate:12,.0f} draws/s")


if __name__ == "__main__":
    main()
