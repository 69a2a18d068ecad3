"""A process that grants random overlapping requests on a shared ledger (used by the stress and
crash tests). Prints one JSON line per grant it committed."""
import json
import random
import sys

from sage_tfx.sage_access import BlockIds, BlockLedger, BudgetExhausted, RecentWindow


def main(store: str, seed: int, requests: int, blocks: int) -> None:
    rng = random.Random(seed)
    ledger = BlockLedger(store)
    for _ in range(requests):
        if rng.random() < 0.2:
            selector = RecentWindow(rng.randint(1, 5))
        else:
            selector = BlockIds(rng.sample([f"b{i:02d}" for i in range(blocks)], rng.randint(1, 6)))
        try:
            grant = ledger.request(selector, epsilon=rng.choice([0.05, 0.1, 0.2]),
                                   delta=rng.choice([0.0, 1e-8]), pipeline=f"worker{seed}")
        except BudgetExhausted:
            continue
        except Exception as error:  # retired blocks are chosen at random too
            if "retired" not in str(error):
                raise
            continue
        print(json.dumps({"grant_id": grant.grant_id, "blocks": grant.blocks,
                          "epsilon": grant.epsilon, "delta": grant.delta}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
