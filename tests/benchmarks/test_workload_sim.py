"""The workload simulator drives the real ledger: budgets are conserved, and the strategies
order as Sage §5.4 says at a fixed seed."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from support import REPO_ROOT

# The simulator is a research tool beside the benchmarks (not a package): loaded by path.
_loaded = importlib.util.spec_from_file_location(
    "workload_sim", os.path.join(REPO_ROOT, "benchmarks", "workload_sim.py"))
workload_sim = sys.modules["workload_sim"] = importlib.util.module_from_spec(_loaded)
_loaded.loader.exec_module(workload_sim)
from workload_sim import (STRATEGIES, BlockConserve, InverseEpsilonComplexity,  # noqa: E402
                          ValidationBoundComplexity, WorkloadConfig, draw_pipelines,
                          fit_validation_bound, simulate)

CONFIG = WorkloadConfig(0.6, arrival_hours=60, drain_hours=30)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_block_exceeds_its_ceiling_and_reservations_add_up(strategy):
    result = simulate(strategy, CONFIG, seed=3)
    assert result.pipelines > 0
    ledger = result.ledger
    assert ledger.audit().problems == []  # every balance re-derived from the history matches
    for block in ledger.blocks():
        reserved = sum((np.maximum(r, 0.0) for r in block.reservations.values()),
                       np.zeros(2))
        assert block.spent[0] <= block.epsilon_ceiling + 1e-9, block
        # (epsilon, delta): what is spent plus what is promised stays within the capacity.
        assert np.all(block.spent + reserved <= block.capacity + 1e-9), block
    if strategy.startswith("block"):
        # Released pipelines returned their reservations: only waiting ones still hold some.
        waiting = set(ledger.waiting_pipelines())
        holders = {name for block in ledger.blocks() for name, r in block.reservations.items()
                   if r[0] > 1e-12}
        assert holders <= waiting


@pytest.mark.slow
def test_strategies_order_as_in_sage_at_a_fixed_seed():
    config = WorkloadConfig(0.7, arrival_hours=120, drain_hours=60)
    release = {s: simulate(s, config, seed=1) for s in STRATEGIES}
    hours = {s: r.mean_release_hours for s, r in release.items()}
    assert hours["block_conserve"] == min(hours.values()), hours
    assert hours["block_conserve"] < 24.0, hours
    assert hours["query"] > 2 * hours["block_aggressive"], hours
    # Conserving budget (Sage §5.4): released pipelines hand unspent reservations to others.
    assert hours["block_aggressive"] >= 2 * hours["block_conserve"], hours
    assert release["query"].unreleased_fraction > 0.5  # the one stream budget runs out
    assert release["block_conserve"].unreleased_fraction == 0.0


def test_complexity_and_arrivals_are_as_configured():
    assert InverseEpsilonComplexity(10_000, 0.1).samples_needed(0.1) == pytest.approx(20_000)
    pipelines = draw_pipelines(WorkloadConfig(2.0, arrival_hours=500), np.random.default_rng(0))
    # Gamma inter-arrivals with mean 1/2 hour: about 1,000 arrivals (Poisson-like spread).
    assert 900 <= len(pipelines) <= 1100
    needs = [p.complexity.nonprivate_samples for p in pipelines]
    assert min(needs) >= 10_000 and max(needs) <= 2_000_000
    with pytest.raises(ValueError, match="unknown strategy"):
        simulate("fifo", CONFIG, seed=0)
    with pytest.raises(ValueError, match="unknown complexity model 'sage'"):
        WorkloadConfig(0.6, complexity_model="sage")
    with pytest.raises(ValueError, match="arrival rate must be > 0, got 0"):
        WorkloadConfig(0.0)


def test_validation_bound_complexity_fills_the_tests_slack():
    complexity = ValidationBoundComplexity(10_000, dp_cost=37.0)
    for epsilon in (0.05, 0.5, 4.0):  # c1 / sqrt(n) + c2 / (n eps) = gap, with c1 / gap = sqrt(n0)
        n = complexity.samples_needed(epsilon)
        assert 1 / n ** 0.5 + 37.0 / (n * epsilon) == pytest.approx(1 / 10_000 ** 0.5)
    # More budget, less data; without DP's cost, the non-private need.
    assert complexity.samples_needed(0.05) > complexity.samples_needed(0.5) > 10_000
    assert ValidationBoundComplexity(10_000, dp_cost=0.0).samples_needed(1.0) == 10_000
    # DP adds about 2 dp_cost sqrt(n0) / eps: relatively less for pipelines that need more data.
    large = ValidationBoundComplexity(1_000_000, dp_cost=37.0)
    assert large.samples_needed(1.0) / 1_000_000 < complexity.samples_needed(1.0) / 10_000
    # The fit that measures dp_cost recovers known constants from noisy slacks.
    rng = np.random.default_rng(0)
    records = rng.integers(4_000, 15_000, size=24)
    epsilons = rng.choice([0.25, 0.5, 1.0, 2.0], size=24)
    slack = (0.4 / np.sqrt(records) + 14.0 / (records * epsilons)) * rng.uniform(0.97, 1.03, 24)
    c1, c2, max_relative_error = fit_validation_bound(records, epsilons, slack)
    assert c1 == pytest.approx(0.4, rel=0.1) and c2 == pytest.approx(14.0, rel=0.1)
    assert max_relative_error < 0.07
    pipelines = draw_pipelines(WorkloadConfig(1.0, arrival_hours=50,
                                              complexity_model="taxi_measured"),
                               np.random.default_rng(0))
    assert pipelines and all(isinstance(p.complexity, ValidationBoundComplexity)
                             for p in pipelines)


@pytest.mark.slow
def test_benchmark_quick_prints_the_contract(tmp_path):
    plot = tmp_path / "fig8.png"
    out = subprocess.run([sys.executable, "benchmarks/workload.py", "--quick", "--json",
                          "--plot", str(plot)], capture_output=True, text=True, check=True,
                         cwd=REPO_ROOT).stdout
    result = json.loads(out)
    rates = result["arrival_rates_per_hour"]
    assert set(result["strategies"]) == set(STRATEGIES)
    for row in result["strategies"].values():
        assert len(row["mean_release_hours"]) == len(row["unreleased_fraction"]) == len(rates)
    assert plot.stat().st_size > 0


def test_conserve_retries_only_with_twice_the_resources_of_its_last_retry(monkeypatch):
    """Sage's cost bound (failed iterations spend at most the accepted one) needs every retry to
    double epsilon x blocks; a plan shrunk under load must not go below that."""
    config = WorkloadConfig(1.2, arrival_hours=40, drain_hours=20)
    grants = []
    original = BlockConserve.train

    def recording_train(self, pipeline, epsilon, allowances):
        window = sum(allowance >= epsilon for allowance in allowances)
        outcome = original(self, pipeline, epsilon, allowances)
        if outcome != "wait":
            grants.append((pipeline.name, window * epsilon, outcome))
        return outcome

    monkeypatch.setattr(BlockConserve, "train", recording_train)
    simulate("block_conserve", config, seed=2)
    by_pipeline = {}
    for name, resources, outcome in grants:
        by_pipeline.setdefault(name, []).append((resources, outcome))
    retried = [runs for runs in by_pipeline.values() if len(runs) > 1]
    assert retried  # under this load some pipelines do retry
    for runs in retried:
        for (before, outcome), (after, _) in zip(runs, runs[1:]):
            assert outcome == "retry" and after >= 2 * before - 1e-9, runs
