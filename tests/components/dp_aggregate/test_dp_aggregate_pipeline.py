"""DPAggregate in a real TFX pipeline (LocalDagRunner, ML Metadata on SQLite, Beam's
DirectRunner): BlockExampleGen -> BlockLedger (split from DPAggregate.split) -> DPAggregate."""
import csv
import json
import os

import pandas as pd
import pyarrow.parquet as pq
import pytest

from sage_tfx.dp_statistics.aggregation import QueryError

QUERY = ("SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 1, public_groups = (1, 2)) "
         "area, ANON_COUNT(*) AS trips, ANON_AVG(fare, 0, 40) AS mean_fare FROM trips "
         "WHERE fare > 0 GROUP BY area")
COLUMNS = {"uid": "int", "area": "int", "fare": "float", "ts": "int"}


def test_construction_refuses_a_query_that_breaks_row_ownership():
    from sage_tfx.components.dp_aggregate import DPAggregate
    with pytest.raises(QueryError, match="GROUP BY area is not grouped by the privacy unit"):
        DPAggregate.split("SELECT WITH ANONYMIZATION area, ANON_SUM(s, 0, 9) FROM (SELECT uid, "
                          "area, SUM(fare) s FROM trips GROUP BY area) GROUP BY area", "uid",
                          COLUMNS, 1.0, 1e-6)


def test_the_split_is_the_pld_plans_read_without_running_the_accountant(monkeypatch):
    """DPAggregate.split runs when the pipeline is built. A PLD plan keeps the basic plan's
    shares, so the split is the one the executor's PLD plan checks the grant against, and no
    privacy accountant runs for it (PLD took 0.15-0.6 s of a pipeline's build)."""
    from sage_tfx.components.dp_aggregate import DPAggregate, executor
    from sage_tfx.dp_statistics.aggregation import budget, frontend

    text = ("SELECT WITH ANONYMIZATION OPTIONS(noise = gaussian) area, ANON_COUNT(*) AS trips, "
            "ANON_AVG(fare, 0, 40) AS mean_fare FROM trips GROUP BY area")
    pld = frontend.plan_query(*executor.query_inputs(text, "uid", COLUMNS), 1.0, 1e-6).budget
    assert pld.steps[0].noise_scale > 1  # the accountant found a lambda > 1 for this query
    budget._pld_noise_scale_of.cache_clear()  # (a cached lambda would hide a run)

    def no_accountant(*_):
        raise AssertionError("the PLD accountant ran to read a split")
    monkeypatch.setattr(budget, "pld_epsilon", no_accountant)
    assert DPAggregate.split(text, "uid", COLUMNS, 1.0, 1e-6) == frontend.grant_terms(pld).split


@pytest.mark.slow
def test_dp_aggregate_releases_csv_and_parquet_with_its_guarantee(tmp_path):
    from tfx.orchestration import metadata, pipeline
    from tfx.orchestration.local.local_dag_runner import LocalDagRunner

    from sage_tfx.components import BlockExampleGen, BlockLedger
    from sage_tfx.components.dp_aggregate import DPAggregate
    from sage_tfx.sage_access import BlockLedger as Ledger

    data = tmp_path / "input"
    data.mkdir()
    with open(data / "trips.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(list(COLUMNS))
        for i in range(120):
            writer.writerow([i % 30, 1 + i % 2, 5 + i % 9, 1388534400 + 3600 * i])
        writer.writerow([1, 1, "NaN", 1388534400])  # a bad fare: the record rule's 0
    store = str(tmp_path / "metadata.sqlite")
    Ledger.create(store)
    # Blocks cut by the unit (15 users each): the release is DP for the user, and says so.
    gen = BlockExampleGen(input_base=str(data), block_key="uid", block_by="users",
                          users_per_block=15, schedule_start=0, schedule_end=30,
                          ledger_store=store, block_epsilon=2.0, block_delta=1e-5)
    grant = BlockLedger(ledger_store=store, new_blocks=gen.outputs["examples"], window=2,
                        epsilon=1.0, delta=1e-6,
                        split=DPAggregate.split(QUERY, "uid", COLUMNS, 1.0, 1e-6))
    aggregate = DPAggregate(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                            query=QUERY, unit_column="uid", columns=COLUMNS)
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="dp-statistics", pipeline_root=str(tmp_path / "pipeline"),
        components=[gen, grant, aggregate],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store)))

    with metadata.Metadata(metadata.sqlite_metadata_connection_config(store)) as m:
        [artifact] = m.store.get_artifacts_by_type("sage_tfx.DPStatistics")
    props = {k: v.string_value for k, v in artifact.custom_properties.items()}
    assert float(props["epsilon"]) <= 1.0
    assert props["unit"] == "all rows of one uid"
    assert json.loads(props["columns"]) == ["area", "trips", "mean_fare"]
    released = pd.read_csv(os.path.join(artifact.uri, "release.csv"))
    assert list(released["area"]) == [1, 2]
    assert pq.read_table(os.path.join(artifact.uri, "release.parquet")).num_rows == 2
    # The grant's shares were consumed by the run: nothing else can spend them again.
    ledger = Ledger(store)
    [record] = ledger.grant_records()
    with pytest.raises(Exception, match="already used"):
        ledger.use_share(ledger.find_grant(record["grant_id"]), "mean_fare", "another run")
