"""A process that replays a small deterministic stream through the DP-SQLP local engine,
charging a real ledger (the durability test kills it mid-stream and restarts it).

Usage: python -m support.stream_worker STORE STATE_DIR OUT_DIR NOISE_KEY_HEX SLEEP_S
Each micro-batch is handed over SLEEP_S seconds after the previous one, so a kill lands
mid-stream; the noise key is fixed (tests only) so an uninterrupted run is its oracle."""
import sys
import time

import numpy as np
import pandas as pd

from sage_tfx.dp_statistics.continual import local
from sage_tfx.dp_statistics.continual.budget import plan
from sage_tfx.dp_statistics.continual.spec import StreamQuery
from sage_tfx.sage_access import BlockIds, BlockLedger

BLOCKS = ("w1", "w2")
QUERY = StreamQuery(key_column="area", unit_column="taxi", time_column="time",
                    value_column="fare", value_bound=20.0, contribution_limit=4,
                    micro_batches=16, epsilon=8.0, delta=1e-5)
SNAPSHOT_EVERY = 4  # a restart both loads a saved state and replays committed steps after it


def budget(mechanism: str = "tree"):
    return plan(QUERY.epsilon, QUERY.delta, QUERY.micro_batches, QUERY.contribution_limit,
                QUERY.value_bound, mechanism=mechanism)


def stream(sleep_s: float = 0.0):
    """16 micro-batches of 150 records (400 units, 12 keys, fares around 10); step 7 is empty
    (the engine still runs it)."""
    rng = np.random.default_rng(19)
    for step in range(1, QUERY.micro_batches + 1):
        if step == 7:
            continue
        size = 150
        frame = pd.DataFrame({"unit": rng.integers(0, 400, size),
                              "key": np.minimum(rng.zipf(1.6, size), 12),
                              "value": np.round(rng.gamma(4.0, 2.5, size), 2)})
        time.sleep(sleep_s)
        yield step, frame


def charge(ledger: BlockLedger, stream_budget):
    """The window's one grant: (epsilon, delta) on its blocks, thresholding's delta outside the
    trees' event (a basic ledger: the ledger's event JSON does not know tree aggregation yet)."""
    def request():
        grant = ledger.request(BlockIds(BLOCKS), QUERY.epsilon, QUERY.delta,
                               additional_delta=stream_budget.additional_delta)
        return grant.grant_id, grant.blocks
    return request


def main(store: str, state_dir: str, out_dir: str, noise_key: str, sleep_s: float) -> None:
    stream_budget = budget()
    local.run_local(QUERY, stream_budget, stream(sleep_s), state_dir,
                    local.CsvDirectorySink(out_dir), charge=charge(BlockLedger(store),
                                                                    stream_budget),
                    noise_key=bytes.fromhex(noise_key), snapshot_every=SNAPSHOT_EVERY)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
