"""The Beam components in a TFX pipeline (LocalDagRunner, ML Metadata on SQLite) whose
`beam_pipeline_args` point at the portable runner with 2 worker processes: BlockExampleGen ->
BlockLedger -> DPAggregate, and BlockLedger -> DPTransform. BlockExampleGen's blocks and
train/test splits are the DirectRunner's, record for record."""
import csv
import glob
import os
import textwrap

import pandas as pd
import pytest
import tensorflow as tf

pytestmark = pytest.mark.slow

QUERY = ("SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1, public_groups = (1, 2)) "
         "area, ANON_COUNT(*) AS trips, ANON_AVG(fare, 0, 40) AS mean_fare FROM trips "
         "WHERE fare > 0 GROUP BY area")
COLUMNS = {"uid": "int", "area": "int", "fare": "float", "ts": "int"}
TRANSFORM_MODULE = textwrap.dedent('''
    import tensorflow as tf
    from sage_tfx.components.dp_transform import analyzers as dp

    def feature_spec():
        return {"area": tf.io.FixedLenFeature([1], tf.int64),
                "fare": tf.io.FixedLenFeature([1], tf.float32)}

    def preprocessing_fn(inputs):
        area = tf.reshape(inputs["area"], [-1])
        fare = dp.scale_with_bounds(tf.reshape(inputs["fare"], [-1]), 0.0, 40.0)
        return {"fare_scaled": fare,
                "area_fare": dp.dp_group_by_mean(area, fare, num_keys=3, value_range=(0.0, 1.0),
                                                 budget_share=1.0)}
''')
# The worker pool's processes have sage-tfx installed (they run the project's venv), as a
# cluster's workers run an image with it. Naming that image also stops TFX from building and
# staging an sdist of itself for the workers (dependency_utils.make_beam_dependency_flags).
WORKER_IMAGE = "--sdk_container_image=sage-tfx-worker"


def _write_trips(directory) -> None:
    """240 trips of 60 users in 3 CSV files (3 read bundles)."""
    directory.mkdir()
    for part in range(3):
        with open(directory / f"trips-{part}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(list(COLUMNS))
            for i in range(part, 240, 3):
                writer.writerow([i % 60, 1 + i % 2, 5 + i % 9, 1388534400 + 3600 * i])


def _block_gen(tmp_path, name: str):
    from sage_tfx.components import BlockExampleGen
    from sage_tfx.sage_access import BlockLedger as Ledger

    store = str(tmp_path / f"{name}.sqlite")
    Ledger.create(store)
    # blocks cut by the unit (15 users each): the releases are DP for the user
    return store, BlockExampleGen(input_base=str(tmp_path / "input"), block_key="uid",
                                  block_by="users", users_per_block=15, schedule_start=0,
                                  schedule_end=60, ledger_store=store, block_epsilon=4.0,
                                  block_delta=1e-5)


def _run(tmp_path, name: str, components: list, store: str, beam_args=None) -> None:
    from tfx.orchestration import metadata, pipeline
    from tfx.orchestration.local.local_dag_runner import LocalDagRunner

    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name=name, pipeline_root=str(tmp_path / name), components=components,
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store),
        beam_pipeline_args=beam_args))


def _blocks(store: str) -> dict:
    """Every block and split's records (as a sorted list of serialized examples)."""
    from sage_tfx.sage_access import connect

    [artifact] = [a for a in connect(store).get_artifacts_by_type("Examples")][:1]
    root = os.path.dirname(artifact.uri)
    records = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "Split-*", "*.gz"))):
        block, split = path.split(os.sep)[-3:-1]
        records[(block, split)] = sorted(
            bytes(r.numpy()) for r in tf.data.TFRecordDataset(path, "GZIP"))
    return records


def test_block_gen_dp_aggregate_and_dp_transform_run_on_two_workers(portable_runner, tmp_path):
    from sage_tfx.components import BlockLedger, DPTransform
    from sage_tfx.components.dp_aggregate import DPAggregate
    from sage_tfx.sage_access import connect

    _write_trips(tmp_path / "input")
    module = tmp_path / "fare_module.py"
    module.write_text(TRANSFORM_MODULE)

    # on the DirectRunner: the blocks alone, the reference for the split
    direct_store, direct_gen = _block_gen(tmp_path, "direct")
    _run(tmp_path, "direct", [direct_gen], direct_store)

    store, gen = _block_gen(tmp_path, "portable")
    statistics = BlockLedger(ledger_store=store, new_blocks=gen.outputs["examples"], window=4,
                             epsilon=1.0, delta=1e-6, pipeline_name="statistics",
                             split=DPAggregate.split(QUERY, "uid", COLUMNS, 1.0, 1e-6))
    aggregate = DPAggregate(examples=statistics.outputs["examples"],
                            grant=statistics.outputs["grant"], query=QUERY, unit_column="uid",
                            columns=COLUMNS)
    training = BlockLedger(ledger_store=store, new_blocks=gen.outputs["examples"], window=4,
                           epsilon=1.0, delta=0.0, pipeline_name="features",
                           split={"transform": 1.0}).with_id("FeatureLedger")
    transform = DPTransform(examples=training.outputs["examples"],
                            grant=training.outputs["grant"], module_file=str(module))
    workers_before = portable_runner.workers_started()
    _run(tmp_path, "portable", [gen, statistics, aggregate, training, transform], store,
         beam_args=portable_runner.options(WORKER_IMAGE))
    # each of the 3 Beam components honoured beam_pipeline_args: 3 jobs of 2 workers each
    assert portable_runner.workers_started() - workers_before == 3 * 2

    mlmd = connect(store)
    executions = {e.type.rsplit(".", 1)[-1]: e for e in mlmd.get_executions()}
    for name in ("BlockExampleGen", "DPAggregate", "DPTransform"):
        assert executions[name].last_known_state == executions[name].COMPLETE, name
    # BlockExampleGen: the same records in the same blocks and splits as on the DirectRunner
    blocks = _blocks(store)
    assert blocks == _blocks(direct_store)
    assert sum(len(records) for records in blocks.values()) == 240
    assert {split for _, split in blocks} == {"Split-train", "Split-eval"}
    # DPAggregate released the public groups
    [statistics_artifact] = mlmd.get_artifacts_by_type("sage_tfx.DPStatistics")
    released = pd.read_csv(os.path.join(statistics_artifact.uri, "release.csv"))
    assert list(released["area"]) == [1, 2]
    # DPTransform: a transform graph, and every granted record transformed
    [graph] = mlmd.get_artifacts_by_type("TransformGraph")
    assert os.path.isdir(os.path.join(graph.uri, "transform_fn"))
    transformed = [a for a in mlmd.get_artifacts_by_type("Examples")
                   if "DPTransform" in a.uri]
    count = sum(1 for path in glob.glob(os.path.join(transformed[0].uri, "Split-*", "*.gz"))
                for _ in tf.data.TFRecordDataset(path, "GZIP"))
    assert count == 240
