"""The `sage-tfx` console script: one subcommand group per concern.

Groups import their implementation lazily, so `sage-tfx ledger ...` never imports TensorFlow.
"""
from __future__ import annotations

import argparse
import os
import sys

DESCRIPTION = """\
sage-tfx: differentially private ML pipelines with a per-block privacy budget.

  sage-tfx ledger ...    keep the privacy-budget ledger: create it (init), add data blocks,
                         grant budget, and see what was spent, reserved and is still free
  sage-tfx compile ...   compile a pipeline into a Kubeflow Pipelines job
  sage-tfx audit ...     measure, by running them, lower bounds on the mechanisms' epsilon
  sage-tfx ingest ...    register a CSV file as a table of ledger blocks
  sage-tfx query ...     run a DP SQL query (SELECT WITH ANONYMIZATION ...) on ingested tables
  sage-tfx workload-answer ...  answer a workload of counting queries from granted blocks
                         (the matrix mechanism; one grant charged)
  sage-tfx stream ...    replay a stream: a DP histogram per trigger over a window of blocks
                         (the DP-SQLP operator; one grant for the window)

Start with `sage-tfx ledger --store ledger.sqlite init`, then `sage-tfx ledger --help`.
Set SAGE_TFX_DEBUG=1 to see a Python traceback when a command fails unexpectedly."""
EXIT_INTERNAL_ERROR = 1


def main(argv: list[str] | None = None) -> int:
    from sage_tfx.audit import cli as audit_cli
    from sage_tfx.dp_statistics import cli as statistics_cli
    from sage_tfx.dp_statistics import matrix_cli, stream_cli
    from sage_tfx import __version__
    from sage_tfx.sage_access import cli as ledger_cli

    parser = argparse.ArgumentParser(prog="sage-tfx", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sage-tfx {__version__}")
    groups = parser.add_subparsers(dest="group", required=True,
                                   metavar="{ledger,compile,audit,ingest,query,workload-answer,stream}")
    ledger_cli.add_parser(groups)
    _add_compile_parser(groups)
    audit_cli.add_parser(groups)
    statistics_cli.add_parsers(groups)
    matrix_cli.add_parser(groups)
    stream_cli.add_parser(groups)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (`sage-tfx ledger show | head`): stop quietly. Point stdout at
        # devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("sage-tfx: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # the last resort: one line, not a traceback
        if os.environ.get("SAGE_TFX_DEBUG"):
            raise
        print(f"sage-tfx {args.group}: unexpected error: {type(error).__name__}: {error} "
              "(set SAGE_TFX_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL_ERROR


def _add_compile_parser(groups) -> None:
    """`sage-tfx compile`: its arguments here, TFX imported only when it runs."""
    parser = groups.add_parser(
        "compile", help="compile a pipeline (taxi, or your own module) for Kubeflow",
        description="Compile one pipeline run into a Kubeflow Pipelines V2 PipelineJob JSON. "
                    "Without --pipeline-module it compiles the taxi example.")
    parser.add_argument("--kubeflow", action="store_true", required=True,
                        help="Kubeflow Pipelines V2 (the only target for now)")
    parser.add_argument("--out", required=True,
                        help="the PipelineJob JSON to write; its directory must exist")
    parser.add_argument("--image", required=True,
                        help="the container image every step runs in (see the Dockerfile)")
    parser.add_argument("--pipeline-root", required=True,
                        help="where runs write their artifacts, e.g. gs://BUCKET/sage")
    parser.add_argument("--pipeline-module",
                        help="your pipeline: PATH.py[:FUNCTION]; FUNCTION (default "
                             "create_pipeline) is called with pipeline_root=... and must return "
                             "a tfx Pipeline")
    taxi = parser.add_argument_group("the taxi example (without --pipeline-module)")
    taxi.add_argument("--data-root", help="where the new months' CSV files arrive (required for "
                                          "taxi), e.g. gs://BUCKET/taxi/new-months")
    taxi.add_argument("--first-month", default="2013-01",
                      help="first month (YYYY-MM) this run ingests (default: the sample's first, "
                           "2013-01); blocks are immutable, so each run names new months")
    taxi.add_argument("--last-month", default="2016-12",
                      help="last month (YYYY-MM) this run ingests (default: the sample's last, "
                           "2016-12)")
    # TrainerMode's values, spelled out: importing it imports TFX, too slow for --help.
    taxi.add_argument("--mode", choices=("adassp", "dp_sgd"), default="adassp",
                      help="the trainer (default: adassp)")
    taxi.add_argument("--window", type=int,
                      help="blocks the iteration trains on (default: the mode's first window, "
                           "MIN_WINDOW in examples/taxi/pipeline.py)")
    taxi.add_argument("--epsilon", type=float,
                      help="the iteration's epsilon (default: the mode's INITIAL_EPSILON)")
    taxi.add_argument("--module-file", default="sage_tfx.examples.taxi.taxi_module",
                      help="the taxi module inside the image: a path under /opt/sage-tfx or a "
                           "module path (default: %(default)s, the installed package's)")
    parser.set_defaults(run=_compile)


def _compile(args) -> int:
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        print(f"sage-tfx compile: directory {parent} does not exist; create it first "
              "(nothing written)", file=sys.stderr)
        return 2
    if args.pipeline_module is None and args.data_root is None:
        print("sage-tfx compile: the taxi example needs --data-root (where new CSV files "
              "arrive); or pass --pipeline-module for your own pipeline", file=sys.stderr)
        return 2
    from sage_tfx.pipelines import kubeflow
    if args.pipeline_module:
        return kubeflow.compile_command(args.pipeline_module, args.out, args.image,
                                        args.pipeline_root)
    build, summary = _taxi_example(args)
    return kubeflow.compile_command(build, args.out, args.image, args.pipeline_root, summary)


def _taxi_example(args):
    """The CLI's example pipeline (without --pipeline-module): a function building one taxi
    iteration, and what it grants (for the summary line)."""
    import dataclasses
    import functools

    from sage_tfx.examples.taxi.pipeline import (INITIAL_EPSILON, MIN_WINDOW, SPECS,
                                                 kubeflow_pipeline)
    from sage_tfx.sage_access.store import KUBEFLOW_LEDGER_STORE
    spec = dataclasses.replace(SPECS[args.mode](), module_file=args.module_file)
    window = MIN_WINDOW[args.mode] if args.window is None else args.window
    epsilon = INITIAL_EPSILON[args.mode] if args.epsilon is None else args.epsilon
    build = functools.partial(kubeflow_pipeline, spec, data_root=args.data_root, window=window,
                              epsilon=epsilon, months=(args.first_month, args.last_month))
    return build, (f"; a grant of epsilon {epsilon:g} on {window} block(s); ledger at "
                   f"{KUBEFLOW_LEDGER_STORE}")


if __name__ == "__main__":
    sys.exit(main())
