"""The empirical privacy auditor on every shipped mechanism at a larger trial count.

    python benchmarks/audit.py [--trials 100000] [--confidence 0.95] [--json]
                               [--mechanisms a,b]

Prints one row per mechanism: its claim, the auditor's lower bound on epsilon, the confidence,
runs per neighbouring input, and the wall-clock seconds (TensorFlow's import lands in the first
mechanism that needs it). --json: one JSON object per line.
"""
from __future__ import annotations

import argparse
import json
import time

from sage_tfx.audit import mechanisms

# Mechanisms that make one release per call (SLAed, dp_count, AdaSSP: 0.3-1 ms of OpenDP per
# run) get a fifth of the trials; the others draw every run in one vectorised call.
PER_CALL_TRIALS_SHARE = 0.2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100_000)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mechanisms", help="comma-separated names (default: every one)")
    args = parser.parse_args()
    audits = mechanisms.shipped()
    names = args.mechanisms.split(",") if args.mechanisms else list(audits)
    unknown = sorted(set(names) - set(audits))
    if unknown:
        parser.error(f"unknown mechanism(s) {', '.join(unknown)}; choose from {', '.join(audits)}")
    if not args.json:
        print("| mechanism | claimed eps | claimed delta | eps lower bound | confidence | trials "
              "| seconds |\n|---|---|---|---|---|---|---|")
    for name in names:
        audit = audits[name]
        trials = args.trials if audit.vectorised else int(args.trials * PER_CALL_TRIALS_SHARE)
        start = time.perf_counter()
        result = audit.run(trials, args.confidence)
        row = dict(result.as_dict(), seconds=round(time.perf_counter() - start, 1))
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"| {name} | {row['claimed_epsilon']:.3f} | {row['claimed_delta']:g} | "
                  f"{row['epsilon_lower_bound']:.3f} | {row['confidence']} | {trials} | "
                  f"{row['seconds']} |", flush=True)


if __name__ == "__main__":
    main()
