"""The `sage-tfx` console script: one subcommand group per concern.

Groups import their implementation lazily, so `sage-tfx ledger ...` never imports TensorFlow.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from sage_tfx.audit import cli as audit_cli
    from sage_tfx.sage_access import cli as ledger_cli

    parser = argparse.ArgumentParser(prog="sage-tfx", description=__doc__.splitlines()[0])
    groups = parser.add_subparsers(dest="group", required=True)
    ledger_cli.add_parser(groups)
    _add_compile_parser(groups)
    audit_cli.add_parser(groups)
    args = parser.parse_args(argv)
    return args.run(args)


def _add_compile_parser(groups) -> None:
    """`sage-tfx compile`: its arguments here, TFX imported only when it runs."""
    parser = groups.add_parser("compile", help="compile the taxi pipeline for an orchestrator")
    parser.add_argument("--kubeflow", action="store_true", required=True,
                        help="Kubeflow Pipelines V2 (the only target for now)")
    parser.add_argument("--out", required=True, help="the PipelineJob JSON to write")
    parser.add_argument("--image", default="sage-tfx:0.1.0")
    parser.add_argument("--pipeline-root", default="gs://YOUR-BUCKET/sage-taxi")
    parser.add_argument("--data-root", default="gs://YOUR-BUCKET/taxi/new-months",
                        help="where the new months' CSV files arrive")
    parser.add_argument("--mode", choices=("adassp", "dp_sgd"), default="adassp")
    parser.add_argument("--window", type=int,
                        help="blocks the iteration trains on (default: the mode's first window, "
                             "MIN_WINDOW in examples/taxi/pipeline.py)")
    parser.add_argument("--epsilon", type=float,
                        help="the iteration's epsilon (default: the mode's INITIAL_EPSILON)")
    parser.add_argument("--module-file", default=None,
                        help="the taxi module's path inside the image (default: where the "
                             "installed package has it)")
    parser.set_defaults(run=_compile)


def _compile(args) -> int:
    from sage_tfx.pipelines import kubeflow
    return kubeflow.compile_taxi_command(args)


if __name__ == "__main__":
    sys.exit(main())
