"""`sage-tfx ledger ...`: the BlockLedger from the command line.

    sage-tfx ledger --store PATH init [--context NAME] [--accounting basic|rdp] [--min-request EPS]
    sage-tfx ledger --store PATH add-block BLOCK_ID --epsilon E --delta D [--start ISO] [--end ISO]
    sage-tfx ledger --store PATH request (--blocks ID[,ID...] | --window W) --epsilon E --delta D
                                         [--pipeline NAME]
    sage-tfx ledger --store PATH show [--json]
    sage-tfx ledger --store PATH plot --out FILE.png

Every subcommand takes `--context NAME` (default "default"). `--store` is an SQLite MLMD file or
`grpc://HOST:PORT` for an MLMD server (e.g. Kubeflow's metadata-grpc-service:8080).

Exit codes: 0 success; 2 bad input (nothing charged); 3 request denied for lack of budget
(nothing charged); 4 ledger busy (too many concurrent writers; nothing charged).
`request` always prints one JSON object on stdout, also when it fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

EXIT_BAD_INPUT = 2
EXIT_DENIED = 3
EXIT_BUSY = 4


def add_parser(groups: argparse._SubParsersAction) -> None:
    parser = groups.add_parser("ledger", help="the Sage BlockLedger (per-block privacy budgets)",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True,
                        help="SQLite MLMD file, or grpc://HOST:PORT of an MLMD server")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, handler, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--context", default="default",
                         help="ledger context (independent budgets; Sage §3.2)")
        sub.set_defaults(run=lambda args: _run(handler, args))
        return sub

    init = command("init", _init, "create a ledger context")
    init.add_argument("--accounting", choices=["basic", "rdp"], default="basic")
    init.add_argument("--min-request", type=float, default=0.01, dest="min_request",
                      help="the stream's minimum request epsilon: blocks that cannot pay it retire")

    add = command("add-block", _add_block, "register a new block with its budget ceiling")
    add.add_argument("block_id")
    add.add_argument("--epsilon", type=float, required=True)
    add.add_argument("--delta", type=float, required=True)
    add.add_argument("--start", help="ISO start of the block's key range (time window)")
    add.add_argument("--end", help="ISO end of the block's key range")

    request = command("request", _request, "grant budget on blocks (all or nothing)")
    selector = request.add_mutually_exclusive_group(required=True)
    selector.add_argument("--blocks", help="comma-separated block ids")
    selector.add_argument("--window", type=int, help="the most recent W blocks that can still pay")
    request.add_argument("--epsilon", type=float, required=True)
    request.add_argument("--delta", type=float, required=True)
    request.add_argument("--pipeline", help="the pipeline spending (draws on its reservation)")

    show = command("show", _show, "print every block's ceiling, spending and state")
    show.add_argument("--json", action="store_true")

    plot = command("plot", _plot, "PNG bar chart of spent and remaining budget per block")
    plot.add_argument("--out", required=True)


def _run(handler, args) -> int:
    from sage_tfx.sage_access.errors import BadRequest, BudgetExhausted, LedgerBusy

    try:
        return handler(args)
    except BadRequest as error:
        return _fail(args, EXIT_BAD_INPUT, str(error))
    except BudgetExhausted as error:
        return _fail(args, EXIT_DENIED, str(error), error.remaining)
    except LedgerBusy as error:
        return _fail(args, EXIT_BUSY, str(error))


def _fail(args, code: int, message: str, remaining: dict | None = None) -> int:
    print(f"sage-tfx ledger {args.command}: {message}", file=sys.stderr)
    if args.command == "request":
        print(json.dumps({"granted": False, "grant_id": None, "blocks": _requested_blocks(args),
                          "epsilon": _json_number(args.epsilon),
                          "delta": _json_number(args.delta), "error": message,
                          "remaining": remaining or {}}))
    return code


def _json_number(value: float):
    # NaN and infinities are not JSON; echo them as strings so strict parsers still read the line.
    return value if value is None or math.isfinite(value) else str(value)


def _requested_blocks(args) -> list[str]:
    return [b for b in args.blocks.split(",") if b] if args.blocks else []


def _open(args, create: bool = False):
    from sage_tfx.sage_access.errors import BadRequest
    from sage_tfx.sage_access.ledger import BlockLedger

    is_file = not args.store.startswith("grpc://") and args.store != ":memory:"
    if is_file and not create and not os.path.exists(args.store):
        raise BadRequest(f"no ledger store at {args.store}; run `sage-tfx ledger --store "
                         f"{args.store} init` first")
    return BlockLedger(args.store, args.context)


def _init(args) -> int:
    from sage_tfx.sage_access.ledger import BlockLedger

    ledger = BlockLedger.create(args.store, args.context, args.accounting, args.min_request)
    print(f"created ledger context {ledger.context!r} ({ledger.accounting.name} accounting, "
          f"minimum request epsilon {ledger.min_request_epsilon}) in {args.store}")
    return 0


def _add_block(args) -> int:
    ledger = _open(args)
    block = ledger.add_block(args.block_id, args.epsilon, args.delta, args.start, args.end)
    reserved = ", ".join(sorted(block.reservations)) or "nobody (all free)"
    print(f"added block {block.block_id!r} with ceiling ({block.epsilon_ceiling}, "
          f"{block.delta_ceiling}); reserved for: {reserved}")
    return 0


def _request(args) -> int:
    from sage_tfx.sage_access.ledger import BlockIds, RecentWindow

    ledger = _open(args)
    selector = BlockIds(_requested_blocks(args)) if args.blocks is not None \
        else RecentWindow(args.window)
    grant = ledger.request(selector, epsilon=args.epsilon, delta=args.delta,
                           pipeline=args.pipeline)
    print(json.dumps(grant.to_json()))
    return 0


def ledger_table(ledger) -> dict:
    """The JSON view of `show --json` (also used by the demo and the plot)."""
    blocks = []
    for block in ledger.blocks():
        epsilon_spent, delta_spent = ledger.accounting.guarantee(
            block.spent, block.epsilon_ceiling, block.delta_ceiling)
        blocks.append({
            "id": block.block_id, "epsilon_ceiling": block.epsilon_ceiling,
            "delta_ceiling": block.delta_ceiling, "epsilon_spent": epsilon_spent,
            "delta_spent": delta_spent, "retired": block.retired, "charges": block.charges,
            "start": block.start, "end": block.end,
            "reserved_for": sorted(block.reservations)})
    return {"context": ledger.context, "accounting": ledger.accounting.name,
            "min_request_epsilon": ledger.min_request_epsilon,
            "waiting_pipelines": ledger.waiting_pipelines(), "blocks": blocks}


def format_table(table: dict) -> str:
    """`show`'s text view of a `ledger_table`."""
    lines = [f"ledger {table['context']!r}: {table['accounting']} accounting, minimum request "
             f"epsilon {table['min_request_epsilon']}, waiting pipelines: "
             f"{', '.join(table['waiting_pipelines']) or 'none'}"]
    header = f"{'block':<20} {'eps spent':>10} {'eps ceiling':>11} {'delta spent':>11} " \
             f"{'delta ceil':>10} {'charges':>7}  state"
    lines += [header, "-" * len(header)]
    for row in table["blocks"]:
        lines.append(f"{row['id']:<20} {row['epsilon_spent']:>10.4f} {row['epsilon_ceiling']:>11.4f} "
                     f"{row['delta_spent']:>11.3g} {row['delta_ceiling']:>10.3g} "
                     f"{row['charges']:>7}  {'retired' if row['retired'] else 'live'}")
    return "\n".join(lines)


def _show(args) -> int:
    table = ledger_table(_open(args))
    print(json.dumps(table, indent=2) if args.json else format_table(table))
    return 0


def _plot(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = ledger_table(_open(args))
    rows = table["blocks"]
    if not rows:
        from sage_tfx.sage_access.errors import BadRequest
        raise BadRequest("the ledger has no blocks to plot")
    ids = [r["id"] for r in rows]
    spent = [min(r["epsilon_spent"], r["epsilon_ceiling"]) for r in rows]
    remaining = [r["epsilon_ceiling"] - s for r, s in zip(rows, spent)]
    figure, axes = plt.subplots(figsize=(max(6, 0.5 * len(ids) + 2), 4))
    axes.bar(ids, spent, label="epsilon spent", color="#c0504d")
    axes.bar(ids, remaining, bottom=spent, label="epsilon remaining", color="#9bbb59")
    for index, row in enumerate(rows):
        if row["retired"]:
            axes.text(index, row["epsilon_ceiling"], "retired", ha="center", va="bottom", fontsize=7)
    axes.set_ylabel("epsilon")
    axes.set_title(f"Sage ledger {table['context']!r} ({table['accounting']} accounting)")
    axes.legend()
    plt.setp(axes.get_xticklabels(), rotation=45, ha="right")
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0
