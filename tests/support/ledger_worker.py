"""A process that grants random overlapping requests on a shared ledger (used by the stress and
crash tests). Prints one JSON line per grant it committed.

After its random requests, a worker drains (unless its fifth argument is "no-drain"): it requests
the minimum epsilon from each block until the ledger refuses, so when all workers are done every
block must be retired."""
import json
import random
import sys

from sage_tfx.sage_access import BlockIds, BlockLedger, BudgetExhausted, RecentWindow


def try_request(ledger: BlockLedger, selector, epsilon: float, delta: float, pipeline: str) -> bool:
    try:
        grant = ledger.request(selector, epsilon=epsilon, delta=delta, pipeline=pipeline)
    except BudgetExhausted as denied:
        print(denied, file=sys.stderr, flush=True)
        return False
    except Exception as error:  # retired blocks are chosen at random too
        if "retired" not in str(error):
            raise
        return False
    print(json.dumps({"grant_id": grant.grant_id, "blocks": grant.blocks,
                      "epsilon": grant.epsilon, "delta": grant.delta}), flush=True)
    return True


def main(store: str, seed: int, requests: int, blocks: int, drain: bool = True) -> None:
    rng = random.Random(seed)
    ledger = BlockLedger(store)
    block_ids = [f"b{i:02d}" for i in range(blocks)]
    pipeline = f"worker{seed}"
    for _ in range(requests):
        if rng.random() < 0.2:
            selector = RecentWindow(rng.randint(1, 5))
        else:
            selector = BlockIds(rng.sample(block_ids, rng.randint(1, 6)))
        try_request(ledger, selector, rng.choice([0.05, 0.1, 0.2]), rng.choice([0.0, 1e-8]), pipeline)
    if not drain:
        return
    for block_id in rng.sample(block_ids, blocks):
        while try_request(ledger, BlockIds([block_id]), ledger.min_request_epsilon, 0.0, pipeline):
            pass


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
         drain=sys.argv[5:] != ["no-drain"])
