"""How much data the taxi AdaSSP pipeline needs at each epsilon: the measured curve behind the
workload simulator's "taxi_measured" complexity model (benchmarks/workload_sim.py).

    python benchmarks/taxi_sample_complexity.py [--quick] [--json]

Runs single iterations of the real taxi AdaSSP pipeline (BlockExampleGen, DPTransform,
DPTrainer, SLAedValidator under LocalDagRunner, each on a fresh ledger) at windows (months) x
epsilons x seeds, and records the validator's slack: its upper bound on the MSE minus the DP MSE.
The model is ACCEPTed when DP MSE + slack is under the target, so the slack is what more data or
more budget buys down.

The SLAed loss test's slack on n records at epsilon has the form c1 / sqrt(n) + c2 / (n eps)
(sampling error plus the Laplace corrections; see ValidationBoundComplexity), which is linear in
(c1, c2): least squares over the runs gives both (fit_validation_bound), with n the window's
records in all splits
(the unit in which the simulator counts samples). The ratio c2 / c1, in sqrt(samples), is the
`dp_cost` of ValidationBoundComplexity: how steeply the data a pipeline needs grows as epsilon
shrinks. Prints

    {"runs": [{"window", "epsilon", "seed", "records", "outcome", "dp_mse", "slack"}, ...],
     "c1": ..., "c2": ..., "dp_cost": c2 / c1, "max_relative_error": ...}

--quick runs 4 iterations instead of 24 (30 s here; the full run 2m20s).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from sage_tfx.components import PrivateExamples
from sage_tfx.components.block_example_gen.constants import BLOCK_ID
from sage_tfx.examples.taxi.pipeline import TaxiSource, adassp_spec
from sage_tfx.pipelines.adaptive import Policy, run_adaptive
from sage_tfx.pipelines.policy import PolicyName
from workload_sim import fit_validation_bound
from sage_tfx.sage_access import BlockLedger, connect

FULL = {"windows": (12, 24, 36), "epsilons": (0.25, 0.5, 1.0, 2.0), "seeds": (1, 2)}
QUICK = {"windows": (12, 36), "epsilons": (0.25, 2.0), "seeds": (1,)}


def window_records(store_path: str) -> int:
    """Records in every block ingested so far, all splits, counted by reading the blocks'
    TFRecords. Blocks carry no counts (an exact count in ML Metadata would be a release); this
    benchmark is a trusted offline analysis that prints figures, not a release, so it may count."""
    import tensorflow as tf

    blocks = {examples.custom_properties[BLOCK_ID].string_value: examples.uri
              for examples in connect(store_path).get_artifacts_by_type(PrivateExamples.TYPE_NAME)
              if BLOCK_ID in examples.custom_properties}
    files = [path for uri in blocks.values()
             for path in tf.io.gfile.glob(os.path.join(uri, "Split-*", "*"))]
    return sum(1 for _ in tf.data.TFRecordDataset(files, compression_type="GZIP"))


def one_iteration(window: int, epsilon: float, seed: int, workdir: str) -> dict:
    store = os.path.join(workdir, "metadata.sqlite")
    BlockLedger.create(store)
    source = TaxiSource(store, workdir)
    source.ingest(window)
    result = run_adaptive(adassp_spec(seed=seed),
                          Policy(PolicyName.CONSERVE, initial_epsilon=epsilon, min_window=window,
                                 max_iterations=1),
                          "taxi-adassp", os.path.join(workdir, "run"), store, source,
                          report=lambda _: None)
    iteration = result.iterations[0]
    return {"window": window, "epsilon": epsilon, "seed": seed,
            "records": window_records(store), "outcome": iteration.outcome,
            "dp_mse": iteration.dp_metric, "slack": iteration.upper_bound - iteration.dp_metric}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    args = parser.parse_args(argv)
    grid = QUICK if args.quick else FULL
    runs = []
    with tempfile.TemporaryDirectory(prefix="taxi-complexity-") as root:
        for window in grid["windows"]:
            for epsilon in grid["epsilons"]:
                for seed in grid["seeds"]:
                    workdir = tempfile.mkdtemp(dir=root)
                    runs.append(one_iteration(window, epsilon, seed, workdir))
    c1, c2, max_relative_error = fit_validation_bound(
        [run["records"] for run in runs], [run["epsilon"] for run in runs],
        [run["slack"] for run in runs])
    print(json.dumps({"runs": runs, "c1": c1, "c2": c2, "dp_cost": c2 / c1,
                      "max_relative_error": max_relative_error}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
