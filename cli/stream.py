"""`sage-tfx stream`: replay a stream through the DP-SQLP operator, one release per trigger.

    sage-tfx stream --store S [--context C] --window-blocks IDS --epsilon E --delta D
                    [--input FILE|DIR] --micro-batches N --out DIR
                    [--unit-column uid] [--key-column key] [--time-column time]
                    [--value-column COL --value-bound L] [--contribution-limit C]
                    [--state-dir STATE]

In the CLI package, not in `continual` (as workload.py): `sage-tfx` builds every command's
parser on each run, so this module imports nothing heavy until the command runs.

The window is the ledger blocks IDS; its micro-batches and trigger times are public: the
blocks' event-time range cut into N equal parts (continual/sources.py). Without --input the
records are the rows of those blocks of a table `sage-tfx ingest` registered. Without
--value-column each record counts 1 (COUNT(*), L = 1).

Order (charge before release): the arguments, the window and every input file's columns are
checked first (nothing charged for bad input); then ONE grant of (E, D) is charged on the
window's blocks (its dp-accounting event and the delta spent outside it recorded on it) and its
share consumed; then each micro-batch is run and its release written. DIR.state (beside DIR)
holds the operator's private state with the grant id: a second run with the same DIR resumes after the
last committed micro-batch and charges nothing; another window or query for the same DIR is
refused. Records the input brings for a micro-batch already computed are late data, dropped
(docs/streaming.md, "Lateness"): the published releases stay as they are. The state is private
(the noise key, raw counts and the micro-batches taken since its last save; created readable
by the owner only), so it is never inside DIR, which is published; --state-dir keeps it
elsewhere. Each trigger T writes DIR/release-T.csv
(key, value, updated: every key released so far in the window with its latest noisy value) and
DIR/release-T.json (one line: the guarantee's epsilon, delta and unit, the trigger time, the
grant). The last stdout line is one JSON object (grant, blocks, guarantee). Nothing
data-dependent is printed.

Exit codes: as every sage-tfx command (cli/common.py; `sage-tfx --help` lists them).
"""
from __future__ import annotations

import argparse
import math
import os

from sage_tfx.cli.common import add_store_arguments, open_ledger, run


def default_state_dir(out: str) -> str:
    """DIR.state beside the releases' DIR, never inside it: the state holds the noise key, and
    DIR is what gets published."""
    return os.path.normpath(os.path.abspath(out)) + ".state"


def add_parser(groups: argparse._SubParsersAction) -> None:
    parser = groups.add_parser(
        "stream", help="replay a stream through the DP-SQLP operator: one DP histogram per "
                       "trigger, one grant for the window", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(parser)
    parser.add_argument("--window-blocks", required=True,
                        help="comma-separated ids of the window's blocks (each with an "
                             "event-time range); the grant is charged on them")
    parser.add_argument("--epsilon", type=float, required=True,
                        help="epsilon of the window's one grant")
    parser.add_argument("--delta", type=float, required=True,
                        help="delta of the window's one grant, in (0, 1)")
    parser.add_argument("--input", help="a CSV or Parquet file, or a directory of them (read in "
                                        "name order, as arriving files); default: the rows of "
                                        "the blocks' ingested table")
    parser.add_argument("--micro-batches", type=int, required=True,
                        help="N: the window's event-time range is cut into N equal micro-batches, "
                             "one release at the end of each")
    parser.add_argument("--out", required=True,
                        help="the directory of the releases, to publish (the resumable "
                             "state is kept beside it, in DIR.state, without --state-dir)")
    parser.add_argument("--state-dir", default=None,
                        help="the operator's private state (noise key, raw counts, recent "
                             "micro-batches; created 0700); default: DIR.state, beside --out "
                             "(never inside what is published)")
    parser.add_argument("--unit-column", default=None,
                        help="the privacy unit of --input over blocks of no table (default: "
                             "uid); a table's is the one ingest recorded, no other")
    parser.add_argument("--key-column", default="key", help="the histogram's key (default: key)")
    parser.add_argument("--time-column", default=None,
                        help="event time of --input over blocks of no table, Unix seconds or "
                             "ISO 8601 (default: time); a table's is the one ingest recorded")
    parser.add_argument("--value-column", help="sum this column (default: count records)")
    parser.add_argument("--value-bound", type=float, default=None,
                        help="L: values are clamped to [-L, L] (required with --value-column)")
    parser.add_argument("--contribution-limit", type=int, default=32,
                        help="C: records a unit contributes over the whole window (default: 32, "
                             "the paper's)")
    parser.add_argument("--mechanism", choices=("auto", "tree", "factorization"), default="auto",
                        help="the running sums' noise: binary trees, the BLT square-root "
                             "factorization, or the one of smaller expected error for N "
                             "(default; every release states which ran)")
    parser.add_argument("--pipeline", default="sage-tfx-stream",
                        help="the pipeline name the grant is charged to")
    parser.set_defaults(run=lambda args: run(_stream, args), command="stream")


def check_arguments(args) -> None:
    """BadRequest naming the first bad argument (before the ledger is opened)."""
    from sage_tfx.sage_access.errors import BadRequest

    if not (math.isfinite(args.epsilon) and args.epsilon > 0 and 0 < args.delta < 1):
        raise BadRequest(f"--epsilon must be a positive number and --delta in (0, 1), got "
                         f"{args.epsilon!r}, {args.delta!r}")
    if args.micro_batches < 1:
        raise BadRequest(f"--micro-batches must be at least 1, got {args.micro_batches}")
    if args.contribution_limit < 1:
        raise BadRequest(f"--contribution-limit must be at least 1, got "
                         f"{args.contribution_limit}")
    if args.value_column is not None:
        if args.value_bound is None or not (math.isfinite(args.value_bound)
                                            and args.value_bound > 0):
            raise BadRequest(f"--value-column {args.value_column} needs --value-bound L, a "
                             f"positive number (values are clamped to [-L, L]); got "
                             f"{args.value_bound!r}")
    elif args.value_bound not in (None, 1.0):
        raise BadRequest("--value-bound is for --value-column; a count has L = 1")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise BadRequest(f"--out {args.out} is a file; give a directory")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise BadRequest(f"--out {args.out}: its parent directory does not exist")


def _columns(args, table):
    """The stream's columns. A table's unit and time columns are the ones `sage-tfx ingest`
    recorded, and no others: its blocks' budgets and every release's guarantee are for that
    unit, so --unit-column/--time-column naming another column are refused (BadRequest, before
    the charge) rather than let a release state "one trip" for a table whose unit is uid."""
    from sage_tfx.dp_statistics.continual.sources import Columns
    from sage_tfx.sage_access.errors import BadRequest

    if table is None:
        return Columns(unit=args.unit_column or "uid", key=args.key_column,
                       time=args.time_column or "time", value=args.value_column)
    for what, given, recorded in (("unit", args.unit_column, table.unit_column),
                                  ("time", args.time_column, table.time_column)):
        flag = f"--{what}-column"
        if given is not None and given != recorded:
            raise BadRequest(f"{flag} {given}: the window's blocks are table {table.name}'s, "
                             f"whose {what} column is {recorded} (recorded by sage-tfx "
                             f"ingest; the blocks' budgets and the guarantee are for it); "
                             f"leave {flag} out")
    return Columns(unit=table.unit_column, key=args.key_column, time=table.time_column,
                   value=args.value_column)


def _window_table(ledger, block_ids, records_given: bool):
    """The table `sage-tfx ingest` registered whose blocks the window is (all of one table), or
    None for blocks of no table (only with --input)."""
    from sage_tfx.dp_statistics import tables
    from sage_tfx.sage_access.errors import BadRequest

    owners = tables.tables_of(ledger, block_ids)
    names = {table.name for table in owners.values() if table is not None}
    if len(names) == 1 and None not in owners.values():
        return next(iter(owners.values()))
    if not names and records_given:
        return None
    raise BadRequest(f"the window's blocks {', '.join(block_ids)} must all be the blocks of one "
                     "table (sage-tfx ingest), or, with --input FILE|DIR, blocks of no table")


def _stream(args) -> int:
    import json

    from sage_tfx.dp_statistics.aggregation.spec import QueryError
    from sage_tfx.dp_statistics.continual import sources
    from sage_tfx.dp_statistics.continual.release import STATE_DIR, record_released, run_window
    from sage_tfx.dp_statistics.continual.spec import StreamQuery
    from sage_tfx.sage_access.errors import BadRequest

    check_arguments(args)
    ledger = open_ledger(args)
    window = sources.window_of_blocks(ledger, args.window_blocks.split(","))
    table = _window_table(ledger, window.block_ids, records_given=bool(args.input))
    columns = _columns(args, table)
    query = StreamQuery(key_column=columns.key, unit_column=columns.unit,
                        time_column=columns.time, value_column=columns.value,
                        value_bound=args.value_bound if columns.value else 1.0,
                        contribution_limit=args.contribution_limit,
                        micro_batches=args.micro_batches, epsilon=args.epsilon, delta=args.delta,
                        mechanism=args.mechanism)
    try:
        query.check()
    except QueryError as error:
        raise BadRequest(str(error)) from None
    # Every input is read and checked before the charge: a bad file is refused uncharged.
    records = sources.read_input(args.input, columns, window, args.micro_batches) \
        if args.input else sources.read_table_blocks(ledger, table, columns, window,
                                                     args.micro_batches)
    state_dir = args.state_dir or default_state_dir(args.out)
    if not os.path.isdir(state_dir) and os.path.isdir(args.out) and os.listdir(args.out):
        inside = os.path.join(args.out, STATE_DIR)  # where streams kept their state before
        raise BadRequest(f"--out {args.out} is not empty and holds no stream; give a new "
                         "directory (or the same one to resume a stream)"
                         + (f"; its state is in {inside}: move it to {state_dir} (or pass "
                            f"--state-dir {inside}) and publish {args.out} without it"
                            if os.path.isdir(inside) else ""))
    front_door = f"sage-tfx stream {os.path.abspath(args.out)}"
    state = run_window(ledger, query, window, records, state_dir, args.out,
                       consumer=front_door, pipeline=args.pipeline)
    record_released(ledger, query, state, front_door, args.out)
    print(json.dumps({"grant_id": state.grant_id, "blocks": list(state.blocks),
                      "epsilon": args.epsilon, "delta": args.delta,
                      "micro_batches": args.micro_batches,
                      "guarantee": state.guarantee(ledger.for_tests).sentence(),
                      "out": os.path.abspath(args.out)}))
    return 0
