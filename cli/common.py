"""What every `sage-tfx` command shares: the store and context arguments, opening the ledger,
and one map from errors to exit codes (documented here, once; each command's help points here).

Exit codes:
  0    success
  1    unexpected internal error (a bug: SAGE_TFX_DEBUG=1 shows the traceback)
  2    bad input, a refused query or request, or a store that is not a ledger: nothing charged
  3    denied for lack of budget: nothing charged (the denial is recorded in the ledger)
  4    ledger busy (too many concurrent writers): nothing charged
  5    store unreachable (server down or unknown, or refusing the login): nothing charged
  6    an audit found a problem: `ledger audit` an inconsistent history, `audit` a mechanism
       whose measured epsilon lower bound exceeds its claim; or a request refused, nothing
       charged, because a block's stored balance disagrees with the grants recorded on it
  7    charged, nothing released: the grant's budget is spent (its failure is recorded on it)
  130  interrupted (Ctrl-C); after a charge the message says that budget is spent
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

EXIT_INTERNAL_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_DENIED = 3
EXIT_BUSY = 4
EXIT_UNREACHABLE = 5
EXIT_AUDIT_FAILED = 6
EXIT_RELEASE_FAILED = 7
EXIT_INTERRUPTED = 130
EXIT_CODES_HELP = "exit codes: see `sage-tfx --help`"
STORE_ENVIRONMENT_VARIABLE = "SAGE_TFX_LEDGER_STORE"
STORE_HELP = (f"SQLite ledger file, grpc://HOST:PORT[?tls=DIR], grpc+unix:///PATH or "
              f"mysql://USER@HOST:PORT/DATABASE (default: ${STORE_ENVIRONMENT_VARIABLE})")


def add_store_arguments(parser: argparse.ArgumentParser, context_default: Optional[str] = "default",
                        store_default=None) -> None:
    """--store and --context, the same on every command. `store_default` argparse.SUPPRESS lets
    a subcommand's --store override its group's."""
    parser.add_argument("--store", help=STORE_HELP,
                        default=os.environ.get(STORE_ENVIRONMENT_VARIABLE)
                        if store_default is None else store_default)
    parser.add_argument("--context", default=context_default,
                        help="ledger context: an independent set of budgets (default: "
                             f"{context_default or 'every context in the store'})")


def open_ledger(args, read_only: bool = False):
    """The ledger context; the store must already hold it (only `ledger init` creates). A
    writing command first opens it read-only, so a store without the context is never written
    to (an MLMD server included, where a read-write open would register sage-tfx's types)."""
    from sage_tfx.sage_access.ledger import BlockLedger

    checked = BlockLedger(args.store, args.context, read_only=True)
    return checked if read_only else BlockLedger(args.store, args.context)


def run(handler: Callable, args, on_error: Optional[Callable] = None) -> int:
    """`handler(args)`, with every expected error turned into its exit code and one line on
    stderr (`on_error(args, message, remaining)` may print more, e.g. `ledger request`'s JSON)."""
    from ml_metadata import errors as mlmd_errors

    from sage_tfx.release import ReleaseFailed
    from sage_tfx.sage_access.errors import (BadRequest, BalanceTampered, BudgetExhausted,
                                             LedgerBusy)
    from sage_tfx.sage_access.store import StoreUnreachable

    def fail(code: int, message: str, remaining: Optional[dict] = None) -> int:
        print(f"sage-tfx {command_name(args)}: {message}", file=sys.stderr)
        if on_error is not None:
            on_error(args, message, remaining)
        return code

    try:
        if not args.store:
            raise BadRequest(f"no store: pass --store FILE|grpc://HOST:PORT|mysql://... or set "
                             f"{STORE_ENVIRONMENT_VARIABLE}")
        return handler(args)
    except ValueError as error:  # BadRequest, and the operators' QueryError and spec errors
        return fail(EXIT_BAD_INPUT, str(error))
    except BudgetExhausted as error:
        return fail(EXIT_DENIED, str(error), error.remaining)
    except LedgerBusy as error:
        return fail(EXIT_BUSY, str(error))
    except BalanceTampered as error:
        return fail(EXIT_AUDIT_FAILED, str(error))
    except ReleaseFailed as error:
        if os.environ.get("SAGE_TFX_DEBUG"):
            raise
        return fail(EXIT_RELEASE_FAILED, str(error))
    except StoreUnreachable as error:  # a MySQL server down or refusing the login
        return fail(EXIT_UNREACHABLE, str(error))
    except (mlmd_errors.UnavailableError,
            mlmd_errors.DeadlineExceededError) as error:
        return fail(EXIT_UNREACHABLE, f"store {args.store} is unreachable: "
                                      f"{str(error).splitlines()[0]}")
    except mlmd_errors.NotFoundError:
        return fail(EXIT_BAD_INPUT, f"store {args.store} has no sage-tfx ledger; create one "
                                    f"with `sage-tfx ledger --store {args.store} init`")
    except mlmd_errors.StatusError as error:
        return fail(EXIT_BAD_INPUT, f"store {args.store} cannot be used: "
                                    f"{str(error).splitlines()[0]}")


def add_beam_arguments(parser: argparse.ArgumentParser) -> None:
    """--engine and --beam-option: how a command hands Beam its pipeline options (the same
    options TFX components take as `beam_pipeline_args`; docs/running-at-scale.md lists them
    for Dataflow, Flink and Spark)."""
    parser.add_argument("--engine", choices=("local", "beam"), default="local",
                        help="local: the in-process engine (default); beam: the Beam engine, "
                             "on the runner --beam-option names (DirectRunner by default)")
    parser.add_argument("--beam-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a Beam pipeline option, repeatable, e.g. runner=PortableRunner, "
                             "job_endpoint=localhost:8099, environment_type=EXTERNAL "
                             "(needs --engine beam)")


def beam_pipeline_args(args) -> list[str]:
    """The --beam-option values as Beam's command-line options (`--KEY=VALUE`); BadRequest,
    before anything is charged, for a malformed one or options without --engine beam."""
    from sage_tfx.sage_access.errors import BadRequest

    pipeline_args = []
    for option in args.beam_option:
        key, equals, value = option.partition("=")
        key = key.strip().lstrip("-")
        if not equals or not key or not value:
            raise BadRequest(f"--beam-option {option!r}: write KEY=VALUE, e.g. "
                             "runner=PortableRunner (nothing charged)")
        pipeline_args.append(f"--{key}={value}")
    if pipeline_args and args.engine != "beam":
        raise BadRequest("--beam-option needs --engine beam (nothing charged)")
    return pipeline_args


def quiet_tensorflow() -> None:
    """Import TensorFlow without its C++ start-up lines (oneDNN, CUDA probing: absl writes them
    to the stderr file descriptor before any logging setup, so no environment variable hides
    them): stderr is pointed at /dev/null for the import only. An import error still raises, and
    prints, after stderr is back. TF_CPP_MIN_LOG_LEVEL (a user's own setting wins) quiets the
    rest."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow  # noqa: F401  (imported here so its start-up lines go nowhere)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def command_name(args) -> str:
    """"ledger request", "query", ...: how error lines name the command."""
    command = getattr(args, "command", None)
    return f"{args.group} {command}" if args.group == "ledger" and command else args.group
