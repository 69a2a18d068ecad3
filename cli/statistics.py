"""`sage-tfx ingest` and `sage-tfx query`: DP statistics over tables kept as ledger blocks.

    sage-tfx ingest --store S [--context C] --csv FILE --unit-column COL
        (--time-column COL --period month|day|hour --start T --end T | --user-blocks K)
        [--types COL:TYPE,...] --epsilon E --delta D [--table NAME] --out DIR
    sage-tfx query --store S [--context C] (--window W | --blocks IDS) --epsilon E --delta D
        [--out FILE.csv|FILE.parquet] [--intervals] [--non-negative] "SELECT WITH ..."

`query` parses and checks the query first (nothing is charged for a query it refuses), then
charges one grant on the blocks, split among the query's steps, reads only the granted blocks of
the tables it names, and prints the released table and its guarantee.

Exit codes: as every sage-tfx command (cli/common.py; `sage-tfx --help` lists them).
"""
from __future__ import annotations

import argparse
import os

from sage_tfx.cli.common import (add_beam_arguments, add_store_arguments, beam_pipeline_args,
                                 open_ledger, run)

INGEST_HELP = "register a CSV file as a table of ledger blocks (for `sage-tfx query`)"
QUERY_HELP = "run a DP SQL query on ingested tables, charged to the ledger"


def add_parsers(groups: argparse._SubParsersAction) -> None:
    def command(name: str, handler, help_text: str) -> argparse.ArgumentParser:
        parser = groups.add_parser(name, help=help_text, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
        add_store_arguments(parser)
        parser.add_argument("--epsilon", type=float, required=True,
                            help="ingest: each block's epsilon ceiling; query: the grant's epsilon")
        parser.add_argument("--delta", type=float, required=True,
                            help="ingest: each block's delta ceiling; query: the grant's delta")
        parser.set_defaults(run=lambda args: run(handler, args), command=None)
        return parser

    ingest = command("ingest", _ingest, INGEST_HELP)
    ingest.add_argument("--csv", required=True, help="the CSV file (its first line names the "
                                                     "columns)")
    ingest.add_argument("--unit-column", required=True,
                        help="the privacy unit (user id) column; queries' unit is this one. "
                             "Tables joined in a query must use the same ids for the same "
                             "people (only the column names are compared), and a unit's loss "
                             "is bounded per table: across tables it adds up")
    ingest.add_argument("--time-column", help="cut blocks by this time column (ISO 8601 or "
                                              "Unix seconds)")
    ingest.add_argument("--period", choices=["month", "day", "hour"], default="month",
                        help="with --time-column: one block per calendar period (default month)")
    ingest.add_argument("--start", help="with --time-column: the public schedule's start (ISO "
                                        "date/time or Unix seconds, a period boundary)")
    ingest.add_argument("--end", help="with --time-column: the schedule's end (exclusive)")
    ingest.add_argument("--user-blocks", type=int,
                        help="instead of time: K blocks by a keyed hash of the unit (a release "
                             "is then DP for the unit, not the unit within the blocks read)")
    ingest.add_argument("--types", help="column types COL:TYPE,... with TYPE int, float or "
                                        "string (default string; never inferred from the data)")
    ingest.add_argument("--table", help="the table's name in SQL (default: the CSV file's stem)")
    ingest.add_argument("--out", required=True, help="the directory for the blocks' Parquet files")

    query = command("query", _query, QUERY_HELP)
    selector = query.add_mutually_exclusive_group(required=True)
    selector.add_argument("--window", type=int, help="the W most recent blocks of each table "
                                                     "the query reads that can pay")
    selector.add_argument("--blocks", help="comma-separated block ids")
    query.add_argument("--out", help="also write the released table to this CSV file (or "
                                     "Parquet, when it ends in .parquet)")
    query.add_argument("--intervals", action="store_true",
                       help="add each aggregate's noise standard deviation and 95%% interval "
                            "(<name>_stddev, <name>_ci_low, <name>_ci_high; no extra budget)")
    query.add_argument("--non-negative", action="store_true",
                       help="clamp released counts at 0 (post-processing, stated in the "
                            "guarantee)")
    add_beam_arguments(query)
    query.add_argument("sql", help='the query, e.g. "SELECT WITH ANONYMIZATION key, '
                                   'ANON_COUNT(*) FROM trips GROUP BY key"')


def _ingest(args) -> int:
    from sage_tfx.dp_statistics.ingest import ingest, parse_types

    ledger = open_ledger(args)
    table, blocks = ingest(
        ledger, args.csv, args.out, args.unit_column, args.epsilon, args.delta,
        table_name=args.table, time_column=args.time_column,
        period=args.period if args.time_column else None, start=args.start, end=args.end,
        user_blocks=args.user_blocks, types=parse_types(args.types))
    print(f"table {table.name}: unit {table.unit_column}, {len(blocks)} block(s) "
          f"{blocks[0]} .. {blocks[-1]} with ceiling ({args.epsilon:g}, {args.delta:g}), "
          f"rows in {os.path.abspath(os.path.join(args.out, table.name))}")
    return 0


def _query(args) -> int:
    from sage_tfx import release
    from sage_tfx.dp_statistics import tables
    from sage_tfx.dp_statistics.aggregation import frontend, relation, sql
    from sage_tfx.dp_statistics.aggregation.budget import composition_for
    from sage_tfx.sage_access.errors import BadRequest
    from sage_tfx.sage_access.ledger import BlockIds

    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise BadRequest(f"--out {args.out}: its directory does not exist (nothing charged)")
    engine = _engine(args)
    ledger = open_ledger(args)
    parsed = sql.parse(args.sql)
    found = {name: tables.find_table(ledger, name) for name in sql.table_names(parsed)}
    planned = frontend.plan_query(
        parsed, {n: sql.TableSchema(t.unit_column, t.columns) for n, t in found.items()},
        {n: t.schema for n, t in found.items()}, args.epsilon, args.delta,
        composition_for(ledger.accounting))
    plan = planned.release_plan("sage-tfx query", args.sql)
    block_ids = _query_blocks(args, ledger, found, plan)
    unit = release.weakest_unit([t.guarantee_unit for t in found.values()])
    unit_column = next(iter(found.values())).unit_column  # joined tables share it (sql.check)
    with release.charge(ledger, plan, BlockIds(block_ids)) as charged:
        charged.phase = "reading the granted blocks"
        rows = relation.evaluate(
            planned.checked,
            lambda name: tables.read_blocks(ledger, found[name], charged.grant.blocks))
        charged.phase = "running the query"
        result = frontend.run(rows, planned, charged, unit, engine=engine,
                              intervals=args.intervals, non_negative_counts=args.non_negative)
        guarantee = charged.guarantee(unit, unit_column, mechanism=frontend.stated_mechanism(
            planned, args.non_negative))
        charged.phase = "writing the release"
        if args.out:
            write = release.write_parquet if args.out.endswith(".parquet") else release.write_csv
            write(result.table, args.out, guarantee)
        charged.released([os.path.abspath(args.out)] if args.out else ["stdout"], guarantee)
    print(result.table.to_string(index=False) if len(result.table)
          else frontend.nothing_released(planned, unit_column))
    print(f"guarantee: {guarantee.sentence()}")
    return 0


def _engine(args):
    """The aggregation engine --engine names, with the --beam-option pipeline options."""
    pipeline_args = beam_pipeline_args(args)
    if args.engine == "local":
        from sage_tfx.dp_statistics.aggregation.local import aggregate

        return aggregate
    from apache_beam.options.pipeline_options import PipelineOptions

    from sage_tfx.dp_statistics.aggregation.beam import aggregate_with_beam

    options = PipelineOptions(pipeline_args)
    return lambda rows, query, budget, unit, intervals: aggregate_with_beam(
        rows, query, budget, unit, options=options, intervals=intervals)


def _query_blocks(args, ledger, found: dict, plan) -> list[str]:
    """The blocks to charge: --blocks (each a block of a table the query reads), or of each
    table its --window most recent blocks that can pay (a shortfall is a recorded denial)."""
    from sage_tfx import release
    from sage_tfx.sage_access.errors import BadRequest, BudgetExhausted

    if args.blocks:
        block_ids = [b for b in args.blocks.split(",") if b]
        foreign = [b for b in block_ids if not any(t.owns(b) for t in found.values())]
        if foreign:
            raise BadRequest(f"--blocks {', '.join(foreign)}: not blocks of the table(s) the "
                             f"query reads ({', '.join(found)})")
        return block_ids
    if args.window < 1:
        raise BadRequest(f"--window must be at least 1, got {args.window}")
    live = ledger.live_blocks()
    block_ids = []
    for table in found.values():
        owned = [b for b in live if table.owns(b.block_id)]
        payable = ledger.payable_window(plan.epsilon, plan.delta, size=args.window,
                                        split=plan.split, events=plan.events, blocks=owned,
                                        additional_delta=plan.additional_delta)
        if len(payable) < args.window:
            paying = {b.block_id for b in payable}
            free = {b.block_id: ledger.remaining(b) for b in owned if b.block_id not in paying}
            denied = BudgetExhausted(
                f"denied: only {len(payable)} block(s) of table {table.name} can pay the "
                f"request; the window needs {args.window}. The others have: "
                + "; ".join(f"{block}: {text}" for block, text in list(free.items())[:5])
                + (f"; ... ({len(free) - 5} more)" if len(free) > 5 else ""), free)
            release.record_denial(ledger, plan, denied)
            raise denied
        block_ids += [block.block_id for block in payable]
    return block_ids
