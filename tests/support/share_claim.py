"""A process claiming one share of a grant (tests/components/test_privacy_grant.py's race).
Apart from the test module so that a spawned process imports the ledger only: the test module
imports TFX and the BlockLedger executor (TensorFlow), about 5 s of CPU in every child."""
import os

from sage_tfx.sage_access import BadRequest, BlockLedger


def claim(store_path, grant_id, step, queue):
    """Use share `step` of grant `grant_id` as this process; put "won" or "refused" on `queue`."""
    ledger = BlockLedger(store_path)
    try:
        ledger.use_share(ledger.find_grant(grant_id), step, f"pid-{os.getpid()}")
        queue.put("won")
    except BadRequest:
        queue.put("refused")
