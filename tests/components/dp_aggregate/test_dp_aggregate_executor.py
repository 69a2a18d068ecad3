"""DPAggregate's executor on a real SQLite ledger and Beam's DirectRunner, without a pipeline."""
import json

import pandas as pd
from support.trip_blocks import write_examples
from tfx.types import standard_artifacts

from sage_tfx.components.block_ledger import executor as ledger_executor
from sage_tfx.components.dp_aggregate import DPAggregate, DPStatistics, executor
from sage_tfx.components.privacy_grant import PrivacyGrant
from sage_tfx.dp_statistics import tables
from sage_tfx.sage_access import BlockLedger
from sage_tfx.sage_access import ledger as ledger_module

QUERY = ("SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1, public_groups = (1, 2)) "
         "area, ANON_COUNT(*) AS trips FROM trips GROUP BY area")
COLUMNS = {"uid": "int", "area": "int"}


def test_the_executor_reuses_the_ledger_the_grant_check_opened(tmp_path, monkeypatch):
    store = str(tmp_path / "ledger.sqlite")
    ledger = BlockLedger.create(store)
    for index in range(2):  # blocks cut by uid: the release is for the user, and says so
        data = str(tmp_path / f"users-{index}")
        write_examples(data, [{"uid": 10 * index + i, "area": 1 + i % 2} for i in range(6)])
        tables.record_block_key(data, "uid")
        ledger.add_block(f"users-{index}", 2.0, 1e-5, data_uri=data)
    examples, grant = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant.uri = str(tmp_path / "examples"), str(tmp_path / "grant")
    ledger_executor.Executor().Do({}, {"examples": [examples], "grant": [grant]}, {
        "ledger_store": store, "ledger_context": "default", "epsilon": 1.0, "delta": 1e-6,
        "window": 2, "split": json.dumps(DPAggregate.split(QUERY, "uid", COLUMNS, 1.0, 1e-6))})

    opened = []
    original = ledger_module.BlockLedger.__init__
    monkeypatch.setattr(ledger_module.BlockLedger, "__init__",
                        lambda self, *args, **kw: (opened.append(args), original(self, *args,
                                                                                   **kw))[1])
    statistics = DPStatistics()
    statistics.uri = str(tmp_path / "statistics")
    executor.Executor().Do({"examples": [examples], "grant": [grant]},
                           {"statistics": [statistics]},
                           {"query": QUERY, "unit_column": "uid",
                            "columns": json.dumps(COLUMNS)})
    assert len(opened) == 1  # require_grant's; the unit is read through the same ledger
    assert statistics.get_string_custom_property("unit") == "all rows of one uid"
    released = pd.read_csv(tmp_path / "statistics" / "release.csv")
    assert list(released["area"]) == [1, 2]
