"""The release protocol: one charge, an outcome recorded on every grant (released, failed with a
public reason, interrupted), denials recorded, one Guarantee written beside every file."""
import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
from dp_accounting import dp_event

from sage_tfx import release
from sage_tfx.sage_access import BlockLedger
from sage_tfx.sage_access.errors import BadRequest, BudgetExhausted
from sage_tfx.sage_access.ledger import BlockIds

EVENT = dp_event.GaussianDpEvent(3.0)


@pytest.fixture
def ledger(store_path):
    ledger = BlockLedger.create(store_path)
    ledger.add_block("b1", 1.0, 1e-6)
    return ledger


def plan(epsilon=0.4, request="SELECT 1"):
    return release.ReleasePlan.single_step("test door", request, "step", epsilon, 1e-7, EVENT,
                                           pipeline="p")


def test_a_release_records_its_front_door_request_outcome_artifacts_and_guarantee(ledger):
    with release.charge(ledger, plan(), BlockIds(["b1"])) as charged:
        assert charged.share("step") == pytest.approx((0.4, 1e-7))  # rounded down, never up
        guarantee = charged.guarantee(release.GuaranteeUnit.UNIT, "uid")
        charged.released(["out.csv"], guarantee)
    [record] = ledger.grant_records()
    assert (record["front_door"], record["request"], record["outcome"]) == (
        "test door", "SELECT 1", "released")
    assert record["steps"]["step"]["artifacts"] == ["out.csv"]
    assert record["steps"]["step"]["guarantee"] == guarantee.sentence() == (
        f"(0.4, 1e-07)-DP for adding or removing all rows of one uid; grant "
        f"{record['grant_id']} on blocks b1")


def test_a_failure_after_the_charge_is_recorded_with_a_public_reason_only(ledger):
    """The exception's message (and even its type) may depend on the data: the record keeps the
    phase only, and the error says it without chaining the original."""
    with pytest.raises(release.ReleaseFailed, match="budget is spent.*failed while reading "
                                                     r"\(recorded as failed") as raised:
        with release.charge(ledger, plan(), BlockIds(["b1"])) as charged:
            charged.phase = "reading"
            raise ValueError("row SECRET-42 is malformed")
    assert "SECRET" not in str(raised.value) and raised.value.__cause__ is None
    [record] = ledger.grant_records()
    assert record["outcome"] == "failed"
    assert record["steps"]["step"]["reason"] == "failed while reading"
    assert "SECRET" not in json.dumps(record)
    assert ledger.blocks()[0].charges == 1  # spent all the same, and the ledger says so


def test_ctrl_c_after_the_charge_is_recorded_and_says_the_budget_is_spent(ledger):
    with pytest.raises(KeyboardInterrupt, match="that budget is spent and nothing was "
                                                "released") as raised:
        with release.charge(ledger, plan(), BlockIds(["b1"])):
            raise KeyboardInterrupt
    assert isinstance(raised.value, release.ReleaseInterrupted)
    assert ledger.grant_records()[0]["outcome"] == "interrupted"


def test_leaving_without_a_release_is_a_recorded_failure(ledger):
    with pytest.raises(release.ReleaseFailed, match="recorded no release"):
        with release.charge(ledger, plan(), BlockIds(["b1"])):
            pass
    assert ledger.grant_records()[0]["outcome"] == "failed"


def test_a_grant_whose_process_died_stays_incomplete(ledger):
    release.charge(ledger, plan(), BlockIds(["b1"]))  # never entered, never recorded
    assert ledger.grant_records()[0]["outcome"] == "incomplete"


def test_a_denial_is_recorded_with_who_asked_how_much_and_what_was_free(ledger):
    with pytest.raises(BudgetExhausted):
        release.charge(ledger, plan(epsilon=5.0, request="SELECT big"), BlockIds(["b1"]))
    assert ledger.grant_records() == [] and ledger.blocks()[0].charges == 0
    [denial] = ledger.denial_records()
    assert (denial["front_door"], denial["request"], denial["pipeline"], denial["epsilon"]) == (
        "test door", "SELECT big", "p", 5.0)
    assert set(denial["free"]) == {"b1"} and "available to p: (1, 1e-06)" in denial["free"]["b1"]


def test_a_consumer_that_spent_nothing_records_nothing(ledger):
    """A second consumer of a released step is refused before it reads anything, and one that
    fails before consuming its share leaves the step to a retry; neither touches the first
    consumer's outcome."""
    grant = ledger.request(BlockIds(["b1"]), 0.4, 1e-7, split={"step": "1"},
                           events={"step": EVENT})
    with pytest.raises(release.ReleaseFailed, match="failed while reading$"):
        with release.consume(ledger, grant, ["step"], "first try") as first:
            first.phase = "reading"
            raise OSError("transient: /data/part-0 vanished")
    assert ledger.grant_records()[0]["steps"] == {}  # nothing recorded: the retry may spend it
    with release.consume(ledger, grant, ["step"], "retry") as retry:
        retry.share("step")
        retry.released(["retry.csv"])
    with pytest.raises(BadRequest, match="have an outcome already .released by retry"):
        with release.consume(ledger, grant, ["step"], "another door"):
            pass
    [record] = ledger.grant_records()
    assert (record["outcome"], record["steps"]["step"]["front_door"]) == ("released", "retry")


def test_a_share_asked_twice_is_consumed_once(ledger):
    with release.charge(ledger, plan(), BlockIds(["b1"])) as charged:
        assert charged.share("step") == charged.share("step")
        charged.released()
    with pytest.raises(BadRequest, match="already used"):
        ledger.use_share(charged.grant, "step", "another")


def test_files_carry_the_guarantee(tmp_path):
    guarantee = release.Guarantee(1.0, 1e-6, release.GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ,
                                  "uid", "g1", ("b1", "b2"))
    table = pd.DataFrame({"key": ["a"], "n": [3.5]})
    release.write_csv(table, str(tmp_path / "out.csv"), guarantee)
    release.write_parquet(table, str(tmp_path / "out.parquet"), guarantee)
    sidecar = json.loads((tmp_path / "out.csv.guarantee.json").read_text())
    assert release.Guarantee.from_json(sidecar) == guarantee
    metadata = pq.read_schema(tmp_path / "out.parquet").metadata
    assert json.loads(metadata[b"sage_tfx.guarantee"])["guarantee"] == guarantee.sentence()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "out.csv", "out.csv.guarantee.json", "out.parquet"]  # no temporary left behind


def test_a_guarantee_needs_the_unit_column_it_names():
    with pytest.raises(ValueError, match="names its unit column"):
        release.Guarantee(1.0, 0.0, release.GuaranteeUnit.UNIT, None, "g", ("b",))
    assert release.Guarantee(1.0, 0.0, "record", None, None, ()).sentence() == (
        "(1, 0)-DP for adding or removing one record of the granted blocks; no grant (a run "
        "outside the ledger)")


def test_a_stated_epsilon_is_never_below_the_charged_one():
    for epsilon in (1 / 3, 2 / 3, 0.1, 7 / 9, 1e-7 / 3):
        stated = release.Guarantee(epsilon, 1e-6 / 3, "record", None, "g", ("b",)).sentence()
        shown_epsilon, shown_delta = stated[1:stated.index(")")].split(", ")
        assert float(shown_epsilon) >= epsilon and float(shown_delta) >= 1e-6 / 3, stated


def test_a_fixed_seed_is_refused_before_the_charge_unless_the_ledger_is_for_tests(store_path,
                                                                                   tmp_path):
    """Issue 45, item 5: a seed makes the noise a function of public text, so a plan seeded by
    one is refused on a ledger not created for tests, saying why and what to do, with nothing
    charged or recorded; a ledger created for tests runs it and every guarantee it issues says
    so."""
    ledger = BlockLedger.create(store_path)
    ledger.add_block("b1", 1.0, 1e-6)
    seeded = release.ReleasePlan.single_step("test door", "SELECT 1", "step", 0.4, 1e-7, EVENT,
                                             seeded_by=("DPTrainer seed 7",))
    with pytest.raises(BadRequest, match="nothing was charged.*DPTrainer seed 7.*not created "
                                         "for tests.*for_tests=True.*--for-tests"):
        release.charge(ledger, seeded, BlockIds(["b1"]))
    assert ledger.blocks()[0].charges == 0 and not ledger.grant_records()
    assert not ledger.denial_records()
    assert not BlockLedger(store_path).for_tests

    tests_store = str(tmp_path / "tests-ledger.sqlite")
    BlockLedger.create(tests_store, for_tests=True).add_block("b1", 1.0, 1e-6)
    for_tests = BlockLedger(tests_store)  # recorded on the ledger: read back when reopened
    assert for_tests.for_tests
    with release.charge(for_tests, seeded, BlockIds(["b1"])) as charged:
        guarantee = charged.guarantee(release.GuaranteeUnit.RECORD)
        charged.released(["out.csv"], guarantee)
    assert "ledger created for tests: a fixed seed may have drawn the noise" in \
        guarantee.sentence()
    assert guarantee.to_json()["ledger_for_tests"] is True
    assert release.Guarantee.from_json(guarantee.to_json()) == guarantee
    [record] = for_tests.grant_records()
    assert record["steps"]["step"]["guarantee"] == guarantee.sentence()
    # Without a seed, a normal ledger's guarantee says nothing of tests.
    with release.charge(ledger, plan(), BlockIds(["b1"])) as charged:
        assert "tests" not in charged.guarantee(release.GuaranteeUnit.RECORD).sentence()
        charged.released([])
