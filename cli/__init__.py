"""The `sage-tfx` console script: one module per subcommand group (ledger.py, statistics.py
for ingest and query, stream.py, workload.py, audit.py, compile.py), and what they share
(common.py: the store arguments, opening the ledger, the exit codes).

Groups import their implementation lazily, so `sage-tfx ledger ...` and the statistics commands
never import TensorFlow; a command that needs it quiets TensorFlow's logging before the first
import (common.quiet_tensorflow).
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
Set SAGE_TFX_DEBUG=1 to see a Python traceback when a command fails unexpectedly.

"""


def main(argv: list[str] | None = None) -> int:
    from sage_tfx import __version__
    from sage_tfx.cli import audit, compile, ledger, statistics, stream, workload
    from sage_tfx.cli.common import EXIT_INTERNAL_ERROR, EXIT_INTERRUPTED

    parser = argparse.ArgumentParser(prog="sage-tfx", description=DESCRIPTION + _exit_codes(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sage-tfx {__version__}")
    groups = parser.add_subparsers(dest="group", required=True,
                                   metavar="{ledger,compile,audit,ingest,query,workload-answer,stream}")
    ledger.add_parser(groups)
    compile.add_parser(groups)
    audit.add_parser(groups)
    statistics.add_parsers(groups)
    workload.add_parser(groups)
    stream.add_parser(groups)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (`sage-tfx ledger show | head`): stop quietly. Point stdout at
        # devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as interrupt:  # ReleaseInterrupted says what the charge spent
        print(f"sage-tfx {args.group}: {interrupt or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # the last resort: one line, not a traceback
        if os.environ.get("SAGE_TFX_DEBUG"):
            raise
        print(f"sage-tfx {args.group}: unexpected error: {type(error).__name__}: {error} "
              "(set SAGE_TFX_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL_ERROR




def _exit_codes() -> str:
    from sage_tfx.cli import common

    return "\n\n" + common.__doc__.split("\n\n", 1)[1].rstrip()
