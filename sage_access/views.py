"""The ledger's state as people read it: the table of blocks (`sage-tfx ledger show`, the demo,
the web page), the bars of its plot, the history of grants and denials, and recorded
dp-accounting events in words. Shared by the CLI (cli/ledger.py) and the web view (web/app.py);
neither imports the other. Numbers are rounded here for people only: JSON keeps exact values."""
from __future__ import annotations

import datetime as dt
import math
from fractions import Fraction

from sage_tfx.sage_access.accounting import accounting_for

# Above this many blocks the plot draws one bar per group of consecutive blocks (their mean).
MAX_PLOT_BARS = 60
# A request's text (SQL, a workload spec, a pipeline) in the text views: its whitespace
# collapsed and cut to this many characters; JSON keeps it whole.
SHOWN_REQUEST_CHARS = 100
# A denial's text view names at most this many of the blocks that could not pay.
SHOWN_DENIED_BLOCKS = 3


def ledger_table(ledger) -> dict:
    """The JSON view of `show --json` (also used by the demo and the plot). Each block's
    `guarantee_epsilon`/`guarantee_delta` is what it has given up for sure: under basic
    composition the sums spent (also given as `epsilon_spent`/`delta_spent`), under rdp the
    filter's ceiling once anything was charged (a conversion of the spent curve would be an
    odometer reading, not a bound under adaptive requests, so none is shown)."""
    table = {"context": ledger.context, "accounting": ledger.accounting.name,
             "min_request_epsilon": ledger.min_request_epsilon, "for_tests": ledger.for_tests,
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
             f"{', '.join(table['waiting_pipelines']) or 'none'}"
             + ("; created for tests: fixed seeds accepted, no guarantee where one was used"
                if table.get("for_tests") else "")]
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


def readable(value) -> str:
    """A number for people: 4 significant digits (0.1667, 1e-06), "-" for none. An exact
    fraction as recorded ("0.16666666666666666", a split's) reads the same way."""
    if value is None:
        return "-"
    return f"{float(Fraction(value) if isinstance(value, str) else value):.4g}"


def describe_event(event: dict) -> str:
    """A short text for a dp-accounting event recorded as JSON (accounting.event_to_json)."""
    kind = event["type"].removesuffix("DpEvent")
    if kind == "ZC":
        return f"zCDP(rho={readable(event['rho'])})"
    if kind == "SelfComposed":
        return f"{event['count']}x {describe_event(event['event'])}"
    if kind == "Composed":
        return " + ".join(describe_event(inner) for inner in event["events"])
    if kind == "RepeatAndSelect":
        return f"best of K~(mean {readable(event['mean'])}, shape {readable(event['shape'])}) " \
               f"x {describe_event(event['event'])}"
    if kind == "PoissonSampled":
        return f"PoissonSampled(q={readable(event['sampling_probability'])}, " \
               f"{describe_event(event['event'])})"
    parameters = ", ".join(f"{key}={readable(value)}" for key, value in event.items()
                           if key != "type" and isinstance(value, (int, float)))
    return f"{kind}({parameters})"


def history(grants: list[dict], denials: list[dict]) -> list[dict]:
    """Every grant (BlockLedger.grant_records) and denial (denial_records), oldest first (by
    execution id: both are executions of the one store); each has its `kind` and `outcome`."""
    return sorted(grants + denials, key=lambda entry: entry["execution_id"])


def short_request(text: str | None, limit: int = SHOWN_REQUEST_CHARS) -> str | None:
    """A request's text on one line: whitespace collapsed, cut at `limit` characters."""
    if text is None:
        return None
    line = printable(" ".join(text.split()))
    return line if len(line) <= limit else f"{line[:limit - 1]}… ({len(line)} characters)"


def printable(text: str) -> str:
    """`text` for a terminal: a control character (an escape sequence in a name or request
    someone else wrote could move the cursor or recolour the lines) as its Python escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def describe_split(grant: dict) -> str:
    """A grant's split among DP steps with each step's recorded event, e.g.
    "training=0.9: 3x Gaussian(noise_multiplier=40); validation=0.1: zCDP(rho=0.00045)"."""
    events = grant["events"] or {}
    return "; ".join(
        f"{step}={readable(fraction)}"
        + (f": {describe_event(events[step])}" if step in events else "")
        for step, fraction in (grant["split"] or {}).items())


def format_history(entries: list[dict]) -> str:
    """The text view of a `history` (`ledger grants`, `ledger show`): one line per grant or
    denial (time, outcome, epsilon, delta, pipeline, front door, blocks), then indented lines
    for what it has: its split, run, why it failed or was denied, and its request (shortened)."""
    lines = [f"{'time (UTC)':<19}  {'outcome':<11} {'epsilon':>8} {'delta':>8}  "
             f"{'pipeline':<16} {'front door':<22} blocks"]
    for entry in entries:
        moment = dt.datetime.fromtimestamp(entry["time_ms"] / 1000, tz=dt.timezone.utc)
        epsilon = "rdp" if entry["epsilon"] is None else readable(entry["epsilon"])
        details = []
        if entry["kind"] == "denial":
            short = list(entry["free"])
            blocks = ",".join(short[:SHOWN_DENIED_BLOCKS]) + (
                f" and {len(short) - SHOWN_DENIED_BLOCKS} more" if len(short) > SHOWN_DENIED_BLOCKS
                else "") + " could not pay"
            details += [f"{block} had: {entry['free'][block]}"
                        for block in short[:SHOWN_DENIED_BLOCKS]]
        else:
            blocks = ",".join(entry["blocks"])
            split = describe_split(entry)
            details += [f"split: {split}"] if split else []
            details += [f"run: {entry['run_id']}"] if entry["run_id"] else []
            reasons: dict[str, list[str]] = {}  # steps recorded together share their reason
            for step, record in entry["steps"].items():
                if record["reason"]:
                    reasons.setdefault(record["reason"], []).append(step)
            details += [f"{', '.join(steps)}: {reason}" for reason, steps in reasons.items()]
            artifacts = list(dict.fromkeys(  # steps released together name the same files
                a for record in entry["steps"].values() for a in record["artifacts"]))
            details += [f"released: {', '.join(artifacts)}"] if artifacts else []
        request = short_request(entry["request"])
        details += [f"request: {request}"] if request else []
        lines.append(f"{moment:%Y-%m-%d %H:%M:%S}  {entry['outcome']:<11} {epsilon:>8} "
                     f"{readable(entry['delta']):>8}  {printable(entry['pipeline'] or '-'):<16} "
                     f"{printable(entry['front_door'] or '-'):<22} {printable(blocks)}")
        lines += [f"    {detail}" for detail in details]
    if not entries:
        lines.append("(no grants or denials yet)")
    return "\n".join(lines)
