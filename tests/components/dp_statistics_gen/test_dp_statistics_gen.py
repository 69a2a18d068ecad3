"""DPStatisticsGen: TFDV's statistics format, every number DP within its stated noise and paid
once by its grant; missing clamping bounds refused before the charge; DPSchemaGen.

False-failure rates: each check of tests/support/dp_statistics_oracle.py fails falsely with
probability at most ALPHA (1e-6) per noise draw it reads. The unit test reads 2 x (1 + 3 + 84
+ 1 + 4) draws (two splits: the count, the moments, the tree, COUNT(s), the 4 values' selection
noise): < 2e-4. The taxi run reads 2 x (1 + 16 x 87 + 2 x 1 + 68 values) < 3e-3. Noise is
seeded (the seeded_noise fixture), so each run repeats exactly; the rates say how likely a seed
is to fail a correct release.
"""
import csv
import json
import math
import os

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
import tfx
from tensorflow_metadata.proto.v0 import schema_pb2, statistics_pb2

from sage_tfx.components.dp_statistics_gen import schema as schemas
from sage_tfx.components.dp_statistics_gen.statistics import (RECORD_COLUMN, SPLIT_COLUMN,
                                                              StatisticsError, compute,
                                                              features_from, plan_statistics)
from support.dp_statistics_oracle import check_numeric, check_strings, tail

TAXI = os.path.join(os.path.dirname(tfx.__file__), "examples", "chicago_taxi_pipeline")
TAXI_SCHEMA = os.path.join(TAXI, "data", "user_provided_schema", "schema.pbtxt")
TAXI_DATA = os.path.join(TAXI, "data", "simple", "data.csv")
# Public clamping bounds for the taxi schema's numeric features (a user's choice, not read
# from the data: round numbers covering Chicago and plausible trips).
TAXI_BOUNDS = {
    "dropoff_census_tract": (17031000000, 17032000000),
    "pickup_census_tract": (17031000000, 17032000000),
    "dropoff_community_area": (0, 80), "pickup_community_area": (0, 80),
    "dropoff_latitude": (41.6, 42.1), "pickup_latitude": (41.6, 42.1),
    "dropoff_longitude": (-88.0, -87.5), "pickup_longitude": (-88.0, -87.5),
    "fare": (0, 100), "tips": (0, 50), "trip_miles": (0, 50), "trip_seconds": (0, 7200),
    "trip_start_day": (1, 7), "trip_start_hour": (0, 23), "trip_start_month": (1, 12),
    "trip_start_timestamp": (1356998400, 1483228800)}


def _rows(rng, n):
    x = rng.uniform(0.0, 10.0, n)
    x[rng.random(n) < 0.1] = np.nan
    s = np.array(rng.choice(["a", "b", "c", "rare"], n, p=[0.4, 0.35, 0.2499, 0.0001]),
                 dtype=object)
    s[rng.random(n) < 0.2] = None
    return pd.DataFrame({"x": x, "s": s,
                         SPLIT_COLUMN: np.where(rng.random(n) < 0.8, "train", "eval"),
                         RECORD_COLUMN: np.arange(n)})


def test_statistics_match_the_true_values_within_their_stated_noise(seeded_noise):
    rng = np.random.default_rng(3)
    rows = _rows(rng, 20000)
    features = features_from({"x": "float", "s": "string"}, {"x": (0.0, 10.0)})
    planned = plan_statistics(features, ("train", "eval"), 5.0, 1e-6)
    # Five statistics share the step's epsilon equally, and everything they run sums to it.
    assert planned.split == {"num_examples": 1.0, "moments:x": 1.0, "quantiles:x": 1.0,
                             "present:s": 1.0, "top_values:s": 1.0}
    assert math.isclose(sum(b.epsilon for _, b in planned.plans.values()), 5.0)
    assert planned.spent_delta <= 1e-6
    released = compute(rows, planned)
    assert set(released) == {"train", "eval"}
    for split, statistics in released.items():
        truth = rows[rows[SPLIT_COLUMN] == split]
        [dataset] = statistics.datasets
        assert abs(dataset.num_examples - len(truth)) <= tail(1.0) + 0.5
        x, s = dataset.features
        assert (list(x.path.step), x.type) == (["x"], statistics_pb2.FeatureNameStatistics.FLOAT)
        check_numeric(x.num_stats, truth["x"].dropna().to_numpy(), dataset.num_examples,
                      0.0, 10.0, 1.0)
        assert s.type == statistics_pb2.FeatureNameStatistics.STRING
        check_strings(s.string_stats, truth["s"].dropna().to_numpy(), dataset.num_examples, 1.0,
                      1e-6)
        # A value one record in 10,000 holds is below partition selection's threshold.
        assert "rare" not in [b.label for b in s.string_stats.rank_histogram.buckets]


def test_a_broken_release_fails_the_oracle(seeded_noise, monkeypatch):
    """The oracle can fail: a mean computed from the clamped sum over ALL examples (missing
    values read as 0) lies outside its stated noise."""
    from sage_tfx.components.dp_statistics_gen import statistics

    rows = _rows(np.random.default_rng(3), 20000)
    planned = plan_statistics(features_from({"x": "float"}, {"x": (0.0, 10.0)}),
                              ("train", "eval"), 5.0, 1e-6)
    real = statistics._numeric

    def biased(stats, feature, row, examples, buckets):
        real(stats, feature, row, examples, buckets)
        stats.mean = float(row[f"sum:{feature.name}"]) / examples
    monkeypatch.setattr(statistics, "_numeric", biased)
    statistics_list = compute(rows, planned)["train"]
    truth = rows[rows[SPLIT_COLUMN] == "train"]["x"].dropna().to_numpy()
    with pytest.raises(AssertionError):
        [dataset] = statistics_list.datasets
        check_numeric(dataset.features[0].num_stats, truth, dataset.num_examples, 0.0, 10.0,
                      5.0 / 3)


def test_numeric_features_without_bounds_are_refused_naming_them():
    columns, bounds = schemas.columns_and_bounds(schemas.read_schema(TAXI_SCHEMA))
    assert columns["company"] == "string" and columns["fare"] == "float"
    assert bounds == {}  # the taxi template's schema has no numeric domains
    with pytest.raises(StatisticsError, match=r"\['dropoff_census_tract'.*'fare'.*no public "
                                              r"clamping bounds.*nothing was charged"):
        features_from(columns, {"trip_miles": (0, 50)})


def test_bounds_come_from_the_schemas_domains_or_the_arguments(tmp_path):
    path = tmp_path / "schema.pbtxt"
    path.write_text('feature { name: "fare" type: FLOAT float_domain { min: 0 max: 100 } }\n'
                    'feature { name: "hour" type: INT domain: "hours" }\n'
                    'int_domain { name: "hours" min: 0 max: 23 }\n'
                    'feature { name: "company" type: BYTES }\n')
    features = schemas.public_features(str(path), None, {"fare": (0, 60)})
    assert [(f.name, f.kind, f.low, f.high) for f in features] == [
        ("fare", "float", 0.0, 60.0), ("hour", "int", 0.0, 23.0), ("company", "string", None,
                                                                   None)]


def test_the_component_refuses_missing_bounds_when_the_pipeline_is_built():
    from sage_tfx.components import BlockLedger, DPStatisticsGen

    grant = BlockLedger(ledger_store="ledger.sqlite", epsilon=1.0, delta=1e-6, window=1,
                        split={"statistics": 1.0})
    with pytest.raises(StatisticsError, match="no public clamping bounds"):
        DPStatisticsGen(examples=grant.outputs["examples"], grant=grant.outputs["grant"],
                        schema_file=TAXI_SCHEMA)


def test_bounds_gone_at_run_time_are_refused_before_the_charge(store_path, tmp_path):
    """The schema file is read again by the BlockLedger before it charges (preflight): a
    schema that lost a bound between build and run is refused with nothing charged."""
    from tfx.types import standard_artifacts

    from sage_tfx.components import BlockLedger as BlockLedgerComponent, DPStatisticsGen
    from sage_tfx.components.block_ledger import executor
    from sage_tfx.components.privacy_grant import PrivacyGrant
    from sage_tfx.sage_access import BlockLedger
    from sage_tfx.sage_access.errors import BadRequest

    schema = tmp_path / "schema.pbtxt"
    schema.write_text('feature { name: "fare" type: FLOAT float_domain { min: 0 max: 100 } }\n')
    ledger = BlockLedger.create(store_path)
    ledger.add_block("b1", 1.0, 1e-6, data_uri=str(tmp_path / "b1"))
    component = BlockLedgerComponent(ledger_store=store_path, epsilon=0.5, delta=1e-7,
                                     block_ids=["b1"], split={"statistics": 1.0})
    DPStatisticsGen(examples=component.outputs["examples"], grant=component.outputs["grant"],
                    schema_file=str(schema))
    schema.write_text('feature { name: "fare" type: FLOAT }\n')
    examples, grant = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant.uri = str(tmp_path / "out-examples"), str(tmp_path / "out-grant")
    with pytest.raises(BadRequest, match="refused before the charge.*DPStatisticsGen.*'fare'"):
        executor.Executor().Do({}, {"examples": [examples], "grant": [grant]},
                               dict(component.exec_properties))
    assert [b.spent[0] for b in BlockLedger(store_path).blocks()] == [0.0]
    assert BlockLedger(store_path).grant_records() == []


def test_a_schema_is_inferred_from_dp_statistics(seeded_noise):
    rows = _rows(np.random.default_rng(3), 20000)
    planned = plan_statistics(features_from({"x": "float", "s": "string"}, {"x": (0.0, 10.0)}),
                              ("train", "eval"), 5.0, 1e-6)
    inferred = schemas.infer_schema(compute(rows, planned)["train"])
    x, s = inferred.feature
    assert (x.name, x.type, s.name, s.type) == ("x", schema_pb2.FLOAT, "s", schema_pb2.BYTES)
    assert (x.value_count.min, x.value_count.max) == (1, 1)
    assert x.presence.min_fraction == 0.0  # 10% missing: not required
    [domain] = inferred.string_domain
    assert s.domain == domain.name == "s" and list(domain.value) == ["a", "b", "c"]


def test_dp_schema_gen_refuses_statistics_without_a_dp_guarantee(tmp_path):
    """TFX's StatisticsGen's output (exact statistics) is no input for a schema made without
    budget: only DPStatisticsGen's, which state their guarantee."""
    from tfx.types import artifact_utils, standard_artifacts

    from sage_tfx.components.dp_statistics_gen.executor import SchemaExecutor

    statistics, schema = standard_artifacts.ExampleStatistics(), standard_artifacts.Schema()
    statistics.uri, schema.uri = str(tmp_path / "statistics"), str(tmp_path / "schema")
    statistics.split_names = artifact_utils.encode_split_names(["train"])
    with pytest.raises(StatisticsError, match="state no DP guarantee"):
        SchemaExecutor().Do({"statistics": [statistics]}, {"schema": [schema]}, {})
    assert not os.path.exists(schema.uri)
    SchemaExecutor().Do({}, {"schema": [schema]}, {"schema_file": TAXI_SCHEMA})
    copied = schemas.read_schema(os.path.join(schema.uri, "schema.pbtxt"))
    assert copied == schemas.read_schema(TAXI_SCHEMA)


def _true_split(uri, split, columns):
    """The true values of one split of Examples, read without the component's code: a feature
    is present when it holds one (finite) value."""
    values = {name: [] for name in columns}
    count = 0
    for files in [tf.io.gfile.glob(os.path.join(uri, f"Split-{split}", "*"))]:
        for record in tf.data.TFRecordDataset(files, "GZIP"):
            count += 1
            example = tf.train.Example.FromString(record.numpy())
            for name, kind in columns.items():
                feature = example.features.feature.get(name)
                if feature is None:
                    continue
                which = feature.WhichOneof("kind")
                got = list(getattr(feature, which).value) if which else []
                if len(got) != 1:
                    continue
                if kind == "string":
                    value = got[0].decode() if isinstance(got[0], bytes) else str(got[0])
                else:
                    value = float(got[0])
                    if not math.isfinite(value):
                        continue
                values[name].append(value)
    return count, values


@pytest.mark.slow
def test_taxi_statistics_through_block_example_gen_and_the_ledger(tmp_path, seeded_noise,
                                                                  caplog):
    """The Chicago taxi sample through BlockExampleGen -> BlockLedger -> DPStatisticsGen ->
    DPSchemaGen on LocalDagRunner: TFX's ExampleStatistics, read back as TFDV writes them."""
    from tfx.orchestration import metadata, pipeline
    from tfx.orchestration.local.local_dag_runner import LocalDagRunner

    from sage_tfx.components import (BlockExampleGen, BlockLedger, DPSchemaGen,
                                     DPStatisticsGen)
    from sage_tfx.components.block_example_gen import month_schedule
    from sage_tfx.sage_access import BlockLedger as Ledger

    data = tmp_path / "input"
    data.mkdir()
    (data / "data.csv").write_text(open(TAXI_DATA).read())
    store = str(tmp_path / "metadata.sqlite")
    Ledger.create(store)
    start, end = month_schedule("2013-01", "2016-12")
    gen = BlockExampleGen(input_base=str(data), block_key="trip_start_timestamp",
                          schedule_start=start, schedule_end=end, ledger_store=store,
                          block_epsilon=40.0, block_delta=1e-5)
    # 37 statistics (the number of examples; 16 numeric features x 2; 2 string features x 2)
    # at epsilon 1 each.
    grant = BlockLedger(ledger_store=store, new_blocks=gen.outputs["examples"], window=48,
                        epsilon=37.0, delta=1e-6, split={"statistics": 1.0})
    statistics = DPStatisticsGen(examples=grant.outputs["examples"],
                                 grant=grant.outputs["grant"], schema_file=TAXI_SCHEMA,
                                 bounds=TAXI_BOUNDS)
    inferred = DPSchemaGen(statistics=statistics.outputs["statistics"])
    caplog.set_level("INFO")
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="dp-statistics-gen", pipeline_root=str(tmp_path / "pipeline"),
        components=[gen, grant, statistics, inferred],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store)))
    assert "split equally: num_examples 1, " in caplog.text  # the split, printed

    with metadata.Metadata(metadata.sqlite_metadata_connection_config(store)) as m:
        [stats_artifact] = m.store.get_artifacts_by_type("ExampleStatistics")
        [schema_artifact] = m.store.get_artifacts_by_type("Schema")
        [granted] = [a for a in m.store.get_artifacts_by_type("Examples")
                     if "sage_grant_id" in a.custom_properties]
    props = {k: v.string_value for k, v in stats_artifact.custom_properties.items()}
    # TFX's readers (SchemaGen, ExampleValidator: stats_artifact_utils.load_statistics) read
    # FeatureStats.pb from an artifact whose tfx_version is 0.29 or later.
    assert props["tfx_version"] >= "1"
    assert props["guarantee"].startswith("(37, 1e-06)-DP for adding or removing one record")
    assert json.loads(props["budget_split"])["moments:fare"] == 1.0
    splits = json.loads(stats_artifact.properties["split_names"].string_value)
    assert splits == ["train", "eval"]
    columns, _ = schemas.columns_and_bounds(schemas.read_schema(TAXI_SCHEMA))
    for split in splits:
        path = os.path.join(stats_artifact.uri, f"Split-{split}", "FeatureStats.pb")
        released = statistics_pb2.DatasetFeatureStatisticsList.FromString(open(path, "rb").read())
        [dataset] = released.datasets
        count, truth = _true_split(granted.uri, split, columns)
        assert abs(dataset.num_examples - count) <= tail(1.0) + 0.5
        by_name = {f.path.step[0]: f for f in dataset.features}
        assert set(by_name) == set(columns)
        for name, kind in columns.items():
            if kind == "string":
                check_strings(by_name[name].string_stats, np.asarray(truth[name], dtype=object),
                              dataset.num_examples, 1.0, 1e-6 / 2)
            else:
                check_numeric(by_name[name].num_stats, np.asarray(truth[name]),
                              dataset.num_examples, *TAXI_BOUNDS[name], 1.0)
        top = [v.value for v in by_name["payment_type"].string_stats.top_values]
        assert top[:2] == ["Cash", "Credit Card"]
    # Charged once: one grant, its step released by DPStatisticsGen, not spendable again.
    ledger = Ledger(store)
    [record] = ledger.grant_records()
    outcomes = ledger.grant_outcomes(record["grant_id"])
    assert outcomes["statistics"]["outcome"] == "released"
    with pytest.raises(Exception, match="already used"):
        ledger.use_share(ledger.find_grant(record["grant_id"]), "statistics", "another run")
    # DPSchemaGen: TFX's Schema artifact, schema.pbtxt, from the DP statistics.
    inferred_schema = schemas.read_schema(os.path.join(schema_artifact.uri, "schema.pbtxt"))
    assert {f.name for f in inferred_schema.feature} == set(columns)
    assert "Cash" in next(d for d in inferred_schema.string_domain
                          if d.name == "payment_type").value
