"""`sage-tfx stream` end to end on a tiny stream with a real SQLite ledger: one grant for the
window, one release per trigger with its guarantee, refusals before the charge, resume without
a second charge."""
import csv
import json
import os

import pandas as pd
import pytest

from sage_tfx.cli import main as sage_tfx
from sage_tfx.sage_access import BlockLedger

from support.private import not_private

JAN, FEB = 1356998400, 1359676800  # 2013-01-01, 2013-02-01 UTC
BLOCKS = "s.2013-01,s.2013-02"


@pytest.fixture
def ledger(store_path):
    BlockLedger.create(store_path)
    ledger = BlockLedger(store_path)
    for block, start, end in (("s.2013-01", "2013-01-01", "2013-02-01"),
                              ("s.2013-02", "2013-02-01", "2013-03-01")):
        ledger.add_block(block, 10.0, 1e-4, f"{start}T00:00:00+00:00", f"{end}T00:00:00+00:00")
    return ledger


def write_stream(path, users=200):
    """Key "busy": every user, every week; key "rare": one user once. Times over 2 months."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "key", "time", "amount"])
        for week in range(8):
            for user in range(users):
                writer.writerow([f"u{user}", "busy", JAN + week * 7 * 86400 + user, 2.0])
        writer.writerow(["u0", "rare", FEB + 5, 1.0])
    return str(path)


def stream(store, out, *extra, input_path=None, micro_batches=4, epsilon=4):
    return sage_tfx(["stream", "--store", store, "--window-blocks", BLOCKS, "--epsilon",
                     str(epsilon),
                     "--delta", "1e-5", "--micro-batches", str(micro_batches), "--out", str(out),
                     *(["--input", input_path] if input_path else []), *extra])


def spent(ledger):
    return [(record["blocks"], record["epsilon"]) for record in ledger.grant_records()]


def test_one_grant_one_release_per_trigger_each_naming_its_guarantee(ledger, store_path,
                                                                      tmp_path, capsys):
    path = write_stream(tmp_path / "stream.csv")
    out = tmp_path / "out"
    assert stream(store_path, out, "--contribution-limit", "8", input_path=path) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    [grant] = ledger.grant_records()
    assert grant["grant_id"] == summary["grant_id"]
    assert sorted(grant["blocks"]) == ["s.2013-01", "s.2013-02"]
    assert summary["guarantee"] == (
        "(4, 1e-05)-DP for adding or removing all rows of one uid within the blocks read "
        "(DP-SQLP on 4 micro-batches: column-normalised BLT square-root factorization with 6 "
        "buffers); "
        f"grant {grant['grant_id']} on blocks s.2013-01, s.2013-02")
    assert grant["outcome"] == "released" and grant["front_door"].startswith("sage-tfx stream")
    for trigger in range(1, 5):
        line = json.loads((out / f"release-{trigger:06d}.json").read_text())
        assert (line["epsilon"], line["delta"], line["grant_id"]) == (4, 1e-5,
                                                                      grant["grant_id"])
        assert line["neighbours"] == "all rows of one uid within the blocks read"
        assert line["blocks"] == ["s.2013-01", "s.2013-02"]
        release = pd.read_csv(out / f"release-{trigger:06d}.csv")
        assert list(release.columns) == ["key", "value", "updated"]
        assert "rare" not in set(release["key"])  # one user's key is not selected
    # 200 users x 8 records, C = 8: all 1,600 records count. At (4, 1e-5), T = 4, C = 8 every
    # micro-batch's 200 distinct users exceed the required count R(l) <= tau_l + 10 std of
    # Z(l) <= 62 + 105, so the key is released at the end with every record (a miss: below
    # 1e-20); the value noise's std is <= 30, so 200 is > 6 std (false failure below 1e-8).
    final = pd.read_csv(out / "release-000004.csv").set_index("key")
    assert abs(final.loc["busy", "value"] - 1600) < 200


def test_a_restart_resumes_without_a_second_charge_and_the_same_releases(ledger, store_path,
                                                                         tmp_path):
    path = write_stream(tmp_path / "stream.csv")
    out = tmp_path / "out"
    assert stream(store_path, out, input_path=path) == 0
    first = {name: (out / name).read_bytes() for name in os.listdir(out)
             if name.startswith("release-")}
    assert stream(store_path, out, input_path=path) == 0
    assert len(ledger.grant_records()) == 1
    assert {name: (out / name).read_bytes() for name in first} == first


def test_a_changed_window_for_the_same_out_is_refused(ledger, store_path, tmp_path, capsys):
    path = write_stream(tmp_path / "stream.csv")
    out = tmp_path / "out"
    assert stream(store_path, out, input_path=path) == 0
    assert stream(store_path, out, input_path=path, micro_batches=5) == 2
    assert "does not pay for this window" in capsys.readouterr().err
    assert len(ledger.grant_records()) == 1


@pytest.mark.parametrize("change, message", [
    (["--unit-column", "user"], "has no column(s) user"),
    (["--value-column", "amount"], "needs --value-bound L"),
    (["--contribution-limit", "0"], "--contribution-limit must be at least 1"),
    (["--key-column", "uid"], "must differ"),
])
def test_bad_input_is_refused_before_the_charge(ledger, store_path, tmp_path, capsys, change,
                                                message):
    path = write_stream(tmp_path / "stream.csv")
    assert stream(store_path, tmp_path / "out", *change, input_path=path) == 2
    assert message in capsys.readouterr().err
    assert ledger.grant_records() == []


def test_a_block_without_a_time_range_or_an_unknown_one_is_refused(ledger, store_path,
                                                                    tmp_path, capsys):
    ledger.add_block("untimed", 1.0, 1e-6)
    path = write_stream(tmp_path / "stream.csv")
    for blocks, message in (("untimed", "without an event-time range"),
                            ("s.2013-01,nope", "unknown block")):
        assert sage_tfx(["stream", "--store", store_path, "--window-blocks", blocks,
                         "--epsilon", "1", "--delta", "1e-6", "--micro-batches", "2",
                         "--input", path, "--out", str(tmp_path / "out")]) == 2
        assert message in capsys.readouterr().err
    assert ledger.grant_records() == []


def test_without_budget_nothing_is_released(ledger, store_path, tmp_path, capsys):
    path = write_stream(tmp_path / "stream.csv")
    code = sage_tfx(["stream", "--store", store_path, "--window-blocks", BLOCKS, "--epsilon",
                     "20", "--delta", "1e-5", "--micro-batches", "2", "--input", path,
                     "--out", str(tmp_path / "out")])
    assert code == 3
    assert not (tmp_path / "out" / "release-000001.csv").exists()
    # The same command again meets the ledger again (not a stranded state directory).
    capsys.readouterr()
    assert stream(store_path, tmp_path / "out", input_path=path, micro_batches=2,
                  epsilon=20) == 3
    assert "denied" in capsys.readouterr().err


def test_a_crash_mid_stream_resumes_with_the_same_releases_and_one_grant(ledger, store_path,
                                                                         tmp_path, monkeypatch):
    from sage_tfx.dp_statistics.continual import release

    path = write_stream(tmp_path / "stream.csv")
    whole, out = tmp_path / "whole", tmp_path / "out"
    written = release.ReleaseSink.__call__

    def crash_at_trigger_3(sink, trigger_release):
        if trigger_release.step == 3:
            raise KeyboardInterrupt  # the process stops between triggers 2 and 3
        written(sink, trigger_release)

    monkeypatch.setattr(release.ReleaseSink, "__call__", crash_at_trigger_3)
    assert stream(store_path, out, input_path=path) == 130
    assert not (out / "release-000003.csv").exists()
    first_two = {n: (out / n).read_bytes() for n in ("release-000001.csv", "release-000002.csv")}
    monkeypatch.setattr(release.ReleaseSink, "__call__", written)
    assert stream(store_path, out, input_path=path) == 0
    assert len(ledger.grant_records()) == 1
    assert {n: (out / n).read_bytes() for n in first_two} == first_two
    assert (out / "release-000004.csv").exists()
    # A fresh window is charged again, by its own grant (the first one is never reused).
    assert stream(store_path, whole, input_path=path) == 0
    assert len(ledger.grant_records()) == 2


def test_without_input_the_window_reads_its_ingested_blocks(store_path, tmp_path, capsys):
    from sage_tfx.dp_statistics.ingest import ingest

    BlockLedger.create(store_path)
    ledger = BlockLedger(store_path)
    path = write_stream(tmp_path / "trips.csv")
    ingest(ledger, path, str(tmp_path / "blocks"), "uid", 10.0, 1e-4, time_column="time",
           period="month", start="2013-01", end="2013-03")
    out = tmp_path / "out"
    assert sage_tfx(["stream", "--store", store_path, "--window-blocks",
                     "trips.2013-01,trips.2013-02", "--epsilon", "4", "--delta", "1e-5",
                     "--micro-batches", "4", "--contribution-limit", "8",
                     "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["guarantee"].endswith("on blocks trips.2013-01, trips.2013-02")
    # Same bound as above: the key is released at the end with all 1,600 records.
    final = pd.read_csv(out / "release-000004.csv").set_index("key")
    assert abs(final.loc["busy", "value"] - 1600) < 200


@pytest.mark.parametrize("flag, column, recorded", [
    ("--unit-column", "key", "uid"), ("--time-column", "amount", "time")])
@pytest.mark.parametrize("with_input", [False, True])
def test_a_tables_unit_and_time_column_are_the_only_ones(store_path, tmp_path, capsys, flag,
                                                          column, recorded, with_input):
    """The table ingest recorded with unit uid: a stream over its blocks cannot release "for
    one key" (nor cut micro-batches by another time), with or without --input; refused with
    nothing charged. Naming the recorded column is fine."""
    from sage_tfx.dp_statistics.ingest import ingest

    BlockLedger.create(store_path)
    ledger = BlockLedger(store_path)
    path = write_stream(tmp_path / "trips.csv")
    ingest(ledger, path, str(tmp_path / "blocks"), "uid", 10.0, 1e-4, time_column="time",
           period="month", start="2013-01", end="2013-03")

    def run(out, value):
        return sage_tfx(["stream", "--store", store_path, "--window-blocks",
                         "trips.2013-01,trips.2013-02", "--epsilon", "4", "--delta", "1e-5",
                         "--micro-batches", "4", "--out", str(out), flag, value,
                         *(["--input", path] if with_input else [])])

    assert run(tmp_path / "other", column) == 2
    error = capsys.readouterr().err
    assert f"{flag} {column}: the window's blocks are table trips's" in error
    assert f"column is {recorded}" in error
    assert ledger.grant_records() == [] and not (tmp_path / "other").exists()
    assert run(tmp_path / "same", recorded) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "one uid within the blocks read" in summary["guarantee"]


def test_the_state_may_live_outside_the_published_directory(ledger, store_path, tmp_path):
    path = write_stream(tmp_path / "stream.csv")
    out, private = tmp_path / "out", tmp_path / "private"
    assert stream(store_path, out, "--state-dir", str(private), input_path=path) == 0
    assert sorted(os.listdir(out)) == ["guarantee.txt"] + sorted(
        f"release-{t:06d}.{kind}" for t in range(1, 5) for kind in ("csv", "json"))
    assert os.stat(private).st_mode & 0o777 == 0o700
    assert os.path.exists(private / "state.npz")
    first = {name: (out / name).read_bytes() for name in os.listdir(out)}
    assert stream(store_path, out, "--state-dir", str(private), input_path=path) == 0
    assert len(ledger.grant_records()) == 1  # resumed from the state: no second charge
    assert {name: (out / name).read_bytes() for name in first} == first


def test_by_default_the_state_lies_beside_the_published_directory_private(
        ledger, store_path, tmp_path, umask_022):
    """The state (its noise key) was DIR/state, inside what is published."""
    path = write_stream(tmp_path / "stream.csv")
    out = tmp_path / "out"
    assert stream(store_path, out, input_path=path) == 0
    assert sorted(os.listdir(out)) == ["guarantee.txt"] + sorted(
        f"release-{t:06d}.{kind}" for t in range(1, 5) for kind in ("csv", "json"))
    state = tmp_path / "out.state"
    assert (state / "state.npz").exists() and not_private(state) == []
    assert stream(store_path, out, input_path=path) == 0
    assert len(ledger.grant_records()) == 1  # resumed from the state beside it


def pins(store_path):
    """{trigger name: (pinned value, MLMD create time in ms)} of every trigger pin."""
    from sage_tfx.sage_access import connect

    return {pin.name.rsplit("/", 1)[-1]: (pin.custom_properties["digest"].string_value,
                                          pin.create_time_since_epoch)
            for pin in connect(store_path).get_artifacts_by_type("sage_tfx.GrantPin")}


def _window_runs(ledger, tmp_path):
    """`run(name, records, through)`: the window run in state directory tmp_path/name, and two
    inputs, the original stream and one with one unit fewer in every micro-batch."""
    from sage_tfx.dp_statistics.continual import sources
    from sage_tfx.dp_statistics.continual.release import run_window
    from sage_tfx.dp_statistics.continual.spec import StreamQuery

    window = sources.window_of_blocks(ledger, BLOCKS.split(","))
    columns = sources.Columns("uid", "key", "time")
    query = StreamQuery(key_column="key", unit_column="uid", time_column="time",
                        value_column=None, value_bound=1.0, contribution_limit=8,
                        micro_batches=4, epsilon=4, delta=1e-5)
    original = sources.read_input(write_stream(tmp_path / "a.csv"), columns, window, 4)
    changed = sources.read_input(write_stream(tmp_path / "b.csv", users=199), columns,
                                 window, 4)

    def run(name, records, through):
        return run_window(ledger, query, window, records, str(tmp_path / name / "state"),
                          str(tmp_path / name / "releases"), consumer="test",
                          through_step=through)
    return run, original, changed


def test_a_trigger_taken_by_one_state_copy_is_refused_from_another_whatever_its_records(
        ledger, tmp_path):
    """The ContinualRelease component copies the last successful state into each run's own
    directory: if run N+1 took trigger 2 and failed, run N+2 (from run N's state) must not
    release trigger 2 again (same keyed noise: from other records the two releases would differ
    by exactly the changed records). The refusal rests on public facts (which copy took the
    trigger), never on the records: with the same records it is refused the same way (it used
    to pass, so refusing only other records told that a late record fell in trigger 2)."""
    import shutil

    from sage_tfx.sage_access.errors import BadRequest

    run, original, changed = _window_runs(ledger, tmp_path)

    run("n", original, 1)
    for name in ("n1", "n2", "n2-same"):
        shutil.copytree(tmp_path / "n", tmp_path / name)
    run("n1", original, 2)  # released trigger 2, then (say) the run failed
    refusals = []
    for name, records in (("n2", changed), ("n2-same", original)):
        with pytest.raises(BadRequest, match="trigger-2 of grant .* is pinned to another value"
                           ) as refused:
            run(name, records, 2)
        refusals.append(str(refused.value))
        assert not (tmp_path / name / "releases" / "release-000002.csv").exists()
    assert refusals[0] == refusals[1]
    run("n1", changed, 3)  # the copy that took trigger 2 goes on (its late records dropped)
    assert len(ledger.grant_records()) == 1
    assert not ledger.audit().problems  # the pins are consistent with the ledger's history


def test_a_copy_of_a_state_that_drew_its_pin_tokens_cannot_take_a_trigger_twice(
        ledger, tmp_path):
    """`sage-tfx stream` draws the tokens of all its triggers before computing any: a copy of a
    state that crashed after that carries the tokens, yet pins another value (the pin is bound
    to the state directory), so two copies never release the same trigger from other records."""
    import shutil

    from sage_tfx.dp_statistics.continual.state import pin_tokens
    from sage_tfx.sage_access.errors import BadRequest

    run, original, changed = _window_runs(ledger, tmp_path)

    run("n", original, 1)
    pin_tokens(str(tmp_path / "n" / "state"), range(2, 5))  # what a whole-window run draws
    for name in ("copy1", "copy2"):
        shutil.copytree(tmp_path / "n", tmp_path / name)
    run("copy1", original, 2)
    with pytest.raises(BadRequest, match="trigger-2 of grant .* is pinned to another value"):
        run("copy2", changed, 2)
    assert not (tmp_path / "copy2" / "releases" / "release-000002.csv").exists()


def test_pins_tell_nothing_about_the_micro_batches(ledger, store_path, tmp_path, monkeypatch):
    """Every pin a reader of ML Metadata sees is data-independent: its value is not equal for
    equal (e.g. empty) micro-batches, and every trigger is pinned before the first one is
    computed, so the pins' creation times do not follow the data-dependent compute time (pinned
    one by one, trigger t's pin came after computing micro-batches 1..t-1)."""
    import time

    from sage_tfx.dp_statistics.continual import local

    path = tmp_path / "stream.csv"
    with open(path, "w", newline="") as handle:  # records in micro-batch 1 only: 2-4 empty
        writer = csv.writer(handle)
        writer.writerow(["uid", "key", "time"])
        writer.writerows([f"u{user}", "busy", JAN + user] for user in range(50))
    first_step = []
    real_step = local.operator.step

    def slow_step(state, budget, batch):
        first_step.append(first_step[0] if first_step else time.time() * 1000)
        time.sleep(0.05)  # a trigger's compute time (data-dependent in general)
        return real_step(state, budget, batch)

    monkeypatch.setattr(local.operator, "step", slow_step)
    assert stream(store_path, tmp_path / "out", input_path=str(path)) == 0
    pinned = pins(store_path)
    assert sorted(pinned) == [f"trigger-{t}" for t in range(1, 5)]
    values = [value for value, _ in pinned.values()]
    assert len(set(values)) == 4 and all(len(value) == 64 for value in values)
    assert max(created for _, created in pinned.values()) <= first_step[0]


def test_every_release_lists_its_keys_in_key_order(ledger, store_path, tmp_path):
    """Not in the order keys first appeared: key "zeta" appears in the first week, "alpha" in
    the second (a neighbouring stream could swap which comes first)."""
    path = tmp_path / "stream.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["uid", "key", "time"])
        for week in range(8):
            for user in range(200):
                for key, offset in (("zeta", 0), ("alpha", 7 * 86400)):
                    writer.writerow([f"u{user}", key, JAN + week * 7 * 86400 + offset + user])
    out = tmp_path / "out"
    assert stream(store_path, out, "--contribution-limit", "16", input_path=str(path)) == 0
    # As in the first test, a key with 200 users a week is released at every trigger (a miss:
    # below 1e-20).
    for trigger in range(1, 5):
        release = pd.read_csv(out / f"release-{trigger:06d}.csv")
        assert list(release["key"]) == ["alpha", "zeta"], trigger


@pytest.mark.parametrize("for_tests", [False, True])
def test_every_trigger_states_the_guarantee_the_ledger_records(store_path, tmp_path, capsys,
                                                               for_tests):
    """Each release-T.json states the window's guarantee as the ledger records it: on a ledger
    created for tests, that the guarantee then does not hold for noise a fixed seed drew."""
    BlockLedger.create(store_path, for_tests=for_tests)
    ledger = BlockLedger(store_path)
    for block, start, end in (("s.2013-01", "2013-01-01", "2013-02-01"),
                              ("s.2013-02", "2013-02-01", "2013-03-01")):
        ledger.add_block(block, 10.0, 1e-4, f"{start}T00:00:00+00:00", f"{end}T00:00:00+00:00")
    out = tmp_path / "out"
    assert stream(store_path, out, "--contribution-limit", "8",
                  input_path=write_stream(tmp_path / "stream.csv")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    [grant] = ledger.grant_records()
    recorded = grant["steps"]["continual_release"]["guarantee"]
    assert ("ledger created for tests" in recorded) is for_tests
    assert summary["guarantee"] == recorded
    for trigger in range(1, 5):
        line = json.loads((out / f"release-{trigger:06d}.json").read_text())
        assert line["ledger_for_tests"] is for_tests
        assert line["guarantee"] == recorded
