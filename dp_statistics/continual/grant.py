"""The window's one grant (charge before release), shared by `sage-tfx stream` and the
ContinualRelease component, paid through the release protocol (sage_tfx.release).

A window is paid once: one ledger grant on its blocks, of the (epsilon, delta) the operator's
budget was planned at, recording the dp-accounting event that runs (budget.event: the selection
and value trees composed) and the delta the key-selection coupling spends outside it
(budget.additional_delta, (e^eps + 1) C beta; a basic ledger charges it within delta, an rdp
ledger refuses the grant before charging). Its single share is consumed at once, so no other
consumer can spend the grant. The engine (local.run_local) charges it once and keeps its id in
the window's state; a restart finds the grant by that id and checks it pays for this window,
never charging again.

Outcome. A window resumes after a crash or Ctrl-C, so its grant stays `incomplete` in the ledger
until the window's last trigger is released, when `record_window_released` records it
`released` with the release directory and the guarantee.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

from sage_tfx import release
from sage_tfx.sage_access.accounting import event_from_json
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.ledger import BlockIds, BlockLedger, Grant

STEP = "continual_release"


def window_plan(query, budget, front_door: str, pipeline: Optional[str] = None,
                run_id: Optional[str] = None) -> release.ReleasePlan:
    """What the window's grant pays for; the request recorded is the query's spec."""
    return release.ReleasePlan.single_step(
        front_door, json.dumps(query.to_json(), sort_keys=True), STEP, budget.epsilon,
        budget.delta, budget.event, additional_delta=budget.additional_delta,
        pipeline=pipeline, run_id=run_id)


def request_window_grant(ledger: BlockLedger, block_ids: Sequence[str],
                         plan: release.ReleasePlan) -> Grant:
    """Charge the window's grant (all or nothing: BudgetExhausted, recorded as a denial, or
    BadRequest, nothing charged) and consume its share for the plan's front door."""
    charged = release.charge(ledger, plan, BlockIds(block_ids))
    charged.share(STEP)
    return charged.grant


def window_grant(ledger: BlockLedger, grant_id: str, block_ids: Sequence[str],
                 budget) -> Grant:
    """The grant a restart resumes under: it must be this ledger's, on exactly these blocks,
    for this budget and event (BadRequest naming what differs)."""
    grant = ledger.find_grant(grant_id)
    recorded = grant.events.get(STEP)
    differ = []
    if sorted(grant.blocks) != sorted(block_ids):
        differ.append(f"blocks {list(grant.blocks)}, the window has {list(block_ids)}")
    if (grant.epsilon, grant.delta) != (budget.epsilon, budget.delta):
        differ.append(f"({grant.epsilon}, {grant.delta}) granted, ({budget.epsilon}, "
                      f"{budget.delta}) planned")
    if dict(grant.split) != {STEP: "1"} or recorded is None or \
            event_from_json(recorded) != budget.event:
        differ.append("it was not made for this operator's event")
    if differ:
        raise BadRequest(f"grant {grant_id} does not pay for this window: {'; '.join(differ)}")
    return grant


def record_window_released(ledger: BlockLedger, grant_id: str, front_door: str,
                           release_dir: str, guarantee: release.Guarantee) -> None:
    """Record the window's grant `released` (once: a re-run of a complete window finds the
    outcome recorded and leaves it)."""
    grant = ledger.find_grant(grant_id)
    if STEP in ledger.grant_outcomes(grant_id):
        return
    release.consume(ledger, grant, [STEP], front_door).released([release_dir], guarantee)
