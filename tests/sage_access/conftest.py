"""A ledger store filled through the ledger API, and the web app serving it on a free port."""
import pytest
from dp_accounting import dp_event
from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access.ledger import BlockIds, BlockLedger, RecentWindow
from sage_tfx.sage_access.web.app import BackgroundServer

HOSTILE = "<script>alert(1)</script>"


def tfx_run_with_model(path: str, run_id: str) -> None:
    """What TFX's LocalDagRunner leaves for a run: its `pipeline_run` context and a Model the run
    produced, attributed to it (written with ML Metadata, as TFX does)."""
    store = metadata_store.MetadataStore(_sqlite(path))
    context_type = store.put_context_type(pb.ContextType(name="pipeline_run"))
    model_type = store.put_artifact_type(pb.ArtifactType(name="Model"))
    [context_id] = store.put_contexts([pb.Context(type_id=context_type, name=run_id)])
    [model_id] = store.put_artifacts([pb.Artifact(
        type_id=model_type, uri=f"/pipelines/taxi/DPTrainer/model/{run_id}",
        state=pb.Artifact.LIVE)])
    store.put_attributions_and_associations(
        [pb.Attribution(artifact_id=model_id, context_id=context_id)], [])


def _sqlite(path: str) -> pb.ConnectionConfig:
    config = pb.ConnectionConfig()
    config.sqlite.filename_uri = path
    return config


@pytest.fixture
def rename_by_hand():
    return _rename_by_hand


def _rename_by_hand(path: str, block_id: str, grant_pipeline: str, new_name: str) -> None:
    """Give a block and a grant's pipeline `new_name`, as a hand-edited store or another writer
    could: the ledger's own API refuses such names, the page must still show them as text."""
    store = metadata_store.MetadataStore(_sqlite(path))
    [block] = [a for a in store.get_artifacts_by_type("sage_tfx.Block")
               if a.custom_properties["block_id"].string_value == block_id]
    block.custom_properties["block_id"].string_value = new_name
    store.put_artifacts([block])
    grants = [e for e in store.get_executions_by_type("sage_tfx.Grant")
              if e.custom_properties["pipeline"].string_value == grant_pipeline]
    grants[0].custom_properties["pipeline"].string_value = new_name
    store.put_executions(grants[:1])


@pytest.fixture
def hostile():
    """A name that would run as script if a page put it into HTML unescaped."""
    return HOSTILE


@pytest.fixture
def ledger_path(tmp_path):
    """Eight monthly blocks (one retired), a waiting pipeline, three grants (one with a TFX run
    holding a Model, one whose split names a step `<script>...`), a second context."""
    path = str(tmp_path / "ledger.sqlite")
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
