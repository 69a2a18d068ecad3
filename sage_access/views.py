"""The ledger's state as people read it: the table of blocks (`sage-tfx ledger show`, the demo,
the web page), the bars of its plot, and recorded dp-accounting events in words. Shared by the
CLI (cli/ledger.py) and the web view (web/app.py); neither imports the other."""
from __future__ import annotations

import math

from sage_tfx.sage_access.accounting import accounting_for

# Above this many blocks the plot draws one bar per group of consecutive blocks (their mean).
MAX_PLOT_BARS = 60


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
