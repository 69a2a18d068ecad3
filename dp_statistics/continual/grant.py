"""The window's one grant (charge before release), shared by `sage-tfx stream` and the
ContinualRelease component.

A window is paid once: one ledger grant on its blocks, of the (epsilon, delta) the operator's
budget was planned at, recording the dp-accounting event that runs (budget.event: the selection
and value trees composed) and the delta the key-selection coupling spends outside it
(budget.additional_delta, (e^eps + 1) C beta; a basic ledger charges it within delta, an rdp
ledger refuses the grant before charging). Its single share is consumed at once, so no other
consumer can spend the grant. A restart finds the grant by its id (kept in the operator's state)
and checks it is this window's, never charging again.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from sage_tfx.sage_access.accounting import event_from_json
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.ledger import BlockIds, BlockLedger, Grant

STEP = "continual_release"
STREAM_FILE = "stream.json"  # in a window's directory: its public parameters and grant id


def request_window_grant(ledger: BlockLedger, block_ids: Sequence[str], budget,
                         consumer: str, pipeline: Optional[str] = None,
                         run_id: Optional[str] = None) -> Grant:
    """Charge the window's grant (all or nothing: BudgetExhausted or BadRequest, nothing
    charged) and consume its share for `consumer`."""
    grant = ledger.request(BlockIds(block_ids), epsilon=budget.epsilon, delta=budget.delta,
                           pipeline=pipeline, run_id=run_id, split={STEP: "1"},
                           events={STEP: budget.event},
                           additional_delta=budget.additional_delta)
    ledger.use_share(grant, STEP, consumer=consumer)
    return grant


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


def stream_grant(ledger: BlockLedger, directory: str, parameters: dict, budget, consumer: str,
                 pipeline: Optional[str] = None, run_id: Optional[str] = None) -> str:
    """The grant id of the window kept in `directory`: the one recorded there (a restart or a
    later run: nothing charged; `parameters`, the window's public description, must be the
    recorded ones), or a new grant charged now.

    Order: request (the charge) -> consume its one share -> write `directory`/stream.json
    atomically. A crash before the last step leaves a charged grant that released nothing; the
    next run charges again (budget wasted, never a release without a charge, never two
    releases of a micro-batch with fresh noise)."""
    path = os.path.join(directory, STREAM_FILE)
    if os.path.exists(path):
        with open(path) as handle:
            recorded = json.load(handle)
        grant_id = recorded.pop("grant_id")
        if recorded != parameters:
            changed = sorted(k for k in parameters.keys() | recorded.keys()
                             if recorded.get(k) != parameters.get(k))
            raise BadRequest(f"{directory} holds a stream with other parameters ("
                             + "; ".join(f"{k}: {recorded.get(k)!r}, now {parameters.get(k)!r}"
                                         for k in changed)
                             + "); resume it with the same ones or use a new directory")
        window_grant(ledger, grant_id, parameters["window_blocks"], budget)
        return grant_id
    if os.path.isdir(directory) and os.listdir(directory):
        raise BadRequest(f"{directory} is not empty and holds no stream; use a new directory")
    grant = request_window_grant(ledger, parameters["window_blocks"], budget, consumer,
                                 pipeline, run_id)
    os.makedirs(directory, exist_ok=True)
    partial = path + ".partial"
    with open(partial, "w") as handle:
        json.dump(parameters | {"grant_id": grant.grant_id}, handle, indent=1)
    os.replace(partial, path)
    return grant.grant_id
