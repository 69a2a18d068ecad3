"""Wall time of the taxi DP-SGD iteration that ACCEPTs in `make demo` (24 monthly blocks at
epsilon 0.5), run two ways on this machine, and whether both charged the ledger alike:

* demo: as `make demo` runs it (examples/taxi/run.py): ingest the 24 months with BlockExampleGen,
  then one iteration of the privacy-adaptive driver on LocalDagRunner, in this one process,
  against the ledger's SQLite file;
* kubeflow: `sage-tfx compile --kubeflow` (the same months, window and epsilon), then
  `sage-tfx kubeflow run-local`: a process per task (forked from one launcher that imports
  TensorFlow and TFX once: pipelines/task_processes.py), the ledger over
  ML Metadata's gRPC service (sage_tfx.sage_access.grpc_server in front of its own file).

    python benchmarks/kubeflow_local.py [--workdir out/bench-kubeflow]

Prints one JSON object. Noise is not seeded: each run's outcome may differ (the demo's first
iteration ACCEPTs about 3 times in 4; examples/taxi/pipeline.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import sage_tfx  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow loads)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kubeflow_run import SAGE, ledger_server, run_local  # noqa: E402


def _grant(ledger) -> dict:
    [grant] = ledger.grant_records()
    return {"blocks": sorted(grant["blocks"]), "epsilon": grant["epsilon"],
            "delta": grant["delta"], "split": grant["split"]}


def demo_iteration(workdir: str) -> dict:
    from sage_tfx.examples.taxi.pipeline import INITIAL_EPSILON, MIN_WINDOW, SPECS, TaxiSource
    from sage_tfx.pipelines.adaptive import Policy, run_adaptive
    from sage_tfx.sage_access import BlockLedger
    from sage_tfx.sage_access.accounting import AccountingMode

    store = os.path.join(workdir, "metadata.sqlite")
    BlockLedger.create(store, accounting=AccountingMode.BASIC, min_request_epsilon=0.05)
    started = time.monotonic()
    source = TaxiSource(store, workdir)
    source.ingest(MIN_WINDOW["dp_sgd"])
    result = run_adaptive(SPECS["dp_sgd"](), Policy(initial_epsilon=INITIAL_EPSILON["dp_sgd"],
                                                    min_window=MIN_WINDOW["dp_sgd"],
                                                    max_iterations=1),
                          "taxi-dp_sgd", workdir, store, source, report=lambda line: None)
    return {"seconds": round(time.monotonic() - started, 1),
            "outcome": str(result.iterations[0].outcome), "grant": _grant(BlockLedger(store))}


def kubeflow_job(workdir: str) -> dict:
    from sage_tfx.examples.taxi.pipeline import MIN_WINDOW
    from sage_tfx.examples.taxi.stream import TaxiStream
    from sage_tfx.sage_access import BlockLedger
    from sage_tfx.sage_access.accounting import AccountingMode

    months = TaxiStream.load().release(MIN_WINDOW["dp_sgd"], os.path.join(workdir, "data"))
    with ledger_server(workdir) as store:
        BlockLedger.create(store, accounting=AccountingMode.BASIC, min_request_epsilon=0.05)
        job, root = os.path.join(workdir, "job.json"), os.path.join(workdir, "root")
        started = time.monotonic()
        subprocess.run([*SAGE, "compile", "--kubeflow", "--out", job, "--image", "local",
                        "--pipeline-root", root, "--data-root", os.path.join(workdir, "data"),
                        "--mode", "dp_sgd", "--first-month", months[0], "--last-month",
                        months[-1], "--ledger-store", store], check=True, capture_output=True)
        compiled = time.monotonic()
        ran = run_local(job, root)
        blessed = [os.path.join(directory, "output_metadata.json")
                   for directory, _, _ in os.walk(root)
                   if directory.endswith(os.path.join(".local", "SLAedValidator"))]
        outcome = (json.load(open(blessed[0]))["artifacts"]["blessing"]["artifacts"][0]
                   ["metadata"]["outcome"] if blessed and ran["exit"] == 0 else
                   f"failed (exit {ran['exit']})")
        return {"compile_seconds": round(compiled - started, 1), **ran,
                "outcome": outcome, "grant": _grant(BlockLedger(store))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="out/bench-kubeflow")
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    results = {}
    for name, run in (("demo", demo_iteration), ("kubeflow_run_local", kubeflow_job)):
        workdir = os.path.abspath(os.path.join(args.workdir, name))
        os.makedirs(workdir)
        results[name] = run(workdir)
    results["same_charge"] = results["demo"].pop("grant") == \
        results["kubeflow_run_local"].pop("grant")
    results["load_average"] = [round(x, 1) for x in os.getloadavg()]
    results["cpus"] = os.cpu_count()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
