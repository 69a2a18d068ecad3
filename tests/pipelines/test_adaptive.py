"""The privacy-adaptive driver on the real taxi sample: RETRY until ACCEPT, every iteration's
charge in the ledger and its lineage, and bad input refused before anything is charged."""
import dataclasses
import json
import os

import pytest

from sage_tfx.examples.taxi.pipeline import (BLOCK_EPSILON, INITIAL_EPSILON, MIN_WINDOW,
                                             TaxiSource, adassp_spec, dp_sgd_spec)
from sage_tfx.pipelines.adaptive import ACCEPTED, Policy, run_adaptive
from sage_tfx.sage_access import BadRequest, BlockLedger, connect
from sage_tfx.sage_access.records import GRANT_TYPE
from sage_tfx.validators.slaed import iteration_confidence


def _database(tmp_path, months=12):
    store = str(tmp_path / "metadata.sqlite")
    BlockLedger.create(store, min_request_epsilon=0.05, for_tests=True)  # seeded specs
    source = TaxiSource(store, str(tmp_path))
    source.ingest(months)
    return store, source


@pytest.mark.slow
def test_conserve_retries_then_accepts_and_every_charge_is_in_the_lineage(tmp_path,
                                                                        seeded_noise):
    # Seeded throughout (the DP noise through the seeded_noise fixture): the outcomes of a
    # privacy-adaptive run depend on its noise, and this test pins one run's path.
    store, source = _database(tmp_path)
    lines = []
    # The demo's AdaSSP spec (target 0.026) from the old demo start, 12 months at 0.25: a path
    # of RETRYs, then its fourth iteration (24 months at epsilon 1) bounds the loss by 0.02538
    # at its share of the run's confidence (0.9981; one SLA for the whole run).
    spec = adassp_spec(seed=7)
    result = run_adaptive(spec, Policy("conserve", initial_epsilon=0.25,
                                                      min_window=12),
                          "taxi-adassp", str(tmp_path / "run"), store, source, lines.append)
    outcomes = [iteration.outcome for iteration in result.iterations]
    assert result.outcome == ACCEPTED, lines
    assert outcomes[-1] == "ACCEPT" and "RETRY" in outcomes[:-1]
    # Conserve: epsilon doubles while the window's blocks can pay it, then the window doubles.
    plan = [(i.window, i.epsilon) for i in result.iterations]
    assert plan[:3] == [(12, 0.25), (12, 0.5), (12, 1.0)]
    assert plan[3] == (24, 1.0)
    assert os.listdir(result.pushed_model)
    assert any(line.startswith("iteration 1: window 12") for line in lines)
    # One SLA for the whole run: iteration k tests at its share of the run's confidence 0.95,
    # and the ACCEPT states the run-level guarantee.
    assert [i.confidence for i in result.iterations] == \
        [iteration_confidence(0.95, k) for k in range(1, len(outcomes) + 1)]
    assert f"(this is its iteration {len(outcomes)}," in result.message
    assert "at most 0.025 in all" in result.message
    assert lines[-1] == f"  guarantee: {result.iterations[-1].guarantee}"

    ledger = BlockLedger(store)
    assert ledger.waiting_pipelines() == []
    spent = {block.block_id: block.spent[0] for block in ledger.blocks()}
    for block_id in spent:
        used = sum(i.epsilon for i in result.iterations if block_id in i.blocks)
        assert spent[block_id] == pytest.approx(used)
        assert spent[block_id] <= BLOCK_EPSILON
    assert ledger.audit().problems == []
    # One grant per iteration, each in the context of the TFX run that spent it.
    mlmd = connect(store)
    grants = mlmd.get_executions_by_type(GRANT_TYPE)
    assert len(grants) == len(result.iterations)
    for grant in grants:
        runs = [c for c in mlmd.get_contexts_by_execution(grant.id) if c.type == "pipeline_run"]
        assert len(runs) == 1
        assert json.loads(grant.custom_properties["blocks"].string_value)


@pytest.mark.slow
def test_dp_sgd_pipeline_accepts_on_its_first_window(tmp_path, seeded_noise):
    """The DP-SGD pipeline as the demo runs it (its first window and epsilon), seeded."""
    store, source = _database(tmp_path, months=MIN_WINDOW["dp_sgd"])
    result = run_adaptive(dp_sgd_spec(seed=1),
                          Policy("conserve", initial_epsilon=INITIAL_EPSILON["dp_sgd"],
                                 min_window=MIN_WINDOW["dp_sgd"]),
                          "taxi-dp-sgd", str(tmp_path / "run"), store, source, lambda _: None)
    assert result.outcome == ACCEPTED, result.iterations
    plan = [(i.window, i.epsilon) for i in result.iterations]
    assert plan == [(24, 0.5), (24, 1.0)][:len(plan)]
    assert result.iterations[-1].upper_bound <= result.iterations[-1].target
    assert os.listdir(result.pushed_model)
    assert all(block.spent[0] <= BLOCK_EPSILON for block in BlockLedger(store).blocks())


@pytest.mark.slow
def test_aggressive_spends_the_whole_allocation_at_once(tmp_path):
    store, source = _database(tmp_path)
    result = run_adaptive(adassp_spec(seed=3), Policy("aggressive", min_window=12,
                                                      max_iterations=1),
                          "taxi-aggressive", str(tmp_path / "run"), store, source, lambda _: None)
    [iteration] = result.iterations
    assert iteration.epsilon == pytest.approx(BLOCK_EPSILON, rel=1e-6)
    assert all(block.spent[0] == pytest.approx(BLOCK_EPSILON)
               for block in BlockLedger(store).blocks())


def _nothing_charged(store):
    return all(block.spent[0] == 0 for block in BlockLedger(store).blocks()) and \
        not connect(store).get_executions_by_type(GRANT_TYPE)


@pytest.mark.parametrize("change, policy, message", [
    ({"module_file": "/no/such/module.py"}, Policy(min_window=12), "does not exist"),
    ({"validation": {"metric": "loss", "target": 2.0, "loss_bound": 0.25}}, Policy(min_window=12),
     "outside"),
    ({}, Policy(min_window=60), "larger than the database will ever be"),
    ({}, Policy(min_window=12, initial_epsilon=3.0), "exceeds the blocks' ceiling"),
    ({"split": {"training": 1.0}}, Policy(min_window=12), "needs shares"),
])
def test_bad_input_is_refused_before_anything_is_charged(tmp_path, change, policy, message):
    store, source = _database(tmp_path, months=2)
    spec = dataclasses.replace(adassp_spec(), **change)
    with pytest.raises(BadRequest, match=message):
        run_adaptive(spec, policy, "taxi-bad", str(tmp_path / "run"), store, source)
    assert _nothing_charged(store)
    assert BlockLedger(store).waiting_pipelines() == []


def test_dp_sgd_that_cannot_be_calibrated_is_refused_before_its_grant(tmp_path):
    """DPTrainer would refuse this budget only after the grant was charged. The driver decides
    from public values only: the refusal is the same on windows holding different records."""
    spec = dp_sgd_spec()
    spec = dataclasses.replace(spec, sampling={"scheme": "poisson", "gamma": 0.05, "epochs": 5},
                               trainer={**spec.trainer, "max_noise_multiplier": 2.0})
    messages = []
    for months in (2, 3):
        store, source = _database(tmp_path / f"months-{months}", months=months)
        with pytest.raises(BadRequest, match=r"DP-SGD cannot train at epsilon 0.25 .*even noise "
                                             r"multiplier 2") as refused:
            run_adaptive(spec, Policy(min_window=2, initial_epsilon=0.25), "taxi-sgd",
                         str(tmp_path / f"run-{months}"), store, source)
        messages.append(str(refused.value))
        assert _nothing_charged(store)
        assert BlockLedger(store).waiting_pipelines() == []
    assert messages[0] == messages[1]


def test_a_window_never_holds_a_block_without_data(tmp_path):
    """The grant component would find the missing data only after charging the window: the
    driver plans, and the BlockLedger grants, windows of blocks holding Examples only
    (sage_access/test_ledger.py: the grant's own selection)."""
    from sage_tfx.pipelines.adaptive import _payable
    store, source = _database(tmp_path, months=2)
    ledger = BlockLedger(store)
    months = [block.block_id for block in ledger.live_blocks()]
    ledger.add_block("added-by-hand", BLOCK_EPSILON, 1e-6)
    assert [block.block_id for block in _payable(ledger, adassp_spec(), 0.25, "taxi-gap")] == \
        months
    assert _nothing_charged(store)


@pytest.mark.parametrize("option, value", [("--initial-epsilon", "0"), ("--min-window", "0")])
def test_demo_refuses_a_non_positive_first_iteration_before_writing_anything(tmp_path, capsys,
                                                                             option, value):
    from sage_tfx.examples.taxi import run
    workdir = tmp_path / "demo"
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--workdir", str(workdir), option, value])
    assert exit_info.value.code == 2
    assert f"{option} must be" in capsys.readouterr().err
    assert not workdir.exists()


def test_the_driver_plans_on_an_rdp_ledger_with_the_iterations_events(tmp_path):
    """An rdp ledger charges the RDP curve of the steps' events, so the driver plans with them;
    DP-SGD has no event before it runs and is refused there before anything is charged."""
    from sage_tfx.pipelines.adaptive import _payable
    store = str(tmp_path / "metadata.sqlite")
    ledger = BlockLedger.create(store, accounting="rdp", min_request_epsilon=0.05)
    for month in ("2024-01", "2024-02"):
        ledger.add_block(month, BLOCK_EPSILON, 1e-6, data_uri=str(tmp_path / month))
    assert len(_payable(ledger, adassp_spec(), 0.5, "taxi")) == 2
    assert _payable(ledger, adassp_spec(), 1.5, "taxi") == []  # its curve exceeds every order
    with pytest.raises(BadRequest, match="'training' \\(dp_sgd\\) has no DP event .* rdp ledger"):
        _payable(ledger, dp_sgd_spec(), 0.5, "taxi")
    assert _nothing_charged(store)


def test_a_dp_sgd_split_without_the_sampling_count_share_is_refused_before_its_grant():
    # ObliviousSampleGen pays its DP count of the records from the grant's sampling_count
    # share; without one it could only fail after the whole grant was charged.
    spec = dataclasses.replace(dp_sgd_spec(), split={"transform": 0.1, "training": 0.5,
                                                      "validation": 0.4})
    with pytest.raises(BadRequest, match="sampling_count"):
        spec.check()
    public = dataclasses.replace(spec, sampling={**spec.sampling, "public_size": 5000})
    public.check()  # a public size needs no count
