"""BlockExampleGen -> BlockLedger -> a consumer on LocalDagRunner, with the ledger in the
pipeline's own ML Metadata store so the charge is linked to the run."""
import json
from fractions import Fraction
import os

import pytest
import tensorflow as tf
from tfx.orchestration import metadata, pipeline
from tfx.orchestration.local.local_dag_runner import LocalDagRunner

from sage_tfx.components import PrivateExamples
from sage_tfx.components.privacy_grant import GrantError, PrivacyGrant, require_grant
from sage_tfx.sage_access import BlockLedger, connect
from sage_tfx.sage_access.records import GRANT_TYPE

from support.ingest import MONTHS, ingest_and_grant
from support.pipeline_consumer import GrantChecker


@pytest.mark.slow
def test_block_pipeline_links_the_charge_to_the_run(tmp_path):
    root = str(tmp_path)
    store_path = os.path.join(root, "metadata.sqlite")
    gen, grant = ingest_and_grant(root, store_path,
                                  split={"training": 0.75, "validation": 0.25})
    checker = GrantChecker(grant=grant.outputs["grant"], examples=grant.outputs["examples"])
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="blocks", pipeline_root=os.path.join(root, "pipeline"),
        components=[gen, grant, checker],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store_path)))

    ledger = BlockLedger(store_path)
    blocks = ledger.blocks()
    assert [b.block_id for b in blocks] == MONTHS
    assert [b.spent[0] for b in blocks] == [0, Fraction("0.4"), Fraction("0.4")]  # exact

    store = connect(store_path)
    [grant_execution] = store.get_executions_by_type(GRANT_TYPE)
    grant_id = grant_execution.custom_properties["grant_id"].string_value
    assert json.loads(grant_execution.custom_properties["blocks"].string_value) == ["2024-03", "2024-02"]
    # Lineage: the charge sits in this pipeline run's context, next to the TFX executions.
    run_contexts = [c for c in store.get_contexts_by_execution(grant_execution.id)
                    if c.type == "pipeline_run"]
    assert len(run_contexts) == 1
    run_executions = store.get_executions_by_context(run_contexts[0].id)
    assert any(e.id == grant_execution.id for e in run_executions)
    assert len([e for e in run_executions if e.type != GRANT_TYPE]) >= 3

    [grant_artifact] = store.get_artifacts_by_type(PrivacyGrant.TYPE_NAME)
    assert grant_artifact.custom_properties["grant_id"].string_value == grant_id
    checker_runs = [e for e in run_executions if "GrantChecker" in e.type]
    assert len(checker_runs) == 1  # it ran require_grant on the granted Examples, and passed
    assert checker_runs[0].last_known_state == checker_runs[0].COMPLETE

    # Each block's Examples hold only that block's months; the granted Examples hold both.
    from tfx.types import artifact_utils
    examples = [artifact_utils.deserialize_artifact(store.get_artifact_type(PrivateExamples.TYPE_NAME), a)
                for a in store.get_artifacts_by_type(PrivateExamples.TYPE_NAME)]
    granted = [e for e in examples if e.get_string_custom_property("sage_grant_id") == grant_id]
    per_block = [e for e in examples if e.get_string_custom_property("block_id")]
    assert sorted(e.get_string_custom_property("block_id") for e in per_block) == MONTHS
    for block_examples in per_block:  # every record written, and no count stored anywhere
        written = 0
        for split in ("train", "eval"):
            files = tf.io.gfile.glob(os.path.join(block_examples.uri, f"Split-{split}", "*"))
            written += sum(1 for _ in tf.data.TFRecordDataset(files, compression_type="GZIP"))
        assert written == 40
        names = set(block_examples.mlmd_artifact.custom_properties)
        assert {"block_id", "block_start", "block_end"} <= names
        assert not [name for name in names if "count" in name]
    assert len(granted) == 1
    assert sorted(os.listdir(os.path.join(granted[0].uri, "Split-train"))) == [
        "2024-02-data_tfrecord-00000-of-00001.gz", "2024-03-data_tfrecord-00000-of-00001.gz"]

    # A DP component refuses Examples without a grant, and a grant the ledger did not issue.
    grant_obj = artifact_utils.deserialize_artifact(
        store.get_artifact_type(PrivacyGrant.TYPE_NAME), grant_artifact)
    with pytest.raises(GrantError, match="without a grant"):
        require_grant([grant_obj], [per_block[0]])
    grant_obj.set_string_custom_property("epsilon", "4.0")
    with pytest.raises(GrantError, match="does not match the ledger"):
        require_grant([grant_obj], granted)
