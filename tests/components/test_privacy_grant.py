"""Issue 16 §4: a grant is what the ledger recorded, not what its artifact says about itself.

The BlockLedger component's executor runs in-process on a real SQLite ML Metadata ledger; each
test then plays a DP component (require_grant + share) against one refusal.
"""
import json
import multiprocessing
import os

import pytest
from tfx.types import standard_artifacts

from sage_tfx.components.block_ledger import executor
from sage_tfx.components.privacy_grant import (GrantError, PrivacyGrant, carry_grant,
                                               require_grant)
from sage_tfx.sage_access import BadRequest, BlockLedger
from sage_tfx.sage_access.accounting import check_split

from support.share_claim import claim

SPLIT = {"transform": 0.1, "training": 0.5, "validation": 0.4}


def _block_data(root, block_id):
    uri = os.path.join(root, "blocks", block_id)
    for split in ("train", "eval"):
        os.makedirs(os.path.join(uri, f"Split-{split}"))
        with open(os.path.join(uri, f"Split-{split}", "data"), "wb") as handle:
            handle.write(block_id.encode())
    return uri


def issue_grant(store_path, root, name="grant", split=SPLIT):
    """Run the BlockLedger component's executor; returns its (PrivacyGrant, Examples)."""
    examples, grant = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant.uri = os.path.join(root, name, "examples"), os.path.join(root, name, "g")
    executor.Executor().Do({}, {"examples": [examples], "grant": [grant]}, {
        "ledger_store": store_path, "ledger_context": "default", "epsilon": 0.5, "delta": 1e-7,
        "window": 2, "split": json.dumps(split)})
    return grant, examples


@pytest.fixture
def granted(store_path, tmp_path):
    ledger = BlockLedger.create(store_path, min_request_epsilon=0.05)
    for block_id in ("2024-01", "2024-02"):
        ledger.add_block(block_id, 2.0, 1e-6, data_uri=_block_data(str(tmp_path), block_id))
    return issue_grant(store_path, str(tmp_path))


def test_the_grant_records_its_exact_split_and_a_component_gets_its_share(granted, store_path):
    grant, examples = granted
    info = require_grant([grant], [examples])
    recorded = BlockLedger(store_path).find_grant(info.grant_id)
    assert recorded.split == {"transform": "0.1", "training": "0.5", "validation": "0.4"}
    assert info.share("training") == (0.25, 5e-08)
    # Exact decimal arithmetic: 0.1 + 0.5 + 0.4 is 1, and a split 1e-12 above 1 is refused.
    check_split(SPLIT)
    with pytest.raises(BadRequest, match="sum to .* > 1"):
        check_split({"a": 0.5, "b": 0.500000000001})
    # Shares round down: together they never exceed the grant.
    shares = [info.share(step) for step in ("transform", "validation")] + [(0.25, 5e-08)]
    assert sum(e for e, _ in shares) <= 0.5 and sum(d for _, d in shares) <= 1e-7


def test_a_hand_made_grant_is_refused(granted):
    grant, examples = granted
    forged = PrivacyGrant()
    for key in ("ledger_store", "ledger_context", "blocks", "epsilon", "delta", "split"):
        forged.set_string_custom_property(key, grant.get_string_custom_property(key))
    forged.set_string_custom_property("grant_id", "0" * 32)
    with pytest.raises(GrantError, match="was not issued by ledger"):
        require_grant([forged], [examples])


@pytest.mark.parametrize("key,value", [
    ("split", json.dumps({"transform": "0.1", "training": "0.8", "validation": "0.1"})),
    ("epsilon", "5.0"),
    ("blocks", json.dumps(["2024-01"])),
])
def test_a_tampered_grant_is_refused(granted, key, value):
    grant, examples = granted
    grant.set_string_custom_property(key, value)
    with pytest.raises(GrantError, match=f"does not match the ledger's record \\({key}"):
        require_grant([grant], [examples])


def test_a_second_consumer_of_the_same_share_is_refused(granted):
    grant, examples = granted
    require_grant([grant], [examples], consumer="trainer-1").share("training")
    second = require_grant([grant], [examples], consumer="trainer-2")
    with pytest.raises(GrantError, match="'training' share .* already used \\(by trainer-1\\)"):
        second.share("training")
    second.share("validation")  # the other shares are untouched
    with pytest.raises(GrantError, match="'validation' share .* already used"):
        require_grant([grant], [examples]).share("validation")


@pytest.mark.slow
def test_concurrent_consumers_of_one_share_exactly_one_wins(granted, store_path):
    grant, _ = granted
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=claim, args=(store_path, grant.get_string_custom_property(
        "grant_id"), "training", queue)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert sorted(queue.get(timeout=5) for _ in workers) == ["refused"] * 3 + ["won"]


def test_examples_must_be_the_grants_own_output(granted, store_path, tmp_path):
    grant, examples = granted
    # An Importer later: the same files copied elsewhere, with every custom property copied.
    imported = standard_artifacts.Examples()
    imported.uri = str(tmp_path / "imported")
    for key, value in examples.mlmd_artifact.custom_properties.items():
        imported.set_string_custom_property(key, value.string_value)
    with pytest.raises(GrantError, match="not the output of grant"):
        require_grant([grant], [imported])
    # A block's own Examples (not emitted by the grant) are refused too.
    block = standard_artifacts.Examples()
    block.uri = BlockLedger(store_path).block("2024-01").data_uri
    with pytest.raises(GrantError, match="not the output of grant"):
        require_grant([grant], [block])
    # Another grant's Examples do not come with this grant.
    other_grant, other_examples = issue_grant(store_path, str(tmp_path), name="other")
    with pytest.raises(GrantError, match="not the output of grant"):
        require_grant([grant], [other_examples])
    require_grant([other_grant], [other_examples])
    # Derived data (e.g. samples) is accepted once the producer recorded it under the grant.
    samples = standard_artifacts.Examples()
    samples.uri = str(tmp_path / "samples")
    with pytest.raises(GrantError, match="not the output of grant"):
        require_grant([grant], [samples])
    carry_grant(require_grant([grant], [examples]), samples, "ObliviousSampleGen")
    assert require_grant([grant], [samples]).grant_id == grant.get_string_custom_property(
        "grant_id")


def _rdp_ledger(store_path, root):
    ledger = BlockLedger.create(store_path, accounting="rdp", min_request_epsilon=0.05)
    for block_id in ("2024-01", "2024-02"):
        ledger.add_block(block_id, 2.0, 1e-6, data_uri=_block_data(root, block_id))
    return ledger


def _grant_with_mechanisms(store_path, root, mechanisms, name="grant"):
    examples, grant = standard_artifacts.Examples(), PrivacyGrant()
    examples.uri, grant.uri = os.path.join(root, name, "examples"), os.path.join(root, name, "g")
    executor.Executor().Do({}, {"examples": [examples], "grant": [grant]}, {
        "ledger_store": store_path, "ledger_context": "default", "epsilon": 0.5, "delta": 1e-7,
        "window": 2, "split": json.dumps(SPLIT), "step_mechanisms": json.dumps(mechanisms)})
    return grant, examples


ITERATION = {"transform": {"mechanism": "laplace"}, "training": {"mechanism": "adassp"},
             "validation": {"mechanism": "laplace"}}


def test_an_rdp_ledger_charges_the_curve_of_the_recorded_events(store_path, tmp_path):
    """Issue 17 §1: the grant records each step's event; an rdp ledger charges their RDP curve."""
    import dp_accounting
    from sage_tfx.components.dp_trainer import adassp
    from sage_tfx.sage_access.accounting import pure_dp_event, rdp_curve_of

    ledger = _rdp_ledger(store_path, str(tmp_path))
    grant, examples = _grant_with_mechanisms(store_path, str(tmp_path), ITERATION)
    info = require_grant([grant], [examples])
    epsilon, delta = info.share("training")
    assert (epsilon, delta) == (0.25, 5e-08)
    sigma = adassp.noise_multiplier(epsilon, delta)
    assert info.event("training") == dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(sigma), 3)
    expected = rdp_curve_of([pure_dp_event(0.05), info.event("training"), pure_dp_event(0.2)],
                            ledger.orders)
    for block in BlockLedger(store_path).blocks():
        assert list(block.spent) == pytest.approx(list(expected), rel=1e-12)
    assert BlockLedger(store_path).audit().problems == []
    # What ran must be what was recorded: AdaSSP at a smaller noise multiplier is refused.
    info.check_event("training", adassp.dp_event(sigma))
    with pytest.raises(GrantError, match="ran .* but the ledger recorded and charged"):
        info.check_event("training", adassp.dp_event(sigma / 2))


def test_an_rdp_ledger_refuses_a_step_without_an_event_and_charges_nothing(store_path, tmp_path):
    _rdp_ledger(store_path, str(tmp_path))
    with pytest.raises(BadRequest, match="'training' \\(dp_sgd\\) has no DP event .* rdp ledger"):
        _grant_with_mechanisms(store_path, str(tmp_path), {**ITERATION,
                                                           "training": {"mechanism": "dp_sgd"}})
    with pytest.raises(BadRequest, match="give the DP event of every step .*'validation'"):
        _grant_with_mechanisms(store_path, str(tmp_path), {"training": {"mechanism": "adassp"}})
    assert all(not block.spent.any() for block in BlockLedger(store_path).blocks())
