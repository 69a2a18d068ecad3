"""`sage-tfx ledger ...`: the BlockLedger from the command line.

    sage-tfx ledger [--store STORE] COMMAND [--store STORE] [--context NAME] ...

    init        create a ledger context (the only command that creates a store)
    add-block   register a new block with its budget ceiling
    register    mark a pipeline as waiting: new blocks reserve a share for it
    finish      the pipeline is done: its unused reservations return
    request     grant budget on blocks, all or nothing (prints one JSON object, always)
    show        every block's spent, reserved (per pipeline) and free budget
    plot        the same as a PNG/SVG/PDF bar chart
    contexts    the ledger contexts in the store
    grants      every grant: time, pipeline, blocks, epsilon, delta, split, run
    audit       re-derive every balance from the history and report inconsistencies
    serve       a read-only web page of all the above, with JSON endpoints (localhost unless
                --host says otherwise, and then only with a token)

STORE is an SQLite file or grpc://HOST:PORT of an ML Metadata server (Kubeflow:
grpc://metadata-grpc-service:8080); it defaults to $SAGE_TFX_LEDGER_STORE. Only `init` creates a
store; every other command refuses a file that is not a sage-tfx ledger and leaves it unchanged,
and `show`, `plot`, `contexts`, `grants`, `audit` and `serve` open the store read-only.

Exit codes: 0 success; 2 bad input or a store that is not a ledger (nothing written); 3 request
denied for lack of budget (nothing charged); 4 ledger busy (too many concurrent writers; nothing
charged); 5 store unreachable (gRPC or MySQL server down or unknown, or refusing the login); 6
audit found inconsistencies.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys

# Light (no dp_accounting, no TensorFlow); the package's __init__ imports it anyway.
from sage_tfx.sage_access.accounting import AccountingMode, accounting_for

EXIT_BAD_INPUT = 2
EXIT_DENIED = 3
EXIT_BUSY = 4
EXIT_UNREACHABLE = 5
EXIT_AUDIT_FAILED = 6
STORE_ENVIRONMENT_VARIABLE = "SAGE_TFX_LEDGER_STORE"
TOKEN_ENVIRONMENT_VARIABLE = "SAGE_TFX_LEDGER_TOKEN"
# Above this many blocks the plot draws one bar per group of consecutive blocks (their mean).
MAX_PLOT_BARS = 60
# Okabe & Ito's colour-blind-safe palette: spent, reserved, free.
PLOT_COLOURS = {"spent": "#D55E00", "reserved": "#E69F00", "free": "#0072B2"}
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def add_parser(groups: argparse._SubParsersAction) -> None:
    parser = groups.add_parser("ledger", help="the privacy-budget ledger: blocks, grants, budgets",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    store_help = (f"SQLite ledger file or grpc://HOST:PORT (default: ${STORE_ENVIRONMENT_VARIABLE}"
                  "); also accepted after the command")
    parser.add_argument("--store", default=os.environ.get(STORE_ENVIRONMENT_VARIABLE),
                        help=store_help)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler, help_text: str,
                context_default: str | None = "default") -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        # SUPPRESS: given here it overrides the group's --store; absent, the group's value stays.
        sub.add_argument("--store", default=argparse.SUPPRESS, help=store_help)
        sub.add_argument("--context", default=context_default,
                         help="ledger context: an independent set of budgets (default: "
                              f"{context_default or 'every context in the store'})")
        sub.set_defaults(run=lambda args: _run(handler, args))
        return sub

    init = command("init", _init, "create a ledger context (creates the store if needed)")
    init.add_argument("--accounting", choices=AccountingMode.values(),
                      default=AccountingMode.BASIC,
                      help="basic: epsilons and deltas add up per block; rdp: a Renyi-DP filter "
                           "per block (default: basic)")
    init.add_argument("--min-request", type=float, default=0.01, dest="min_request",
                      help="the stream's minimum request epsilon: blocks that cannot pay it "
                           "retire (default: 0.01)")

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

    show = command("show", _show, "every block's spent, reserved and free budget")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")

    plot = command("plot", _plot, "bar chart of spent, reserved and free budget per block")
    plot.add_argument("--out", required=True,
                      help=f"the image to write ({', '.join(PLOT_SUFFIXES)}); its directory "
                           "must exist")

    command("contexts", _contexts, "list the ledger contexts in the store")
    grants = command("grants", _grants, "list every grant: time, pipeline, blocks, budget, run")
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


def _run(handler, args) -> int:
    from ml_metadata import errors as mlmd_errors

    from sage_tfx.sage_access.errors import BadRequest, BudgetExhausted, LedgerBusy
    from sage_tfx.sage_access.store import StoreUnreachable

    try:
        if not args.store:
            raise BadRequest(f"no store: pass --store FILE|grpc://HOST:PORT|mysql://... or set "
                             f"{STORE_ENVIRONMENT_VARIABLE}")
        return handler(args)
    except BadRequest as error:
        return _fail(args, EXIT_BAD_INPUT, str(error))
    except BudgetExhausted as error:
        return _fail(args, EXIT_DENIED, str(error), error.remaining)
    except LedgerBusy as error:
        return _fail(args, EXIT_BUSY, str(error))
    except StoreUnreachable as error:  # a MySQL server down or refusing the login
        return _fail(args, EXIT_UNREACHABLE, str(error))
    except (mlmd_errors.UnavailableError,
            mlmd_errors.DeadlineExceededError) as error:
        return _fail(args, EXIT_UNREACHABLE, f"store {args.store} is unreachable: "
                                             f"{str(error).splitlines()[0]}")
    except mlmd_errors.NotFoundError:
        return _fail(args, EXIT_BAD_INPUT, f"store {args.store} has no sage-tfx ledger; create "
                                           f"one with `sage-tfx ledger --store {args.store} init`")
    except mlmd_errors.StatusError as error:
        return _fail(args, EXIT_BAD_INPUT, f"store {args.store} cannot be used: "
                                           f"{str(error).splitlines()[0]}")


def _fail(args, code: int, message: str, remaining: dict | None = None) -> int:
    # `sage-tfx ingest` and `query` (dp_statistics/cli.py) share this error handling.
    where = f"ledger {args.command}" if getattr(args, "group", "ledger") == "ledger" \
        else args.group
    print(f"sage-tfx {where}: {message}", file=sys.stderr)
    if args.command == "request":
        print(json.dumps({"granted": False, "grant_id": None, "blocks": _requested_blocks(args),
                          "epsilon": _json_number(args.epsilon),
                          "delta": _json_number(args.delta), "error": message,
                          "remaining": remaining or {}}))
    return code


def _request_usage_error(parser: argparse.ArgumentParser, message: str):
    """`request` prints its JSON object even when its arguments do not parse."""
    parser.print_usage(sys.stderr)
    print(f"sage-tfx ledger request: {message}", file=sys.stderr)
    print(json.dumps({"granted": False, "grant_id": None, "blocks": [], "epsilon": None,
                      "delta": None, "error": message, "remaining": {}}))
    sys.exit(EXIT_BAD_INPUT)


def _json_number(value: float | None):
    # NaN and infinities are not JSON; echo them as strings so strict parsers still read the line.
    return value if value is None or math.isfinite(value) else str(value)


def _requested_blocks(args) -> list[str]:
    return [b for b in args.blocks.split(",") if b] if args.blocks else []


def _open(args, read_only: bool = False):
    """The ledger context; the store must already hold it (only init creates). A writing
    command first opens it read-only, so a store without the context is never written to (an
    MLMD server included, where a read-write open would register sage-tfx's types)."""
    from sage_tfx.sage_access.ledger import BlockLedger

    checked = BlockLedger(args.store, args.context, read_only=True)
    return checked if read_only else BlockLedger(args.store, args.context)


def _init(args) -> int:
    from sage_tfx.sage_access.errors import BadRequest
    from sage_tfx.sage_access.ledger import BlockLedger
    from sage_tfx.sage_access.store import check_creatable

    if not (math.isfinite(args.min_request) and args.min_request > 0):
        raise BadRequest(f"--min-request must be a positive number, got {args.min_request!r}")
    check_creatable(args.store)  # refuses anything but an absent store or an MLMD store
    ledger = BlockLedger.create(args.store, args.context, args.accounting, args.min_request)
    print(f"created ledger context {ledger.context!r} ({ledger.accounting.name} accounting, "
          f"minimum request epsilon {ledger.min_request_epsilon}) in {args.store}")
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
    ledger = _open(args)
    block = ledger.add_block(args.block_id, args.epsilon, args.delta, args.start, args.end)
    reserved = ", ".join(sorted(block.reservations)) or "nobody (all free)"
    print(f"added block {block.block_id!r} with ceiling ({block.epsilon_ceiling}, "
          f"{block.delta_ceiling}); reserved for: {reserved}")
    return 0


def _register(args) -> int:
    _open(args).register_pipeline(args.pipeline)
    print(f"pipeline {args.pipeline!r} is waiting: blocks added from now on reserve a share for it")
    return 0


def _finish(args) -> int:
    _open(args).finish_pipeline(args.pipeline)
    print(f"pipeline {args.pipeline!r} finished: its unused reservations returned")
    return 0


def _request(args) -> int:
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
    ledger = _open(args)
    selector = BlockIds(_requested_blocks(args)) if args.blocks is not None \
        else RecentWindow(args.window)
    if args.noise_multiplier is None and ledger.accounting.requires_step_events and args.delta > 0:
        # The ledger would ask for each step's DP event, which only the Python API can give.
        raise BadRequest("an rdp ledger charges RDP curves: an (epsilon, delta > 0) grant needs "
                         "its mechanism's rdp_curve; use --gaussian-noise-multiplier Z "
                         "[--compositions K], --epsilon E --delta 0 (pure DP), or the Python "
                         "API with the DP event of each step")
    if args.noise_multiplier is None:
        grant = ledger.request(selector, epsilon=args.epsilon, delta=args.delta,
                               pipeline=args.pipeline)
    else:
        from dp_accounting import dp_event

        from sage_tfx.sage_access.accounting import rdp_curve_of

        curve = list(rdp_curve_of([dp_event.SelfComposedDpEvent(
            dp_event.GaussianDpEvent(args.noise_multiplier), args.compositions)], ledger.orders))
        grant = ledger.request(selector, rdp_curve=curve, delta=args.delta,
                               pipeline=args.pipeline)
    print(json.dumps(grant.to_json()))
    return 0


def ledger_table(ledger) -> dict:
    """The JSON view of `show --json` (also used by the demo and the plot). Each block's
    `guarantee_epsilon`/`guarantee_delta` is what it has given up for sure: under basic
    composition the sums spent (also given as `epsilon_spent`/`delta_spent`), under rdp the
    filter's ceiling once anything was charged (a conversion of the spent curve would be an
    odometer reading, not a bound under adaptive requests, so none is shown)."""
    table = {"context": ledger.context, "accounting": ledger.accounting.name,
             "min_request_epsilon": ledger.min_request_epsilon,
             "waiting_pipelines": ledger.waiting_pipelines(),
             "blocks": [block_row(ledger, block) for block in ledger.blocks()]}
    if ledger.accounting.guarantee_note is not None:
        table["guarantee"] = ledger.accounting.guarantee_note
    return table


def block_row(ledger, block) -> dict:
    """One block's row of `ledger_table`."""
    guarantee_epsilon, guarantee_delta = ledger.accounting.guarantee(
        block.spent, block.epsilon_ceiling, block.delta_ceiling)
    row = {"id": block.block_id, "epsilon_ceiling": block.epsilon_ceiling,
           "delta_ceiling": block.delta_ceiling, "guarantee_epsilon": guarantee_epsilon,
           "guarantee_delta": guarantee_delta}
    if ledger.accounting.guarantee_is_spent:
        row.update(epsilon_spent=guarantee_epsilon, delta_spent=guarantee_delta)
    row.update({"retired": block.retired, "charges": block.charges, "start": block.start,
                "end": block.end, "reserved_for": sorted(block.reservations),
                "budget": ledger.accounting.budget_view(block)})
    return row


def format_table(table: dict) -> str:
    """`show`'s text view of a `ledger_table`, laid out as its accounting presents its unit."""
    accounting = accounting_for(table["accounting"])
    lines = [f"ledger {table['context']!r}: {table['accounting']} accounting, minimum request "
             f"epsilon {table['min_request_epsilon']}, waiting pipelines: "
             f"{', '.join(table['waiting_pipelines']) or 'none'}"]
    if accounting.show_note:
        lines.append(accounting.show_note)
    header = " ".join([f"{'block':<20}"] + [f"{column.title:>{column.width}}"
                                           for column in accounting.show_columns]
                      + [f"{'charges':>7}  state  reserved for"])
    lines += [header, "-" * len(header)]
    for row in table["blocks"]:
        state = "retired" if row["retired"] else "live   "
        owners = ", ".join(f"{name} {value * accounting.show_scale:.4g}"
                           for name, value in row["budget"]["reserved"].items() if value > 0) \
            or "-"
        lines.append(" ".join([f"{row['id']:<20}"] + [f"{column.cell(row):>{column.width}}"
                                                      for column in accounting.show_columns]
                              + [f"{row['charges']:>7}  {state}  {owners}"]))
    return "\n".join(lines)


def _show(args) -> int:
    table = ledger_table(_open(args, read_only=True))
    print(json.dumps(table, indent=2) if args.json else format_table(table))
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


def plot_bars(rows: list[dict]) -> list[dict]:
    """One bar per block, or per group of consecutive blocks (their mean) above MAX_PLOT_BARS."""
    size = max(1, math.ceil(len(rows) / MAX_PLOT_BARS))
    bars = []
    for first in range(0, len(rows), size):
        group = rows[first:first + size]
        mean = lambda key: sum(key(r["budget"]) for r in group) / len(group)  # noqa: E731
        bars.append({
            "label": group[0]["id"] if len(group) == 1 else f"{group[0]['id']}..{group[-1]['id']}",
            "spent": mean(lambda b: b["spent"]),
            "reserved": mean(lambda b: sum(b["reserved"].values())),
            "free": mean(lambda b: b["free"]), "retired": all(r["retired"] for r in group)})
    return bars


def _plot(args) -> int:
    from sage_tfx.sage_access.errors import BadRequest

    _check_output_path(args.out, PLOT_SUFFIXES)
    table = ledger_table(_open(args, read_only=True))
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


def describe_event(event: dict) -> str:
    """A short text for a dp-accounting event recorded as JSON (accounting.event_to_json)."""
    kind = event["type"].removesuffix("DpEvent")
    if kind == "ZC":
        return f"zCDP(rho={event['rho']:g})"
    if kind == "SelfComposed":
        return f"{event['count']}x {describe_event(event['event'])}"
    if kind == "Composed":
        return " + ".join(describe_event(inner) for inner in event["events"])
    if kind == "PoissonSampled":
        return f"PoissonSampled(q={event['sampling_probability']:g}, " \
               f"{describe_event(event['event'])})"
    parameters = ", ".join(f"{key}={value:g}" for key, value in event.items()
                           if key != "type" and isinstance(value, (int, float)))
    return f"{kind}({parameters})"


def _grants(args) -> int:
    records = _open(args, read_only=True).grant_records()
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    print(f"{'time (UTC)':<19} {'pipeline':<16} {'epsilon':>8} {'delta':>8}  blocks  "
          "split (step=fraction: recorded DP event)  run")
    for record in records:
        moment = dt.datetime.fromtimestamp(record["time_ms"] / 1000, tz=dt.timezone.utc)
        epsilon = "rdp" if record["epsilon"] is None else f"{record['epsilon']:.4g}"
        delta = "-" if record["delta"] is None else f"{record['delta']:.3g}"
        events = record["events"] or {}
        split = "; ".join(
            f"{step}={fraction}" + (f": {describe_event(events[step])}" if step in events else "")
            for step, fraction in (record["split"] or {}).items()) or "-"
        print(f"{moment:%Y-%m-%d %H:%M:%S} {record['pipeline'] or '-':<16} {epsilon:>8} "
              f"{delta:>8}  {','.join(record['blocks'])}  {split}  {record['run_id'] or '-'}")
    return 0


def _audit(args) -> int:
    ledger = _open(args, read_only=True)
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
