"""`sage-tfx ledger ...`: the BlockLedger from the command line.

    sage-tfx ledger [--store STORE] COMMAND [--store STORE] [--context NAME] ...

    init        create a ledger context (the only command that creates a store)
    add-block   register a new block with its budget ceiling
    register    mark a pipeline as waiting: new blocks reserve a share for it
    finish      the pipeline is done: its unused reservations return
    request     grant budget on blocks, all or nothing (prints one JSON object, always)
    show        every block's spent, reserved (per pipeline) and free budget, then the grants
                and denials as `grants` lists them
    plot        the same as a PNG/SVG/PDF bar chart
    contexts    the ledger contexts in the store
    grants      every grant and denial, oldest first: time, outcome (released, failed,
                interrupted, incomplete, unrecorded; denied), epsilon, delta, pipeline, front
                door, blocks, split, run, why it failed or was denied, and the request's text
    audit       re-derive every balance from the history and report inconsistencies
    serve       a read-only web page of all the above, with JSON endpoints (localhost unless
                --host says otherwise, and then only with a token)

STORE is an SQLite file or an ML Metadata server: grpc://HOST:PORT (Kubeflow:
grpc://metadata-grpc-service:8080), with ?tls=DIR for mutual TLS (DIR: the client certificate
grpc_tls made), or grpc+unix:///PATH (grpc_server's socket); it defaults to
$SAGE_TFX_LEDGER_STORE. Only `init` creates a
store; every other command refuses a file that is not a sage-tfx ledger and leaves it unchanged,
and `show`, `plot`, `contexts`, `grants`, `audit` and `serve` open the store read-only.

Exit codes: as every sage-tfx command (cli/common.py; `sage-tfx --help` lists them).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys

from sage_tfx.cli.common import (EXIT_AUDIT_FAILED, EXIT_BAD_INPUT, STORE_ENVIRONMENT_VARIABLE,
                                 STORE_HELP,
                                 add_store_arguments, open_ledger, run)
# Light (no dp_accounting, no TensorFlow); the package's __init__ imports it anyway.
from sage_tfx.sage_access.accounting import AccountingMode, accounting_for
from sage_tfx.sage_access.views import (MAX_PLOT_BARS, format_history, format_table, history,
                                        ledger_table, plot_bars)

TOKEN_ENVIRONMENT_VARIABLE = "SAGE_TFX_LEDGER_TOKEN"
# Okabe & Ito's colour-blind-safe palette: spent, reserved, free.
PLOT_COLOURS = {"spent": "#D55E00", "reserved": "#E69F00", "free": "#0072B2"}
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def add_parser(groups: argparse._SubParsersAction) -> None:
    parser = groups.add_parser("ledger", help="the privacy-budget ledger: blocks, grants, budgets",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default=os.environ.get(STORE_ENVIRONMENT_VARIABLE),
                        help=STORE_HELP + "; also accepted after the command")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler, help_text: str,
                context_default: str | None = "default") -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        # SUPPRESS: given here it overrides the group's --store; absent, the group's value stays.
        add_store_arguments(sub, context_default, store_default=argparse.SUPPRESS)
        sub.set_defaults(run=lambda args: run(handler, args, on_error=_print_request_json))
        return sub

    init = command("init", _init, "create a ledger context (creates the store if needed)")
    init.add_argument("--accounting", choices=AccountingMode.values(),
                      default=AccountingMode.BASIC,
                      help="basic: epsilons and deltas add up per block; rdp: a Renyi-DP filter "
                           "per block (default: basic)")
    init.add_argument("--min-request", type=float, default=0.01, dest="min_request",
                      help="the stream's minimum request epsilon: blocks that cannot pay it "
                           "retire (default: 0.01)")
    init.add_argument("--for-tests", action="store_true", dest="for_tests",
                      help="a ledger for tests: it accepts fixed seeds (DPTrainer, "
                           "ObliviousSampleGen, `compile --seed`), which make the noise "
                           "predictable, and every guarantee it issues says so. Never for "
                           "real data")

    add = command("add-block", _add_block, "register a new block with its budget ceiling")
    add.add_argument("block_id", help="the block's id, e.g. 2024-01")
    add.add_argument("--epsilon", type=float, required=True, help="the block's epsilon ceiling")
    add.add_argument("--delta", type=float, required=True, help="the block's delta ceiling")
    add.add_argument("--start", help="ISO date or time where the block's key range starts")
    add.add_argument("--end", help="ISO date or time where the block's key range ends")

    register = command("register", _register,
                       "mark a pipeline as waiting: new blocks reserve a share for it")
    register.add_argument("pipeline", help="the pipeline's name")
    finish = command("finish", _finish,
                     "the pipeline was accepted or abandoned: its unused reservations return")
    finish.add_argument("pipeline", help="the pipeline's name")

    request = command("request", _request, "grant budget on blocks, all or nothing (JSON out)")
    selector = request.add_mutually_exclusive_group(required=True)
    selector.add_argument("--blocks", help="comma-separated block ids")
    selector.add_argument("--window", type=int, help="the most recent W blocks that can still pay")
    budget = request.add_mutually_exclusive_group(required=True)
    budget.add_argument("--epsilon", type=float,
                        help="epsilon of the grant (on an rdp ledger only with --delta 0: pure DP)")
    budget.add_argument("--gaussian-noise-multiplier", type=float, dest="noise_multiplier",
                        help="charge the RDP curve of a Gaussian mechanism with this noise "
                             "multiplier (noise stddev / L2 sensitivity), from dp-accounting")
    request.add_argument("--compositions", type=int, default=1,
                         help="with --gaussian-noise-multiplier: how many times it runs "
                              "(default: 1)")
    request.add_argument("--delta", type=float,
                         help="delta of the grant (required with --epsilon; on a basic ledger "
                              "the Gaussian's curve is converted at this delta)")
    request.add_argument("--pipeline",
                         help="the pipeline spending (draws on its reservation first)")
    request.error = lambda message: _request_usage_error(request, message)

    show = command("show", _show, "every block's spent, reserved and free budget, and every "
                                  "grant and denial")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")

    plot = command("plot", _plot, "bar chart of spent, reserved and free budget per block")
    plot.add_argument("--out", required=True,
                      help=f"the image to write ({', '.join(PLOT_SUFFIXES)}); its directory "
                           "must exist")

    command("contexts", _contexts, "list the ledger contexts in the store")
    grants = command("grants", _grants, "list every grant and denial: time, outcome, budget, "
                                        "pipeline, front door, blocks, request")
    grants.add_argument("--json", action="store_true", help="print JSON instead of a table")
    command("audit", _audit, "re-derive every balance from the history; exit 6 on a mismatch")
    serve = command("serve", _serve, "a read-only web page of the ledger: blocks, grants, runs, "
                                     "waiting pipelines, with JSON endpoints", context_default=None)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1); any other than a loopback "
                            "address requires a token")
    serve.add_argument("--port", type=int, default=8765,
                       help="port to listen on (default: 8765; 0 picks a free one)")
    serve.add_argument("--token", default=os.environ.get(TOKEN_ENVIRONMENT_VARIABLE) or None,
                       help="the token every request must carry, 16+ characters (default: "
                            f"${TOKEN_ENVIRONMENT_VARIABLE}; generated and printed when --host "
                            "is not a loopback address)")


def _request_usage_error(parser: argparse.ArgumentParser, message: str):
    """`request` prints its JSON object even when its arguments do not parse."""
    parser.print_usage(sys.stderr)
    print(f"sage-tfx ledger request: {message}", file=sys.stderr)
    print(json.dumps({"granted": False, "grant_id": None, "blocks": [], "epsilon": None,
                      "delta": None, "error": message, "remaining": {}}))
    sys.exit(EXIT_BAD_INPUT)


def _print_request_json(args, message: str, remaining: dict | None) -> None:
    """`request` prints its JSON object on stdout whatever happens."""
    if args.command == "request":
        print(json.dumps({"granted": False, "grant_id": None, "blocks": _requested_blocks(args),
                          "epsilon": _json_number(args.epsilon),
                          "delta": _json_number(args.delta), "error": message,
                          "remaining": remaining or {}}))


def _json_number(value: float | None):
    # NaN and infinities are not JSON; echo them as strings so strict parsers still read the line.
    return value if value is None or math.isfinite(value) else str(value)


def _requested_blocks(args) -> list[str]:
    return [b for b in args.blocks.split(",") if b] if args.blocks else []


def _init(args) -> int:
    from sage_tfx.sage_access.errors import BadRequest
    from sage_tfx.sage_access.ledger import BlockLedger
    from sage_tfx.sage_access.store import check_creatable

    if not (math.isfinite(args.min_request) and args.min_request > 0):
        raise BadRequest(f"--min-request must be a positive number, got {args.min_request!r}")
    check_creatable(args.store)  # refuses anything but an absent store or an MLMD store
    ledger = BlockLedger.create(args.store, args.context, args.accounting, args.min_request,
                                for_tests=args.for_tests)
    print(f"created ledger context {ledger.context!r} ({ledger.accounting.name} accounting, "
          f"minimum request epsilon {ledger.min_request_epsilon}"
          f"{', for tests: fixed seeds accepted' if ledger.for_tests else ''}) in {args.store}")
    return 0


def _iso(value: str | None, option: str) -> dt.datetime | None:
    from sage_tfx.sage_access.errors import BadRequest

    if value is None:
        return None
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadRequest(f"{option} must be an ISO date or time such as 2024-01-01 or "
                         f"2024-01-01T00:00:00+00:00, got {value!r}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.timezone.utc)


def _add_block(args) -> int:
    from sage_tfx.sage_access.errors import BadRequest

    start, end = _iso(args.start, "--start"), _iso(args.end, "--end")
    if start and end and start >= end:
        raise BadRequest(f"--start {args.start} must be before --end {args.end}")
    ledger = open_ledger(args)
    block = ledger.add_block(args.block_id, args.epsilon, args.delta, args.start, args.end)
    reserved = ", ".join(sorted(block.reservations)) or "nobody (all free)"
    print(f"added block {block.block_id!r} with ceiling ({block.epsilon_ceiling}, "
          f"{block.delta_ceiling}); reserved for: {reserved}")
    return 0


def _register(args) -> int:
    open_ledger(args).register_pipeline(args.pipeline)
    print(f"pipeline {args.pipeline!r} is waiting: blocks added from now on reserve a share for it")
    return 0


def _finish(args) -> int:
    open_ledger(args).finish_pipeline(args.pipeline)
    print(f"pipeline {args.pipeline!r} finished: its unused reservations returned")
    return 0


def _request(args) -> int:
    from sage_tfx import release
    from sage_tfx.sage_access.errors import BadRequest
    from sage_tfx.sage_access.ledger import BlockIds, RecentWindow

    if args.noise_multiplier is None:
        if args.delta is None:
            raise BadRequest("--epsilon needs --delta (0 for pure DP)")
    elif not (math.isfinite(args.noise_multiplier) and args.noise_multiplier > 0):
        raise BadRequest(f"--gaussian-noise-multiplier must be a positive number, "
                         f"got {args.noise_multiplier!r}")
    elif args.compositions < 1:
        raise BadRequest(f"--compositions must be at least 1, got {args.compositions}")
    ledger = open_ledger(args)
    selector = BlockIds(_requested_blocks(args)) if args.blocks is not None \
        else RecentWindow(args.window)
    if args.noise_multiplier is None and ledger.accounting.requires_step_events and args.delta > 0:
        # The ledger would ask for each step's DP event, which only the Python API can give.
        raise BadRequest("an rdp ledger charges RDP curves: an (epsilon, delta > 0) grant needs "
                         "its mechanism's rdp_curve; use --gaussian-noise-multiplier Z "
                         "[--compositions K], --epsilon E --delta 0 (pure DP), or the Python "
                         "API with the DP event of each step")
    curve = None
    if args.noise_multiplier is not None:
        from dp_accounting import dp_event

        from sage_tfx.sage_access.accounting import rdp_curve_of

        curve = tuple(rdp_curve_of([dp_event.SelfComposedDpEvent(
            dp_event.GaussianDpEvent(args.noise_multiplier), args.compositions)], ledger.orders))
    asked = (f"--blocks {args.blocks}" if args.blocks is not None else f"--window {args.window}")
    asked += (f" --epsilon {args.epsilon} --delta {args.delta}" if curve is None else
              f" --gaussian-noise-multiplier {args.noise_multiplier} --compositions "
              f"{args.compositions} --delta {args.delta}")
    plan = release.ReleasePlan("sage-tfx ledger request", asked,
                               args.epsilon if curve is None else None, args.delta, {}, {},
                               rdp_curve=curve, pipeline=args.pipeline)
    charged = release.charge(ledger, plan, selector)
    charged.issued()
    print(json.dumps(charged.grant.to_json()))
    return 0


def _show(args) -> int:
    ledger = open_ledger(args, read_only=True)
    table = ledger_table(ledger)
    entries = history(ledger.grant_records(), ledger.denial_records())
    if args.json:
        print(json.dumps(dict(table, history=entries), indent=2))
    else:
        print(f"{format_table(table)}\n\ngrants and denials, oldest first:\n"
              f"{format_history(entries)}")
    return 0


def _check_output_path(path: str, suffixes: tuple[str, ...]) -> None:
    """An output file goes into an existing directory and has a suffix we can write."""
    from sage_tfx.sage_access.errors import BadRequest

    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise BadRequest(f"directory {parent} does not exist; create it first (nothing written)")
    if os.path.isdir(path):
        raise BadRequest(f"{path} is a directory; give a file name")
    if not path.lower().endswith(suffixes):
        raise BadRequest(f"{path}: the file name must end in one of {', '.join(suffixes)}")


def _plot(args) -> int:
    from sage_tfx.sage_access.errors import BadRequest

    _check_output_path(args.out, PLOT_SUFFIXES)
    table = ledger_table(open_ledger(args, read_only=True))
    rows = table["blocks"]
    if not rows:
        raise BadRequest("the ledger has no blocks to plot (nothing written)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = plot_bars(rows)
    grouped = len(bars) < len(rows)
    positions = range(len(bars))
    figure, axes = plt.subplots(figsize=(min(16, max(7, 0.28 * len(bars) + 3)), 5))
    bottom = [0.0] * len(bars)
    for part, hatch in (("spent", ""), ("reserved", "//"), ("free", "")):
        values = [bar[part] for bar in bars]
        axes.bar(positions, values, bottom=bottom, color=PLOT_COLOURS[part], hatch=hatch,
                 edgecolor="white", linewidth=0.4, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    crowded = len(bars) > 12
    for index, bar in enumerate(bars):
        text = f"{bar['spent']:.2g}" + (" R" if bar["retired"] else "")
        axes.text(index, bottom[index], text, ha="center", va="bottom", fontsize=7,
                  rotation=90 if crowded else 0)
    unit = accounting_for(table["accounting"]).summary_unit
    axes.set_ylabel(unit + (" (mean per block)" if grouped else ""))
    axes.set_ylim(0, max(bottom) * 1.25)
    axes.set_xticks(list(positions), [bar["label"] for bar in bars], rotation=90 if crowded else 0,
                  fontsize=7)
    total_spent = sum(r["budget"]["spent"] for r in rows)
    retired = sum(r["retired"] for r in rows)
    axes.set_title(f"ledger {table['context']!r} ({table['accounting']}): {len(rows)} blocks"
                   + (f" in groups of {math.ceil(len(rows) / MAX_PLOT_BARS)}" if grouped else "")
                   + f", {retired} retired; number on bar = spent, R = retired", fontsize=9)
    figure.legend(loc="upper right", ncol=3, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out} ({len(rows)} blocks, {len(bars)} bars; "
          f"total spent {total_spent:.4g} {unit})")
    return 0


def _contexts(args) -> int:
    from sage_tfx.sage_access.lineage import ledger_contexts
    from sage_tfx.sage_access.store import connect_read_only

    for name in ledger_contexts(connect_read_only(args.store)):
        print(name)
    return 0


def _grants(args) -> int:
    ledger = open_ledger(args, read_only=True)
    entries = history(ledger.grant_records(), ledger.denial_records())
    print(json.dumps(entries, indent=2) if args.json else format_history(entries))
    return 0


def _audit(args) -> int:
    ledger = open_ledger(args, read_only=True)
    result = ledger.audit()
    for problem in result.problems:
        print(problem)
    if result.problems:
        print(f"sage-tfx ledger audit: {len(result.problems)} inconsistencies in ledger "
              f"{ledger.context!r}", file=sys.stderr)
        return EXIT_AUDIT_FAILED
    print(f"ledger {ledger.context!r}: {result.blocks} blocks and {result.grants} grants agree "
          "with the history")
    return 0


def _serve(args) -> int:
    import secrets
    import socket
    import time

    from sage_tfx.sage_access.errors import BadRequest

    if not 0 <= args.port < 65536:
        raise BadRequest(f"--port must be 0-65535, got {args.port}")
    if args.token is not None and len(args.token) < 16:
        raise BadRequest("--token must be at least 16 characters")
    import uvicorn

    from sage_tfx.sage_access.web.app import LedgerViews, chart_library, create_app, is_loopback

    chart_library()  # a missing install is said now, not after reading the whole store
    token = args.token
    if token is None and not is_loopback(args.host):
        token = secrets.token_urlsafe(32)
        print(f"--host {args.host} is reachable from other machines: every request needs this "
              f"token (Authorization: Bearer TOKEN, or open the address below once): {token}")
    started = time.monotonic()
    views = LedgerViews(args.store, args.context)
    counts = [views.snapshot(name).summary() for name in views.contexts()]
    print(f"read {len(counts)} ledger context(s), {sum(c['blocks'] for c in counts)} blocks and "
          f"{sum(c['grants'] for c in counts)} grants in {time.monotonic() - started:.2f} s")
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((args.host, args.port))
        listener.listen(128)  # connections wait in the backlog until the server accepts them
    except OSError as error:
        raise BadRequest(f"cannot listen on {args.host}:{args.port}: {error.strerror}") from None
    port = listener.getsockname()[1]
    shown_host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(f"serving ledger {args.store} read-only at http://{shown_host}:{port}/"
          + (f"?token={token}" if token else "") + " (Ctrl-C stops)", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(views, token), log_level="warning",
                                           server_header=False))
    server.run(sockets=[listener])
    return 0
