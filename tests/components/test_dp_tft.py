"""The drop-in DP tft module (sage_tfx.components.dp_transform.tft, issue 44 part 2): each DP
analyzer against tensorflow_transform's exact one within its stated noise, the equal split and
its events in the plan, missing bounds and TFT's own analyzers refused before the charge naming
the user's call, and a module converted by its import run through DPTransform.

Noise and false failures. The statistical tests run with the `seeded_noise` fixture (the
mechanisms' laws and scales, numpy seeded with 0: the draws are fixed, the test repeats). Each
tolerance is derived for an unseeded run: every Laplace (or discrete Laplace) draw of scale b
is bounded by T b, T = 14, which fails with probability e^-14 = 8.3e-7 per draw; the stated
false-failure rate of each assertion is the number of draws it bounds times that (at most
1e-5 per test below, but where a test says otherwise).
"""
import math
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_transform as real_tft
import tensorflow_transform.beam as tft_beam
from tensorflow_transform.tf_metadata import dataset_metadata

from sage_tfx.components.dp_transform import analyzers as dp
from sage_tfx.components.dp_transform import tft
from sage_tfx.components.dp_transform.executor import audit, plan_transform
from sage_tfx.dp_statistics.aggregation.aggregators import QUANTILE_RANK_TERMS
from sage_tfx.dp_statistics.aggregation.spec import QUANTILE_BRANCHING, QUANTILE_LEVELS
from sage_tfx.sage_access.errors import BadRequest

T = 14.0  # per-draw tail bound, in noise scales (module docstring)
SPEC = {"fare": tf.io.FixedLenFeature([], tf.float32),
        "company": tf.io.FixedLenFeature([], tf.string),
        "hour": tf.io.FixedLenFeature([], tf.int64)}
FARE = (0.0, 100.0)
HOUR = (0.0, 24.0)
ANALYZERS = 9
EPSILON_EACH = 4.0
DELTA = 1e-6
COMPANIES = {b"Flash Cab": 4000, b"Taxi Affiliation": 3000, b"Yellow": 2000, b"Blue": 900}
SINGLETONS = [f"rare-{i}".encode() for i in range(10)]


def _rows(seed=0):
    rng = np.random.default_rng(seed)
    companies = [c for c, n in COMPANIES.items() for _ in range(n)] + SINGLETONS
    rng.shuffle(companies)
    fares = np.clip(rng.gamma(2.0, 8.0, len(companies)), *FARE)  # within the bounds
    hours = rng.integers(0, 24, len(companies))
    return [{"fare": float(f), "company": c, "hour": int(h)}
            for f, c, h in zip(fares.astype(np.float32), companies, hours)]


def _constant(inputs, value):
    return tf.fill(tf.shape(inputs["hour"]), tf.cast(value, tf.float32))


def _boundaries(inputs, name, boundaries):
    """The [1, 3] boundaries as three per-record constants (outputs are per record)."""
    return {f"{name}_{i}": _constant(inputs, boundaries[0, i]) for i in range(3)}


def dp_statistics(inputs):
    """The DP module's calls: 9 analyzers, an equal split (no budget_share given)."""
    fare = inputs["fare"]
    return {"z": tft.scale_to_z_score(fare, clamp=FARE),
            "mean": _constant(inputs, tft.mean(fare, clamp=FARE)),
            "var": _constant(inputs, tft.var(fare, clamp=FARE)),
            "size": _constant(inputs, tft.size(fare)),
            "min": _constant(inputs, tft.min(fare, clamp=FARE)),
            "max": _constant(inputs, tft.max(fare, clamp=FARE)),
            **_boundaries(inputs, "quantiles", tft.quantiles(fare, 4, 0.01, clamp=FARE)),
            "hour_bucket": tft.bucketize(inputs["hour"], 4, clamp=HOUR),
            "company": tft.compute_and_apply_vocabulary(inputs["company"], num_oov_buckets=1)}


def exact_statistics(inputs):
    """tensorflow_transform's own analyzers on the same inputs (exact: the oracle)."""
    fare = inputs["fare"]
    return {"tft_z": real_tft.scale_to_z_score(fare),
            **_boundaries(inputs, "tft_quantiles", real_tft.quantiles(fare, 4, 0.01)),
            "tft_company": real_tft.compute_and_apply_vocabulary(inputs["company"],
                                                                 num_oov_buckets=1)}


@pytest.fixture(scope="module")
def released():
    """One DPTransform-style run (the audit's plan, then TFT on the DirectRunner) of the DP
    calls beside tft's exact ones, with seeded noise."""
    from tests.support.seeded_noise import seeded_measurement
    from sage_tfx.mechanisms import additive

    rows = _rows()
    epsilon = ANALYZERS * EPSILON_EACH
    original = additive._measurement
    additive._measurement = seeded_measurement()
    try:
        plan = plan_transform(dp_statistics, SPEC, epsilon, DELTA)
        metadata = dataset_metadata.DatasetMetadata.from_feature_spec(SPEC)
        with dp.transform_budget(epsilon, DELTA, plan) as budget, \
                tempfile.TemporaryDirectory() as temp, \
                tft_beam.Context(temp_dir=temp, force_tf_compat_v1=True):
            (transformed, _), _ = (rows, metadata) | tft_beam.AnalyzeAndTransformDataset(
                budget.wrap(lambda inputs: {**dp_statistics(inputs),
                                            **exact_statistics(inputs)}))
    finally:
        additive._measurement = original
    return rows, transformed, plan


def _moments(rows):
    """Exact (N, centred sum S, centred squares Q) as _NoisyMoments aggregates them."""
    half, mid = (FARE[1] - FARE[0]) / 2, (FARE[0] + FARE[1]) / 2
    d = np.array([r["fare"] for r in rows], np.float64) - mid
    return len(d), d.sum(), (d ** 2 - half ** 2 / 2).sum(), half, mid


def _mean_tolerance(rows, epsilon_count, epsilon_sum):
    """|DP mean - mean| when the count noise is <= T b_N and the sum's <= T b_S:
    (T b_S + |mean_d| T b_N) / (N - T b_N)."""
    n, s, _, half, _ = _moments(rows)
    b_n, b_s = 1.0 / epsilon_count, half / epsilon_sum
    return (T * b_s + abs(s / n) * T * b_n) / (n - T * b_n)


def _variance_tolerance(rows):
    """First-order bound on |DP var - var| (each of the 3 draws within T scales), with 10% for
    the second-order terms, which are (T b / N)^2 ~ 1e-5 relative here: derivatives of
    Q/N + h^2/2 - (S/N)^2 times the noise bounds (count, sum, squares at epsilon / 3 each)."""
    n, s, q, half, _ = _moments(rows)
    b_n, b_s, b_q = 3 / EPSILON_EACH, 3 * half / EPSILON_EACH, 3 * half ** 2 / 2 / EPSILON_EACH
    return 1.1 * T * (b_q / n + 2 * abs(s) / n ** 2 * b_s + abs(q / n ** 2 - 2 * s ** 2 / n ** 3)
                      * b_n)


def test_the_equal_split_is_printed_per_call_and_its_events_compose_in_the_plan(released):
    _, _, plan = released
    assert plan.default_share == pytest.approx(1 / ANALYZERS)
    assert [call for call, _ in plan.shares][:3] == ["scale_to_z_score(fare)", "mean(fare)",
                                                     "var(fare)"]
    assert "compute_and_apply_vocabulary(company): share 0.1111 (epsilon 4, delta 1e-06)" \
        in plan.describe()
    # The composed event is eps-DP in total (8 pure analyzers at 4 each, plus the vocabulary's
    # selection: epsilon 4 with its delta outside the event).
    assert plan.additional_delta == pytest.approx(DELTA)
    from sage_tfx.mechanisms import Release
    assert len(plan.event.events) == ANALYZERS
    # dp_accounting composes it: the sum of the 9 shares (up to the PLD's pessimistic
    # discretisation, 5e-6 relative here), more than 8 of them
    assert 8 * EPSILON_EACH < Release(None, plan.event).epsilon(1e-9) \
        <= ANALYZERS * EPSILON_EACH * (1 + 1e-4)


def test_mean_var_and_size_are_tfts_within_their_noise(released):
    rows, out, _ = released
    fares = np.array([r["fare"] for r in rows], np.float64)
    # mean: count and sum at epsilon / 2 each (2 draws: false failure 1.7e-6)
    assert abs(out[0]["mean"] - fares.mean()) <= _mean_tolerance(rows, EPSILON_EACH / 2,
                                                                  EPSILON_EACH / 2)
    # var: tft's population variance (3 draws: 2.5e-6)
    assert abs(out[0]["var"] - fares.var()) <= _variance_tolerance(rows)
    # size: discrete Laplace of scale 1 / epsilon (1 draw)
    assert abs(out[0]["size"] - len(rows)) <= T / EPSILON_EACH
    # and the noise is there: no analyzer returns the exact value
    assert out[0]["mean"] != pytest.approx(fares.mean(), abs=1e-9)


def test_z_score_is_tfts_within_the_noise_of_its_mean_and_variance(released):
    rows, out, _ = released
    fares = np.array([r["fare"] for r in rows], np.float64)
    # The constants a z-score applied, read back from two records: z = (x - m) / s.
    x1, z1 = rows[0]["fare"], out[0]["z"]
    x2, z2 = next((r["fare"], o["z"]) for r, o in zip(rows, out)
                  if abs(r["fare"] - x1) > 20)
    std = (x1 - x2) / (z1 - z2)
    centre = x1 - std * z1
    # mean from the moments release: count and sum at epsilon / 3 each (3 draws: 2.5e-6)
    assert abs(centre - fares.mean()) <= _mean_tolerance(rows, EPSILON_EACH / 3,
                                                         EPSILON_EACH / 3) + 1e-3
    assert abs(std ** 2 - fares.var()) <= _variance_tolerance(rows) + 1e-2
    tft_z = np.array([o["tft_z"] for o in out])
    dp_z = np.array([o["z"] for o in out])
    assert np.corrcoef(tft_z, dp_z)[0, 1] > 0.9999  # the same affine map up to its constants


def test_min_and_max_lie_in_their_stated_brackets(released):
    # tft.min / tft.max: the bracket of the module docstring: with probability >= 1 - 1e-3
    # (the threshold's design beta; per unseeded run) min lies in [exact min - w, lower edge
    # of the first bucket holding >= 2 t records], max symmetrically.
    rows, out, _ = released
    fares = np.array([r["fare"] for r in rows], np.float64)
    width = (FARE[1] - FARE[0]) / tft.MIN_MAX_BUCKETS
    threshold = math.log(tft.MIN_MAX_BUCKETS / (2 * tft.EMPTY_BUCKETS_PASS)) / EPSILON_EACH
    counts = np.bincount(np.minimum(np.floor(fares / width).astype(int),
                                    tft.MIN_MAX_BUCKETS - 1), minlength=tft.MIN_MAX_BUCKETS)
    full = np.flatnonzero(counts >= 2 * threshold)
    assert fares.min() - width <= out[0]["min"] <= full[0] * width
    assert (full[-1] + 1) * width <= out[0]["max"] <= fares.max() + width


def test_quantiles_and_buckets_hold_tfts_ranks_within_the_tree_noise(released):
    # The boundary's rank in the data, against q: each of the <= R tree counts a rank reads is
    # within T b (b = levels / epsilon) of its count, so the rank moves by <= R T b records,
    # twice that for the descent's renormalisation by noisy totals (approximate, as
    # dp_statistics' stated accuracy), plus the records of one leaf (the interpolation).
    # 84 draws: false failure <= 7e-5.
    rows, out, _ = released
    fares = np.sort([r["fare"] for r in rows])
    leaves = QUANTILE_BRANCHING ** QUANTILE_LEVELS
    leaf_records = np.histogram(fares, bins=leaves, range=FARE)[0].max()
    tolerance = (2 * QUANTILE_RANK_TERMS * T * QUANTILE_LEVELS / EPSILON_EACH
                 + leaf_records) / len(fares)
    dp_ranks = np.searchsorted(fares, [out[0][f"quantiles_{i}"] for i in range(3)]) / len(fares)
    tft_ranks = np.searchsorted(fares, [out[0][f"tft_quantiles_{i}"]
                                        for i in range(3)]) / len(fares)
    assert np.all(np.abs(dp_ranks - [0.25, 0.5, 0.75]) <= tolerance)
    assert np.all(np.abs(dp_ranks - tft_ranks) <= tolerance + 0.01)  # tft's own epsilon 0.01
    # bucketize: the buckets of uniform hours hold about a quarter each (hours are integers:
    # a boundary moves whole hours of 1/24 each)
    buckets = np.bincount([o["hour_bucket"] for o in out], minlength=4) / len(out)
    assert np.all(np.abs(buckets - 0.25) <= 1 / 24 + 2 * QUANTILE_RANK_TERMS * T
                  * QUANTILE_LEVELS / EPSILON_EACH / len(out) + 0.02)


def test_vocabulary_keeps_tfts_frequent_values_in_order_and_drops_the_rare_ones(released):
    # Counts 4000 > 3000 > 2000 > 900: each noisy count is within T / epsilon = 3.5 of its own,
    # so tft's order holds; a value held by one record is kept with probability <= delta
    # (10 of them: false failure <= 1e-5 for the whole assertion).
    rows, out, _ = released
    dp_index = {r["company"]: o["company"] for r, o in zip(rows, out)}
    tft_index = {r["company"]: o["tft_company"] for r, o in zip(rows, out)}
    for company in COMPANIES:
        assert dp_index[company] == tft_index[company]
    assert all(dp_index[rare] == len(COMPANIES) for rare in SINGLETONS)  # the OOV bucket
    assert all(tft_index[rare] < len(COMPANIES) + len(SINGLETONS) for rare in SINGLETONS)


def test_the_empty_value_is_never_in_a_vocabulary_as_tft_drops_it():
    """A missing string read as "" (the record rule's default, what TFX's `_fill_in_missing`
    makes of it: 5,140 of the taxi template's trips have no company) made an empty line in the
    vocabulary file, and the table reading it failed after the charge. tft drops the empty
    value and values with line breaks; so does the DP vocabulary. (Both counts are 5,000 at
    epsilon 1: "Cash" misses the threshold with probability far below 1e-9.)"""
    vocabulary = tft._NoisyVocabulary(epsilon=1.0, delta=DELTA, top_k=None,
                                      frequency_threshold=None, filename="vocabulary")
    assert vocabulary.release([(b"", 5000), (b"Cash", 5000), (b"a\nb", 5000)]).value == \
        [b"Cash"]


def test_apply_buckets_is_tfts_and_passes_the_row_audit():
    boundaries = tf.constant([[0.0, 2.5, 5.0]])
    values = tf.constant([-1.0, 0.0, 1.0, 2.5, 4.9, 5.0, 7.0])
    assert tft.apply_buckets(values, boundaries).numpy().tolist() == \
        real_tft.apply_buckets(values, boundaries).numpy().tolist()
    assert audit(lambda inputs: {"b": tft.apply_buckets(inputs["fare"], [[1.0, 2.0]])},
                 SPEC, 1.0) == []


def test_missing_bounds_are_refused_naming_the_call_and_declared_bounds_are_used():
    def missing(inputs):
        return {"z": tft.scale_to_z_score(inputs["fare"])}
    with pytest.raises(dp.DPTransformError,
                       match=r"scale_to_z_score\(fare\) needs clamp bounds.*CLAMP_BOUNDS"):
        audit(missing, SPEC, 1.0)
    with pytest.raises(dp.DPTransformError, match=r"bucketize\(hour\) needs clamp bounds"):
        audit(lambda inputs: {"b": tft.bucketize(inputs["hour"], 4)}, SPEC, 1.0)
    # A computed value is not the feature: the feature's declared bounds do not apply to it.
    namespace = {"tft": tft, "CLAMP_BOUNDS": {"fare": FARE}}
    exec("def declared(inputs):\n"
         "    return {'z': tft.scale_to_z_score(inputs['fare']),\n"
         "            'q': tft.bucketize(tf.reshape(inputs['fare'], [-1, 1]), 3)}\n"
         "def computed(inputs):\n"
         "    return {'z': tft.scale_to_z_score(inputs['fare'] * 2.0)}\n",
         {**namespace, "tf": tf}, namespace)
    assert audit(namespace["declared"], SPEC, 1.0) == [("scale_to_z_score(fare)", 0.5),
                                                       ("bucketize(fare)", 0.5)]
    with pytest.raises(dp.DPTransformError, match=r"scale_to_z_score\(fare\) needs clamp"):
        audit(namespace["computed"], SPEC, 1.0)


MODULE_HEADER = ("import tensorflow as tf\n{import_line}\n"
                 "def feature_spec():\n"
                 "    return {'fare': tf.io.FixedLenFeature([], tf.float32),\n"
                 "            'company': tf.io.FixedLenFeature([], tf.string)}\n")


def _module(tmp_path, import_line, body):
    path = tmp_path / "taxi_module.py"
    path.write_text(MODULE_HEADER.replace("{import_line}", import_line) + body)
    return str(path)


def test_missing_bounds_are_refused_by_the_block_ledger_before_the_charge(tmp_path):
    """DPTransform's check runs in the BlockLedger before its charge: a refusal there costs
    nothing (the executor raises BadRequest before ledger.request)."""
    from sage_tfx.components.block_ledger import preflight

    module = _module(tmp_path, "from sage_tfx.components.dp_transform import tft",
                     "def preprocessing_fn(inputs):\n"
                     "    return {'fare_z': tft.scale_to_z_score(inputs['fare'])}\n")
    check = preflight.Check(component="DPTransform", module_file=module, purpose="transform",
                            transform_step="transform")
    with pytest.raises(BadRequest, match=r"refused before the charge.*DPTransform.*"
                                         r"scale_to_z_score\(fare\) needs clamp bounds"):
        preflight.run([check], 1.0, 1e-6, {"transform": "1"})


def test_tensorflow_transforms_own_analyzers_are_refused_by_the_users_calls(tmp_path):
    """A module still importing tensorflow_transform is refused naming scale_to_z_score(fare)
    and compute_and_apply_vocabulary(company), not TFT's internal nodes; an analyzer without
    a DP version (tft.sum, reached through the DP module's pass-through) is named as such."""
    from sage_tfx.components.dp_transform.executor import load_module

    module = _module(tmp_path, "import tensorflow_transform as tft",
                     "def preprocessing_fn(inputs):\n"
                     "    return {'z': tft.scale_to_z_score(inputs['fare']),\n"
                     "            'c': tft.compute_and_apply_vocabulary(inputs['company'])}\n")
    with pytest.raises(dp.DPTransformError) as refused:
        audit(*load_module(module), 1.0)
    message = str(refused.value)
    assert "non-private analyzers" in message and "Each has a DP version" in message
    assert "scale_to_z_score(fare)" in message and "compute_and_apply_vocabulary(company)" \
        in message
    assert "ExtractCombineMergeOutputs" not in message and "VocabularyOrderAndWrite" \
        not in message
    with pytest.raises(dp.DPTransformError,
                       match=r"Not supported by DP here: sum\(fare\)"):
        audit(lambda inputs: {"s": _constant(inputs, tft.sum(inputs["fare"]))}, SPEC, 1.0)


def test_vocabulary_needs_a_delta_and_a_pure_laplace_plan_refuses_it(tmp_path):
    from sage_tfx.components.block_ledger import preflight
    from sage_tfx.sage_access.accounting import pure_dp_event

    def vocabulary(inputs):
        return {"c": tft.compute_and_apply_vocabulary(inputs["company"], top_k=2)}
    with pytest.raises(dp.DPTransformError, match=r"compute_and_apply_vocabulary\(company\) "
                                                  r"selects .* delta 0"):
        audit(vocabulary, SPEC, 1.0, 0.0)
    module = _module(tmp_path, "from sage_tfx.components.dp_transform import tft",
                     "def preprocessing_fn(inputs):\n"
                     "    return {'c': tft.compute_and_apply_vocabulary(inputs['company'])}\n")
    check = preflight.Check(component="DPTransform", module_file=module, purpose="transform",
                            transform_step="transform")
    with pytest.raises(BadRequest, match="planned as pure epsilon-DP"):
        preflight.run([check], 1.0, 1e-6, {"transform": "1"},
                      {"transform": pure_dp_event(1.0)})


def test_a_dp_transform_step_plans_the_analyzers_events_and_their_delta(tmp_path):
    """step_mechanisms {"transform": {"mechanism": "dp_transform", "module_file": ...}}: the
    grant records the composition of the analyzers' events, and the plan carries the
    vocabulary's delta, which an rdp ledger (no way to charge it) refuses."""
    from sage_tfx.components.privacy_grant import planned_additional_delta, step_events

    module = _module(tmp_path, "from sage_tfx.components.dp_transform import tft",
                     "CLAMP_BOUNDS = {'fare': (0.0, 100.0)}\n"
                     "def preprocessing_fn(inputs):\n"
                     "    return {'z': tft.scale_to_z_score(inputs['fare']),\n"
                     "            'c': tft.compute_and_apply_vocabulary(inputs['company'])}\n")
    mechanisms = {"transform": {"mechanism": "dp_transform", "module_file": module}}
    [event] = step_events(mechanisms, {"transform": "1/2"}, 2.0, 1e-6, "basic").values()
    assert len(event.events) == 2  # the moments' composition and the selection's
    assert planned_additional_delta(mechanisms, {"transform": "1/2"}, 2.0, 1e-6) == \
        pytest.approx(5e-7)
    with pytest.raises(BadRequest, match="no DP event|module"):
        step_events({"transform": {"mechanism": "dp_transform"}}, {"transform": "1"}, 1.0,
                    1e-6, "basic")


# --- a TFX module converted by its import, through DPTransform on Beam's DirectRunner ------

TFX_MODULE = '''import tensorflow as tf
import tensorflow_transform as tft


def feature_spec():
    return {"area": tf.io.FixedLenFeature([1], tf.int64),
            "fare": tf.io.FixedLenFeature([1], tf.float32),
            "company": tf.io.FixedLenFeature([1], tf.string)}


def preprocessing_fn(inputs):
    return {"fare_z": tf.reshape(tft.scale_to_z_score(inputs["fare"]), [-1]),
            "company_id": tf.reshape(tft.compute_and_apply_vocabulary(
                inputs["company"], top_k=10, num_oov_buckets=1), [-1]),
            "area_bucket": tf.reshape(tft.bucketize(inputs["area"], 2), [-1])}
'''
CONVERSION = ("import tensorflow_transform as tft\n",
              "from sage_tfx.components.dp_transform import tft\n"
              "CLAMP_BOUNDS = {'fare': (0.0, 40.0), 'area': (0.0, 4.0)}\n")


def _trips(directory) -> None:
    import csv

    directory.mkdir()
    with open(directory / "trips.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "area", "fare", "company", "ts"])
        for i in range(600):
            writer.writerow([i % 60, 1 + i % 2, 5 + i % 9, ["Flash", "Yellow", "Blue"][i % 3],
                             1388534400 + 3600 * i])


@pytest.mark.slow
def test_a_tfx_module_converted_by_its_import_runs_through_dp_transform(tmp_path):
    """The tensorflow_transform module is refused before the charge, naming its calls; the same
    module with the DP import (and its public bounds) runs BlockExampleGen -> BlockLedger ->
    DPTransform on the DirectRunner: the grant records the analyzers' composed event, the
    TransformGraph holds a DP vocabulary asset, and every granted record is transformed."""
    from tfx.orchestration import metadata, pipeline
    from tfx.orchestration.local.local_dag_runner import LocalDagRunner

    from sage_tfx.components import BlockExampleGen, BlockLedger, DPTransform
    from sage_tfx.components.block_ledger import preflight
    from sage_tfx.components.dp_transform.executor import load_module
    from sage_tfx.sage_access import BlockLedger as Ledger, connect

    _trips(tmp_path / "input")
    original = tmp_path / "tfx_module.py"
    original.write_text(TFX_MODULE)
    converted = tmp_path / "dp_module.py"
    converted.write_text(TFX_MODULE.replace(*CONVERSION))
    assert len(set(converted.read_text().splitlines())
               - set(original.read_text().splitlines())) == 2  # the import and the bounds
    check = preflight.Check(component="DPTransform", module_file=str(original),
                            purpose="transform", transform_step="transform")
    with pytest.raises(BadRequest, match=r"refused before the charge.*scale_to_z_score\(fare\)"):
        preflight.run([check], 1.0, 1e-6, {"transform": "1"})

    store = str(tmp_path / "metadata.sqlite")
    Ledger.create(store)
    gen = BlockExampleGen(input_base=str(tmp_path / "input"), block_key="uid", block_by="users",
                          users_per_block=30, schedule_start=0, schedule_end=60,
                          ledger_store=store, block_epsilon=4.0, block_delta=1e-5)
    ledger = BlockLedger(ledger_store=store, new_blocks=gen.outputs["examples"], window=2,
                         epsilon=2.0, delta=1e-6, split={"transform": 1.0},
                         step_mechanisms={"transform": {"mechanism": "dp_transform",
                                                        "module_file": str(converted)}})
    transform = DPTransform(examples=ledger.outputs["examples"], grant=ledger.outputs["grant"],
                            module_file=str(converted))
    LocalDagRunner().run(pipeline.Pipeline(
        pipeline_name="converted", pipeline_root=str(tmp_path / "root"),
        components=[gen, ledger, transform],
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store)))

    mlmd = connect(store)
    executions = {e.type.rsplit(".", 1)[-1]: e for e in mlmd.get_executions()}
    assert executions["DPTransform"].last_known_state == executions["DPTransform"].COMPLETE
    [graph] = mlmd.get_artifacts_by_type("TransformGraph")
    output = real_tft.TFTransformOutput(graph.uri)
    vocabulary = output.vocabulary_by_name("vocab_compute_and_apply_vocabulary_vocabulary")
    assert sorted(vocabulary) == [b"Blue", b"Flash", b"Yellow"]  # ~160 records each
    transformed = [a for a in mlmd.get_artifacts_by_type("sage_tfx.PrivateExamples") if "DPTransform" in a.uri]
    records = [tf.train.Example.FromString(r.numpy()) for path in
               tf.io.gfile.glob(os.path.join(transformed[0].uri, "Split-*", "*.gz"))
               for r in tf.data.TFRecordDataset(path, "GZIP")]
    assert len(records) == 600
    assert {tuple(r.features.feature["area_bucket"].int64_list.value) for r in records} <= \
        {(0,), (1,), (2,)}
    # The grant recorded the plan's event, the three analyzers' composition (DPTransform
    # compared it with what its analyzers run: a mismatch fails the execution).
    plan = plan_transform(*load_module(str(converted)), 2.0, 1e-6)
    assert len(plan.event.events) == 3


def test_the_vocabulary_path_stays_below_its_claim_in_the_auditor_and_half_noise_is_caught():
    """The empirical auditor (sage_tfx.audit) on the vocabulary's whole release, neighbours
    differing by one record of a kept value. At confidence 0.9999 the lower bound exceeds the
    true epsilon with probability <= 1e-4 (the false-failure rate of the first assertion); the
    release run at twice its epsilon must show more than the claim (at confidence 0.99)."""
    from sage_tfx.audit import mechanisms as audits
    from sage_tfx.audit.bounds import epsilon_lower_bound

    assert "analyzer_vocabulary" in audits.shipped()
    correct = audits.vocabulary_outputs(4_000)
    assert epsilon_lower_bound(*correct, delta=audits.VOCABULARY_DELTA,
                               confidence=0.9999) <= audits.VOCABULARY_EPSILON
    broken = audits.vocabulary_outputs(4_000, epsilon=2.0 * audits.VOCABULARY_EPSILON)
    assert epsilon_lower_bound(*broken, delta=audits.VOCABULARY_DELTA,
                               confidence=0.99) > audits.VOCABULARY_EPSILON


def test_each_release_calls_the_noise_module_with_its_derived_sensitivity(monkeypatch):
    """The module docstring's sensitivities, as each release hands them to sage_tfx.mechanisms
    (the mechanisms' own tests check that they noise as asked): a release that under-states
    one (the tree's levels, the squares' h^2 / 2) fails here. Bounds [-10, 30]: h = 20."""
    from sage_tfx import mechanisms

    asked = []

    def recording(name):
        original = getattr(mechanisms, name)

        def record(*args, **kwargs):
            asked.append((name, {k: v for k, v in kwargs.items() if k != "values"}))
            return original(*args, **kwargs)
        return record
    for name in ("laplace", "laplace_count_and_sum", "laplace_threshold"):
        monkeypatch.setattr(tft.mechanisms, name, recording(name))

    tft._NoisyMoments(-10.0, 30.0, 3.0).release(np.array([100.0, 5.0, 7.0]))
    assert asked == [("laplace_count_and_sum", {"value_bound": 20.0, "epsilon": 2.0}),
                     ("laplace", {"l1_sensitivity": 200.0, "epsilon": 1.0})]
    asked.clear()
    tft._NoisyExtremes(-10.0, 30.0, 3.0).release(np.zeros(tft.MIN_MAX_BUCKETS))
    tft._NoisyQuantileTree(-10.0, 30.0, 3.0, 4).release(0)
    tft._NoisyVocabulary(3.0, 1e-6, None, None, "v").release([(b"a", 5)])
    assert asked == [("laplace", {"l1_sensitivity": 1.0, "epsilon": 3.0}),
                     ("laplace", {"l1_sensitivity": float(QUANTILE_LEVELS), "epsilon": 3.0}),
                     ("laplace_threshold", {"max_partitions_per_unit": 1, "epsilon": 3.0,
                                            "delta": 1e-6})]
