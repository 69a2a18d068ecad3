"""The README's main job: privacy-adaptive training on the Chicago Taxi stream.

    python -m sage_tfx.examples.taxi.run [--workdir DIR] [--pipelines adassp,dp_sgd]
                                         [--policy conserve|aggressive]

Starts a ledger, replays the first months of the taxi sample as blocks, then runs each pipeline
with the privacy-adaptive driver: one line per iteration, waiting for new monthly blocks when
the window must grow, until the validator accepts. Ends with the pushed models and the ledger.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time

import sage_tfx  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads)
from sage_tfx.pipelines.policy import PolicyName


def _quiet_logs() -> None:
    """TFX and Beam log every step; keep their errors. The lines a user reads (grant, per-epoch
    epsilon, the validator's decision) come from sage_tfx.console, which is not filtered here."""
    class ErrorsOnly(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return record.levelno >= logging.ERROR

    # A filter, not a level: TFX's launcher resets the absl logger's level at every step.
    for noisy in ("absl", "apache_beam", "tensorflow", "root"):
        logging.getLogger(noisy).addFilter(ErrorsOnly())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="out/taxi-demo")
    parser.add_argument("--pipelines", default="adassp,dp_sgd")
    parser.add_argument("--policy", choices=PolicyName.values(), default=PolicyName.CONSERVE)
    parser.add_argument("--initial-epsilon", type=float,
                        help="the first iteration's epsilon (default: the pipeline's "
                             "INITIAL_EPSILON in pipeline.py)")
    parser.add_argument("--min-window", type=int,
                        help="months the first iteration trains on (default: the pipeline's "
                             "MIN_WINDOW in pipeline.py); the database starts with that many")
    args = parser.parse_args(argv)
    if args.initial_epsilon is not None and not args.initial_epsilon > 0:
        parser.error(f"--initial-epsilon must be positive, got {args.initial_epsilon}")
    if args.min_window is not None and args.min_window < 1:
        parser.error(f"--min-window must be at least 1 month, got {args.min_window}")
    _quiet_logs()

    from sage_tfx.examples.taxi.pipeline import (BLOCK_DELTA, BLOCK_EPSILON, INITIAL_EPSILON,
                                                 MIN_WINDOW, SPECS, TaxiSource)
    from sage_tfx.pipelines.adaptive import Policy, run_adaptive
    from sage_tfx.sage_access import BlockLedger
    from sage_tfx.sage_access.accounting import AccountingMode
    from sage_tfx.sage_access.views import format_table, ledger_table

    chosen = [name.strip() for name in args.pipelines.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(SPECS))
    if unknown:
        parser.error(f"unknown pipeline(s) {unknown}; choose from {sorted(map(str, SPECS))}")
    shutil.rmtree(args.workdir, ignore_errors=True)
    results = {}
    for name in chosen:
        # Each pipeline gets its own replay of the stream and its own ledger, so either can be
        # run alone; pipelines sharing one stream's blocks are what benchmarks/workload_sim.py
        # shows.
        workdir = os.path.abspath(os.path.join(args.workdir, name))
        os.makedirs(workdir)
        store = os.path.join(workdir, "metadata.sqlite")
        BlockLedger.create(store, accounting=AccountingMode.BASIC, min_request_epsilon=0.05)
        source = TaxiSource(store, workdir)
        started = time.time()
        min_window = MIN_WINDOW[name] if args.min_window is None else args.min_window
        months = source.ingest(min_window)
        initial_epsilon = (INITIAL_EPSILON[name] if args.initial_epsilon is None
                           else args.initial_epsilon)
        policy = Policy(args.policy, initial_epsilon=initial_epsilon, min_window=min_window)
        spec = SPECS[name]()
        print(f"\n== taxi-{name}: privacy-adaptive training, policy {policy.name}, target "
              f"{spec.validation['metric']} {spec.validation['target']}\n"
              f"   database: {len(months)} monthly block(s) of the Chicago Taxi sample "
              f"({months[0]}..{months[-1]}), each with budget (epsilon {BLOCK_EPSILON}, "
              f"delta {BLOCK_DELTA}); one more arrives whenever the driver waits")
        result = run_adaptive(spec, policy, f"taxi-{name}", workdir, store, source)
        results[name] = result
        if result.pushed_model:
            print(f"   ACCEPT: model pushed to {result.pushed_model}")
        else:
            print(f"   {result.outcome}: {result.message}")
        print(f"\n   ledger after {time.time() - started:.0f} s (ML Metadata store {store}):")
        print(format_table(ledger_table(BlockLedger(store))))
    # ACCEPT, REJECT and TIMEOUT are all outcomes of privacy-adaptive training, not failures.
    print("\noutcomes: " + ", ".join(f"taxi-{name} {result.outcome} after "
                                     f"{len(result.iterations)} iteration(s)"
                                     for name, result in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
