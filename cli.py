"""The `sage-tfx` console script: one subcommand group per concern.

Groups import their implementation lazily, so `sage-tfx ledger ...` never imports TensorFlow.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from sage_tfx.sage_access import cli as ledger_cli

    parser = argparse.ArgumentParser(prog="sage-tfx", description=__doc__.splitlines()[0])
    groups = parser.add_subparsers(dest="group", required=True)
    ledger_cli.add_parser(groups)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
