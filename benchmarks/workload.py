"""Model release time under load, per composition strategy (Sage §5.4, Fig. 8), on the real
BlockLedger.

    python benchmarks/workload.py [--quick] [--json] [--plot FILE.png]
                                  [--complexity inverse_epsilon|taxi_measured]

For each pipeline arrival rate, simulates the four strategies of workload_sim.py on a
Taxi-like stream (16,000 samples per hour) and prints

    {"arrival_rates_per_hour": [...], "strategies": {"query": {"mean_release_hours": [...],
     "unreleased_fraction": [...]}, "streaming": {...}, "block_aggressive": {...},
     "block_conserve": {...}}}

one list entry per rate, each the mean over `--seeds` independent workloads (seeds 1..N).
A pipeline not released within the horizon counts in unreleased_fraction, released at the
horizon. --quick simulates fewer hours and rates and one workload (under 60 s on this machine).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from workload_sim import COMPLEXITY_MODELS, STRATEGIES, WorkloadConfig, simulate

FULL = {"rates": (0.1, 0.3, 0.5, 0.7, 0.9, 1.2), "arrival_hours": 300, "drain_hours": 150,
        "seeds": 3}
QUICK = {"rates": (0.2, 0.5, 0.8), "arrival_hours": 80, "drain_hours": 40, "seeds": 1}


def sweep(rates, arrival_hours: int, drain_hours: int, seeds: int,
          complexity_model: str = "inverse_epsilon") -> dict:
    result = {"arrival_rates_per_hour": list(rates),
              "strategies": {s: {"mean_release_hours": [], "unreleased_fraction": []}
                             for s in STRATEGIES}}
    for rate in rates:
        config = WorkloadConfig(rate, arrival_hours=arrival_hours, drain_hours=drain_hours,
                                complexity_model=complexity_model)
        for strategy in STRATEGIES:
            outcomes = [simulate(strategy, config, seed) for seed in range(1, seeds + 1)]
            row = result["strategies"][strategy]
            row["mean_release_hours"].append(
                round(float(np.mean([o.mean_release_hours for o in outcomes])), 2))
            row["unreleased_fraction"].append(
                round(float(np.mean([o.unreleased_fraction for o in outcomes])), 4))
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for strategy, row in result["strategies"].items():
        axis.plot(result["arrival_rates_per_hour"], row["mean_release_hours"], marker="o",
                  label=strategy)
    axis.set_xlabel("pipeline arrivals per hour")
    axis.set_ylabel("mean model release time (hours)")
    axis.set_yscale("log")
    axis.legend()
    axis.set_title("Release time under load (Sage Fig. 8)")
    figure.tight_layout()
    figure.savefig(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    parser.add_argument("--plot", metavar="FILE.png")
    parser.add_argument("--seeds", type=int, help="workloads averaged per point "
                        "(default: 3, or 1 with --quick)")
    parser.add_argument("--complexity", choices=sorted(COMPLEXITY_MODELS),
                        default="inverse_epsilon", help="the pipelines' sample-complexity "
                        "model: synthetic n0 (1 + 0.1 / epsilon), or the taxi AdaSSP pipeline's "
                        "measured shape (benchmarks/taxi_sample_complexity.py)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    seeds = args.seeds or settings["seeds"]
    if seeds < 1:
        parser.error(f"--seeds must be >= 1, got {seeds}")
    result = sweep(settings["rates"], settings["arrival_hours"], settings["drain_hours"], seeds,
                   args.complexity)
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
