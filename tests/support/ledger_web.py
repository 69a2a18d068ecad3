"""A ledger store for the web view's tests: what TFX and a hand-edited store leave in it."""
from dp_accounting import dp_event
from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.release import ReleasePlan
from sage_tfx.sage_access.store import connect

# A name that would run as script if a page put it into HTML unescaped.
HOSTILE = "<script>alert(1)</script>"

# What the release protocol's front doors asked for (fixture `ledger_path`).
QUERY_SQL = ("SELECT area, COUNT(*) AS trips, ANON_SUM(fare, 0, 100) AS fares\n"
             "FROM trips\nGROUP BY area")
FAILED_SQL = "SELECT SUM(fare) FROM trips WHERE area = '<b>bold</b>'"
DENIED_SQL = "SELECT COUNT(*) FROM trips"


def query_plan(front_door, request, epsilon, pipeline=None):
    """A two-step plan (fractions 1/6 and 5/6: people read 0.1667 and 0.8333)."""
    return ReleasePlan(front_door, request, epsilon, 0.0, {"count": "1/6", "sum": "5/6"},
                       {"count": dp_event.LaplaceDpEvent(1 / 3),
                        "sum": dp_event.LaplaceDpEvent(6.0)}, pipeline=pipeline)


def _store(path: str) -> metadata_store.MetadataStore:
    return connect(path)  # an SQLite file or a mysql:// database


def tfx_run_with_model(path: str, run_id: str) -> None:
    """What TFX's LocalDagRunner leaves for a run: its `pipeline_run` context and a Model the run
    produced, attributed to it (written with ML Metadata, as TFX does)."""
    store = _store(path)
    context_type = store.put_context_type(pb.ContextType(name="pipeline_run"))
    model_type = store.put_artifact_type(pb.ArtifactType(name="Model"))
    [context_id] = store.put_contexts([pb.Context(type_id=context_type, name=run_id)])
    [model_id] = store.put_artifacts([pb.Artifact(
        type_id=model_type, uri=f"/pipelines/taxi/DPTrainer/model/{run_id}",
        state=pb.Artifact.LIVE)])
    store.put_attributions_and_associations(
        [pb.Attribution(artifact_id=model_id, context_id=context_id)], [])


def rename_by_hand(path: str, block_id: str, grant_pipeline: str, new_name: str) -> None:
    """Give a block and a grant's pipeline `new_name`, as a hand-edited store or another writer
    could: the ledger's own API refuses such names, the page must still show them as text."""
    store = _store(path)
    [block] = [a for a in store.get_artifacts_by_type("sage_tfx.Block")
               if a.custom_properties["block_id"].string_value == block_id]
    block.custom_properties["block_id"].string_value = new_name
    store.put_artifacts([block])
    grants = [e for e in store.get_executions_by_type("sage_tfx.Grant")
              if e.custom_properties["pipeline"].string_value == grant_pipeline]
    grants[0].custom_properties["pipeline"].string_value = new_name
    store.put_executions(grants[:1])
