"""The BlockLedger component refuses blocks that hold no data before charging them."""
import pytest
from tfx.types import standard_artifacts

from sage_tfx.components.block_ledger import executor
from sage_tfx.components.privacy_grant import PrivacyGrant
from sage_tfx.sage_access import BlockLedger
from sage_tfx.sage_access.errors import BadRequest


@pytest.mark.parametrize("selector", [{"block_ids": '["with-data", "no-data"]'},
                                      {"window": 2}], ids=["explicit blocks", "window"])
def test_blocks_without_data_are_refused_and_nothing_is_charged(store_path, tmp_path, selector):
    """The ledger checks the blocks the grant takes, in its transaction (require_data)."""
    ledger = BlockLedger.create(store_path, min_request_epsilon=0.05)
    ledger.add_block("with-data", 1.0, 1e-6, data_uri=str(tmp_path / "with-data"))
    ledger.add_block("no-data", 1.0, 1e-6)
    examples, grant = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant.uri = str(tmp_path / "out-examples"), str(tmp_path / "out-grant")
    properties = {"ledger_store": store_path, "ledger_context": "default", "epsilon": 0.3,
                  "delta": 0.0, "split": '{"all": 1.0}', **selector}
    with pytest.raises(BadRequest, match="no-data.*nothing was charged"):
        executor.Executor().Do({}, {"examples": [examples], "grant": [grant]}, properties)
    assert [b.spent[0] for b in BlockLedger(store_path).blocks()] == [0.0, 0.0]
