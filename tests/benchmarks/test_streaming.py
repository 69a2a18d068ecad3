"""The streaming benchmark (issue 19 §3): §5.1's synthetic stream has the law it claims, the
baselines spend exactly the grant, and the script prints consistent metrics at tiny scale."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from support import REPO_ROOT


def _load(name):
    # The benchmarks are scripts beside the package (not a package): loaded by path.
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(REPO_ROOT, "benchmarks", f"{name}.py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


streaming_data = _load("streaming_data")
streaming = _load("streaming")


def test_the_footnote_law_has_mean_6_not_10_and_the_exponent_is_solved_for_the_mean_asked():
    footnote = streaming_data.records_law(streaming_data.FOOTNOTE_RECORDS_EXPONENT)
    assert footnote.mean == pytest.approx(6.115, abs=1e-3)
    assert footnote.above_ten == pytest.approx(0.159, abs=1e-3)  # the paper's "roughly 15%"
    assert footnote.percentile_99 == 33  # the paper's C = 32
    assert streaming_data.records_exponent(footnote.mean) == pytest.approx(6.738, abs=1e-6)
    asked = streaming_data.records_law(streaming_data.records_exponent(10.0))
    assert asked.mean == pytest.approx(10.0, abs=1e-9)


def test_generated_stream_follows_the_laws():
    users, keys = 200_000, 10 ** 5
    stream = streaming_data.generate(users, keys, 10.0, seed=1)
    per_user = np.bincount(stream.user, minlength=users)
    assert per_user.min() >= 1 and per_user.max() <= streaming_data.MAX_RECORDS_PER_USER
    law = stream.records_law
    # Bounds at 10 standard deviations of each estimate (records per user: sd 13.8 per user;
    # a fraction: binomial): Chebyshev puts each false failure below 1%, for any seed.
    assert abs(per_user.mean() - 10.0) < 10 * 13.8 / np.sqrt(users)
    above = law.above_ten
    assert abs((per_user > 10).mean() - above) < 10 * np.sqrt(above * (1 - above) / users)
    head = streaming_data.zipf_mandelbrot_pmf(keys, 1000.0, 1.4)[:1000].sum()  # 0.287
    share = stream.true_histogram()[:1000].sum() / len(stream)
    assert abs(share - head) < 10 * np.sqrt(head * (1 - head) / len(stream))
    assert np.all(np.diff(stream.time) >= 0)  # arrival order is event-time order
    assert stream.time.min() >= 0 and stream.time.max() < streaming_data.WINDOW_SECONDS
    # micro-batches: equal event-time widths, so about equal sizes under uniform times
    sizes = np.bincount(stream.micro_batch(10), minlength=10)
    assert sizes.sum() == len(stream)
    assert np.all(np.abs(sizes - len(stream) / 10) < 10 * np.sqrt(len(stream) / 10))


@pytest.mark.parametrize("compositions", [1, 10])
def test_baseline_calibration_spends_the_grant_under_dp_accountings_pld(compositions):
    epsilon, delta = 6.0, 1e-9
    budget = streaming.calibrate_one_shot(streaming.count_query(32, 1), epsilon, delta,
                                          compositions)
    assert compositions * budget.plan.additional_delta == pytest.approx(delta / 3)
    composed = dp_event.SelfComposedDpEvent(budget.plan.event, compositions)
    spent = pld_privacy_accountant.PLDAccountant().compose(composed).get_epsilon(
        delta - compositions * budget.plan.additional_delta)
    # PLD discretises pessimistically (~1e-8 here); the calibration leaves nothing on the table
    assert epsilon * (1 - 1e-4) < spent < epsilon * (1 + 1e-6)


def test_papers_accounting_composes_black_box_queries_optimally_and_gives_less_per_query():
    epsilon, delta, compositions = 6.0, 1e-9, 100
    query = streaming.count_query(32, 1)
    paper = streaming.calibrate_one_shot(query, epsilon, delta, compositions, "paper")
    generic = streaming.privacy_loss_distribution.from_privacy_parameters(
        streaming.pld_common.DifferentialPrivacyParameters(paper.plan.epsilon, paper.plan.delta))
    assert generic.self_compose(compositions).get_epsilon_for_delta(delta) <= epsilon
    assert paper.plan.delta * compositions == pytest.approx(delta / 2)
    # better than basic composition (k eps_q = eps; at k = 10 and this delta it is optimal),
    # worse than knowing the noise is Gaussian
    assert compositions * paper.plan.epsilon > epsilon
    gaussian = streaming.calibrate_one_shot(query, epsilon, delta, compositions)
    assert paper.plan.epsilon < gaussian.plan.epsilon


def test_metrics_are_the_papers_over_the_whole_key_space():
    truth = np.array([10.0, 5.0, 0.0, 3.0])
    estimate = np.array([12.0, 0.0, 0.0, 1.0])  # key 1 not released: it estimates 0
    released = np.array([True, False, False, True])
    assert streaming.utility(estimate, truth, released) == {
        "keys_kept": 2, "l_inf": 5.0, "l_1": 9.0, "l_2": pytest.approx(np.sqrt(33.0))}


def test_script_prints_one_consistent_json_object_at_tiny_scale():
    out = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "streaming.py"), "--users",
         "3000", "--keys", "500", "--micro-batches", "8", "--seed", "2", "--json"],
        capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout)
    assert set(streaming.SYSTEMS) <= set(report)
    records = report["config"]["records"]
    assert records > 3000
    for name in streaming.SYSTEMS:
        entry = report[name]
        assert set(streaming.METRICS) <= set(entry), name
        assert 0 <= entry["keys_kept"] <= 500
        assert 0 < entry["l_inf"] <= entry["l_2"] <= entry["l_1"], (name, entry)
        assert entry["records_per_s"] > 0
    assert report["baseline_1"]["queries_run"] == 8
    assert report["baseline_2"]["budget"]["compositions"] == 8  # min(B, C) participations
    assert report["dp_sqlp"]["guarantee"].startswith("(6, 1e-09)-DP for adding or removing all rows of one user")


def test_dp_sqlp_only_runs_no_baseline():
    args = streaming.parse_args(["--users", "2000", "--keys", "300", "--micro-batches", "4",
                                 "--dp-sqlp-only"])
    report = streaming.benchmark(args)
    assert "dp_sqlp" in report and not {"baseline_1", "baseline_2"} & set(report)
    assert report["dp_sqlp"]["keys_kept"] <= 300


def test_latency_mode_times_every_micro_batch():
    args = streaming.parse_args(["--users", "2000", "--keys", "300", "--latency",
                                 "--latency-micro-batches", "12,3"])
    report = streaming.latency(args)
    rows, records = report["latency"], report["config"]["records"]
    assert [row["micro_batches"] for row in rows] == [12, 3]
    for row in rows:
        assert row["records_per_micro_batch"] == pytest.approx(records / row["micro_batches"])
        assert 0 < row["latency_s_median"] <= row["latency_s_p90"]
        # the triggers' latencies split the run: B of them add up to at most its wall clock
        assert row["micro_batches"] * row["latency_s_mean"] <= records / row["records_per_s"]
