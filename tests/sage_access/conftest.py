"""The ledger tests run on both backends (`store_path` is an SQLite file or a new database on a
throwaway MariaDB); a ledger store filled through the ledger API, and the web app serving it on
a free port."""
import pytest
from dp_accounting import dp_event

from sage_tfx.release import ReleaseFailed, charge
from sage_tfx.sage_access.errors import BudgetExhausted
from sage_tfx.sage_access.ledger import BlockIds, BlockLedger, RecentWindow
from sage_tfx.sage_access.web.app import BackgroundServer
from support.ledger_web import (DENIED_SQL, FAILED_SQL, HOSTILE, QUERY_SQL, query_plan,
                                tfx_run_with_model)


@pytest.fixture(params=["sqlite", "mysql"])
def store_path(request, tmp_path):
    """The store spec of a ledger not created yet: an SQLite file, or a database on MariaDB
    (the mysql tests skip, saying why, where mariadbd is not installed)."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.sqlite")
    return request.getfixturevalue("mariadb_store")


@pytest.fixture
def ledger_path(store_path):
    """Eight monthly blocks (one retired), a waiting pipeline, three grants (one with a TFX run
    holding a Model, one whose split names a step `<script>...`), then through the release
    protocol a released grant, a failed one and a denial; a second context."""
    path = store_path
    ledger = BlockLedger.create(path, "default", min_request_epsilon=0.01)
    for month in range(1, 7):
        ledger.add_block(f"2024-0{month}", 1.0, 1e-6, start=f"2024-0{month}-01",
                         end=f"2024-0{month + 1}-01" if month < 6 else "2024-07-01")
    ledger.register_pipeline("taxi-adassp")  # the blocks from here on reserve its share
    ledger.add_block("2024-07", 0.05, 1e-6)
    tfx_run_with_model(path, "taxi-dpsgd-run-1")
    ledger.request(RecentWindow(3), epsilon=0.3, delta=1e-7, pipeline="taxi-dpsgd",
                   run_id="taxi-dpsgd-run-1", split={"sampling_count": "0.1", "dp_sgd": "0.9"},
                   events={"dp_sgd": dp_event.GaussianDpEvent(4.0)})
    ledger.request(BlockIds(["2024-07"]), epsilon=0.045, delta=0.0, pipeline="taxi-adassp")
    ledger.request(BlockIds(["2024-01", "2024-02"]), epsilon=0.2, delta=1e-8,
                   pipeline="hostile-split", split={HOSTILE: "1"})
    ledger.add_block("2024-08", 1.0, 1e-6, start="<img src=x onerror=alert(2)>")
    with charge(ledger, query_plan("sage-tfx query", QUERY_SQL, 0.5),
                BlockIds(["2024-03"])) as charged:
        charged.released(["out/fares.csv"])
    with pytest.raises(ReleaseFailed):
        with charge(ledger, query_plan("DPAggregate component", FAILED_SQL, 0.25, "taxi-stats"),
                    BlockIds(["2024-02", "2024-03"])):
            raise ValueError("a message that may quote the data")
    with pytest.raises(BudgetExhausted):
        charge(ledger, query_plan("sage-tfx query", DENIED_SQL, 2.0), BlockIds(["2024-03"]))
    BlockLedger.create(path, "marketing")
    return path


@pytest.fixture
def serve():
    started = []

    def start(store, **options):
        started.append(BackgroundServer(store, **options))
        return started[-1]

    yield start
    for served in started:
        served.stop()
