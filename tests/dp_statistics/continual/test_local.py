"""The in-process engine's durability: a crash or a restart resumes with no micro-batch counted
twice, no release rewritten with other numbers and no second charge."""
import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zipfile

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from sage_tfx.dp_statistics.continual import local
from sage_tfx.dp_statistics.continual import state as state_module
from sage_tfx.dp_statistics.continual.budget import plan
from sage_tfx.dp_statistics.continual.state import StreamStateError, WindowState
from sage_tfx.sage_access import BlockLedger, BudgetExhausted
from support import STREAM_WORKER, stream_worker as worker

NOISE_KEY = bytes(range(32))


def releases(directory):
    """{file name: bytes} of every release file."""
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory)) if name.startswith("release-")}


def uninterrupted(tmp_path, budget=None):
    out = tmp_path / "oracle-out"
    state = local.run_local(worker.QUERY, budget or worker.budget(), worker.stream(),
                            str(tmp_path / "oracle-state"), local.CsvDirectorySink(str(out)),
                            noise_key=NOISE_KEY)
    return releases(out), state


def assert_same_state(resumed: WindowState, oracle: WindowState):
    """Same counts everywhere: nothing was counted twice or lost."""
    assert resumed.step == oracle.step
    assert np.array_equal(resumed.used[:len(resumed.units)], oracle.used[:len(oracle.units)])
    for name in ("count", "round", "buffer", "released_true", "released_value", "due"):
        assert np.array_equal(resumed.column(name), oracle.column(name), equal_nan=True), name
    assert sorted(zip(*[a.tolist() for a in resumed.pairs.to_arrays()])) == sorted(
        zip(*[a.tolist() for a in oracle.pairs.to_arrays()]))


class RaisingSink(local.CsvDirectorySink):
    """Dies (like a crash) when asked to write step `fail_at`: pending stays on disk."""

    def __init__(self, directory, fail_at):
        super().__init__(directory)
        self.fail_at = fail_at

    def __call__(self, release):
        if release.step == self.fail_at:
            raise KeyboardInterrupt("crash while releasing")
        super().__call__(release)


def changed(stream, at_step):
    for step, frame in stream:
        if step == at_step:
            frame = frame.copy()
            frame.loc[0, "value"] += 1.0
        yield step, frame


@pytest.mark.parametrize("mechanism", ["tree", "factorization"])
def test_records_for_a_taken_micro_batch_are_late_and_dropped_without_a_word(tmp_path,
                                                                             mechanism):
    """A restart never tells where its input changed: records it brings for a micro-batch the
    state already took (step 9 committed, step 10 taken when the process died) are late data,
    dropped; the releases stay the published ones, recomputed bit for bit from the micro-batches
    that were taken. (It used to refuse "micro-batch 10 changed after it may have been
    released", which told where the late record fell.) Both mechanisms: the factorization's
    keyed noise recomputes bit for bit from its stored buffer states too."""
    budget = worker.budget(mechanism)
    oracle, oracle_state = uninterrupted(tmp_path, budget)
    state_dir, out = str(tmp_path / "state"), str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        local.run_local(worker.QUERY, budget, worker.stream(), state_dir,
                        RaisingSink(out, fail_at=10), noise_key=NOISE_KEY, snapshot_every=4)
    assert WindowState.load(state_dir).step == 8  # step 9 is recomputed, not skipped
    late = changed(changed(worker.stream(), 9), 10)
    resumed = local.run_local(worker.QUERY, budget, late, state_dir,
                              local.CsvDirectorySink(out), noise_key=NOISE_KEY,
                              snapshot_every=4)
    assert releases(out) == oracle
    assert_same_state(resumed, oracle_state)


def test_a_state_directory_of_another_query_is_refused(tmp_path):
    state_dir = str(tmp_path / "state")
    local.run_local(worker.QUERY, worker.budget(), [], state_dir, lambda release: None,
                    complete_window=False)
    other = worker.QUERY.__class__(**{**worker.QUERY.to_json(), "contribution_limit": 5})
    budget = plan(other.epsilon, other.delta, other.micro_batches, 5, other.value_bound)
    with pytest.raises(StreamStateError, match="another window query"):
        local.run_local(other, budget, [], state_dir, lambda release: None)


def wait_for(path, process, timeout_s=120):
    start = time.monotonic()
    while not os.path.exists(path):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() - start < timeout_s, f"{path} never appeared"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_killed_stream_resumes_to_the_uninterrupted_releases_charged_once(tmp_path):
    oracle, oracle_state = uninterrupted(tmp_path)
    store = str(tmp_path / "ledger.sqlite")
    ledger = BlockLedger.create(store)
    for block in worker.BLOCKS:
        ledger.add_block(block, 10.0, 1e-4)
    state_dir, out = str(tmp_path / "state"), str(tmp_path / "out")
    command = [sys.executable, STREAM_WORKER, store, state_dir, out, NOISE_KEY.hex()]
    # Killed as soon as release 6 is written: after the save at step 4 and before the next
    # (step 8), so the restart loads step 4 and recomputes the committed steps after it.
    first = subprocess.Popen(command + ["0.15"], stderr=subprocess.PIPE)
    wait_for(os.path.join(out, "release-000006.csv"), first)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    journal = [json.loads(line) for line in open(os.path.join(state_dir, "journal.jsonl"))
               if line.endswith("\n")]
    assert journal[0] == {"snapshot": 4} and any("commit" in line for line in journal[1:])
    before_restart = releases(out)
    assert 6 <= len(before_restart) < 16  # killed mid-stream
    second = subprocess.run(command + ["0"], stderr=subprocess.PIPE, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    after = releases(out)
    # No release rewritten with other numbers, and the whole window equals the oracle's bits.
    assert {name: after[name] for name in before_restart} == before_restart
    assert after == oracle
    assert_same_state(WindowState.load(state_dir), oracle_state)
    grants = ledger.grant_records()
    assert len(grants) == 1 and sorted(grants[0]["blocks"]) == list(worker.BLOCKS)
    assert WindowState.load(state_dir).grant_id == grants[0]["grant_id"]
    assert ledger.audit().problems == []


def test_every_trigger_runs_even_without_records_and_a_restart_never_charges_again(tmp_path):
    state_dir, steps, charges = str(tmp_path / "state"), [], []

    def charge():
        charges.append(1)
        return "grant-1", ["w1"]
    stream = [(step, frame) for step, frame in worker.stream() if step in (2, 5)]
    local.run_local(worker.QUERY, worker.budget(), stream, state_dir,
                    lambda release: steps.append(release.step), charge=charge,
                    complete_window=False)
    assert steps == [1, 2, 3, 4, 5] and charges == [1]
    state = local.run_local(worker.QUERY, worker.budget(), stream, state_dir,
                            lambda release: steps.append(release.step), charge=charge)
    assert steps == list(range(1, 17)) and charges == [1]
    assert state.grant_id == "grant-1" and "grant grant-1 on blocks w1" in \
        state.query.guarantee(state.blocks, state.grant_id).sentence()


def test_a_run_that_died_while_charging_refuses_to_charge_again(tmp_path):
    state_dir = str(tmp_path / "state")

    def dying_charge():
        raise KeyboardInterrupt("killed while the ledger committed the grant")
    with pytest.raises(KeyboardInterrupt):
        local.run_local(worker.QUERY, worker.budget(), worker.stream(), state_dir,
                        lambda release: None, charge=dying_charge)
    with pytest.raises(StreamStateError, match="may be charged"):
        local.run_local(worker.QUERY, worker.budget(), worker.stream(), state_dir,
                        lambda release: None, charge=lambda: ("grant-2", ["w1"]))


def test_a_grant_the_ledger_refused_charged_nothing_and_the_window_can_try_again(tmp_path):
    state_dir = str(tmp_path / "state")
    ledger = BlockLedger.create(str(tmp_path / "ledger.sqlite"))
    ledger.add_block("w1", 1.0, 1e-4)  # cannot pay epsilon 8
    ledger.add_block("w2", 10.0, 1e-4)
    with pytest.raises(BudgetExhausted):
        local.run_local(worker.QUERY, worker.budget(), worker.stream(), state_dir,
                        lambda release: None, charge=worker.charge(ledger, worker.budget()))
    assert ledger.grant_records() == []
    state = local.run_local(worker.QUERY, worker.budget(), worker.stream(), state_dir,
                            lambda release: None, charge=lambda: ("grant-3", ["w2"]))
    assert state.grant_id == "grant-3"


def test_a_reloaded_state_keeps_every_unit_id_exactly_and_its_contribution_used(tmp_path):
    """A unit id with a trailing NUL stays that unit after the state is saved and loaded: it
    cannot start over with a fresh contribution budget on resume (the ContinualRelease
    component loads the state every run)."""
    query = dataclasses.replace(worker.QUERY, micro_batches=2, contribution_limit=2)
    budget = plan(query.epsilon, query.delta, 2, 2, query.value_bound)
    state_dir = str(tmp_path / "state")
    first = pd.DataFrame({"unit": ["a\x00", "a\x00", "b"], "key": ["k", "k", "k"],
                          "value": [1.0, 1.0, 1.0]})
    local.run_local(query, budget, [(1, first)], state_dir, lambda release: None,
                    complete_window=False, noise_key=bytes(32), snapshot_every=1)
    state = WindowState.load(state_dir)
    assert list(state.units.values) == ["a\x00", "b"]
    assert list(state.used[:2]) == [2, 1]
    # The unit's third record (in step 2) is over C = 2: nothing more is counted for it.
    later = pd.DataFrame({"unit": ["a\x00"], "key": ["k"], "value": [1.0]})
    state = local.run_local(query, budget, [(2, later)], state_dir, lambda release: None,
                            noise_key=bytes(32))
    assert list(state.units.values) == ["a\x00", "b"] and list(state.used[:2]) == [2, 1]
    assert state.column("buffer").sum() + state.column("released_true").sum() == 3.0


def test_the_state_and_its_taken_micro_batches_are_private(tmp_path):
    """Beside public releases the state (and the micro-batch it keeps for a step after its last
    save) must not be readable by others."""
    query = dataclasses.replace(worker.QUERY, micro_batches=2)
    budget = plan(query.epsilon, query.delta, 2, query.contribution_limit, query.value_bound)
    state_dir = tmp_path / "state"
    local.run_local(query, budget, [(1, local.empty_batch())], str(state_dir),
                    lambda release: None, noise_key=bytes(32), snapshot_every=2,
                    complete_window=False)  # step 1 stays in the journal
    assert (state_dir / "taken.log").stat().st_size > 0
    assert os.stat(state_dir).st_mode & 0o777 == 0o700
    for file in os.listdir(state_dir):
        assert os.stat(state_dir / file).st_mode & 0o777 == 0o600, file


def test_the_state_is_saved_on_a_public_schedule_whatever_the_records(tmp_path):
    """Where the state was last saved is shown (a resumed run's progress bar starts there), so
    it must be the same for neighbouring streams: every ceil(T / 16) steps, here 2 of 32."""
    query = dataclasses.replace(worker.QUERY, micro_batches=32)
    budget = plan(query.epsilon, query.delta, 32, query.contribution_limit, query.value_bound)
    few = [(step, pd.DataFrame({"unit": [f"new{step}"], "key": ["k"], "value": [1.0]}))
           for step in range(1, 6)]
    many = [(step, pd.DataFrame({"unit": ["same"] * 50, "key": ["k"] * 50,
                                 "value": [1.0] * 50})) for step in range(1, 6)]
    for name, batches in (("few", few), ("many", many)):
        local.run_local(query, budget, batches, str(tmp_path / name), lambda release: None,
                        noise_key=bytes(32), complete_window=False)
        assert WindowState.load(str(tmp_path / name)).step == 4, name


def test_a_torn_last_journal_line_is_ignored(tmp_path):
    oracle, _ = uninterrupted(tmp_path)
    state_dir, out = str(tmp_path / "state"), str(tmp_path / "out")
    stream = [(step, frame) for step, frame in worker.stream() if step <= 6]
    local.run_local(worker.QUERY, worker.budget(), stream, state_dir,
                    local.CsvDirectorySink(out), noise_key=NOISE_KEY, complete_window=False)
    with open(os.path.join(state_dir, "journal.jsonl"), "a") as journal:
        journal.write('{"commit": 7')  # the process died inside this write
    local.run_local(worker.QUERY, worker.budget(), worker.stream(), state_dir,
                    local.CsvDirectorySink(out), noise_key=NOISE_KEY)
    assert releases(out) == oracle


def test_a_torn_taken_entry_is_cut_and_its_step_taken_again(tmp_path):
    """The process died inside take(step 10): the log's last entry does not check, and step 10
    was never computed nor released. The restart cuts the entry, takes step 10 from its input
    (here other records: the torn entry is not a taken micro-batch) and the whole window equals
    the uninterrupted one on those records."""
    late = [(step, pd.concat([frame, frame.assign(unit=frame["unit"] + 10 ** 6)])
             if step == 10 else frame) for step, frame in worker.stream()]
    oracle_out = tmp_path / "oracle-out"
    oracle_state = local.run_local(worker.QUERY, worker.budget(), late,
                                   str(tmp_path / "oracle-state"),
                                   local.CsvDirectorySink(str(oracle_out)), noise_key=NOISE_KEY)
    state_dir, out = str(tmp_path / "state"), str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):  # step 10 taken, its release never written
        local.run_local(worker.QUERY, worker.budget(), worker.stream(), state_dir,
                        RaisingSink(out, fail_at=10), noise_key=NOISE_KEY, snapshot_every=4)
    log = os.path.join(state_dir, "taken.log")
    data = bytearray(open(log, "rb").read())
    # The save at step 8 wrote the log afresh: steps 9 and 10, then only the zeros it was
    # extended with (the log is (magic, step, length, CRC-32) headers and payloads). Nothing
    # of earlier entries is left behind them: those bytes hold records, which could read as a
    # well-formed entry for a later step.
    _, step, length, _ = struct.unpack_from("<4sqqI", data, 0)
    assert step == 9
    last = 24 + length
    _, step, length, _ = struct.unpack_from("<4sqqI", data, last)
    assert step == 10
    assert not any(data[last + 24 + length:])
    middle = last + 24 + length // 2
    data[middle:middle + 16] = bytes(16)  # its payload only partly written
    open(log, "wb").write(bytes(data))
    resumed = local.run_local(worker.QUERY, worker.budget(), late, state_dir,
                              local.CsvDirectorySink(out), noise_key=NOISE_KEY,
                              snapshot_every=4)
    assert releases(out) == releases(oracle_out)
    assert_same_state(resumed, oracle_state)
    assert releases(out) != uninterrupted(tmp_path / "unchanged")[0]  # step 10: new input


def test_a_released_step_whose_taken_micro_batch_is_gone_is_refused(tmp_path):
    state_dir = str(tmp_path / "state")
    stream = [(step, frame) for step, frame in worker.stream() if step <= 6]
    local.run_local(worker.QUERY, worker.budget(), stream, state_dir, lambda release: None,
                    noise_key=NOISE_KEY, complete_window=False, snapshot_every=4)
    os.truncate(os.path.join(state_dir, "taken.log"), 0)
    with pytest.raises(StreamStateError, match="step 5 was released but the micro-batch"):
        local.run_local(worker.QUERY, worker.budget(), worker.stream(), state_dir,
                        lambda release: None, noise_key=NOISE_KEY, snapshot_every=4)


def test_a_state_of_the_previous_format_is_refused_by_name(tmp_path, monkeypatch):
    """Format 4 stored the selection streams' summaries, which this version recomputes on
    load and does not find in a format-5 file (nor reads from a format-4 one): resuming such a
    directory must say so, not fail on a missing array."""
    state_dir = str(tmp_path / "state")
    local.run_local(worker.QUERY, worker.budget(), [], state_dir, lambda release: None,
                    complete_window=False)
    state = WindowState.load(state_dir)
    with monkeypatch.context() as patched:
        patched.setattr("sage_tfx.dp_statistics.continual.state._FORMAT", 5)
        state.save(state_dir)
    with pytest.raises(StreamStateError, match="state format 5; this version reads format 6"):
        WindowState.load(state_dir)


@pytest.mark.parametrize("mechanism", ["tree", "factorization"])
def test_a_crash_inside_a_group_taken_ahead_resumes_to_the_uninterrupted_releases(tmp_path,
                                                                                  mechanism):
    """With take_ahead 6 the run takes steps 7-12 with one sync, then dies releasing step 10:
    steps 10-12 are taken, not released. The restart computes them from what was taken (the
    input's records for them are late, dropped) and the window equals the uninterrupted one."""
    budget = worker.budget(mechanism)
    oracle, oracle_state = uninterrupted(tmp_path, budget)
    state_dir, out = str(tmp_path / "state"), str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        local.run_local(worker.QUERY, budget, worker.stream(), state_dir,
                        RaisingSink(out, fail_at=10), noise_key=NOISE_KEY, snapshot_every=4,
                        take_ahead=6)
    log = open(os.path.join(state_dir, "taken.log"), "rb").read()
    taken, offset = [], 0
    while offset + 24 <= len(log) and log[offset:offset + 4] == b"TKN1":
        _, step, length, _ = struct.unpack_from("<4sqqI", log, offset)
        taken.append(step)
        offset += 24 + length
    assert taken == [9, 10, 11, 12]  # the save at step 8 kept the steps after it
    late = changed(changed(worker.stream(), 11), 12)
    resumed = local.run_local(worker.QUERY, budget, late, state_dir,
                              local.CsvDirectorySink(out), noise_key=NOISE_KEY,
                              snapshot_every=4, take_ahead=6)
    assert releases(out) == oracle
    assert_same_state(resumed, oracle_state)


def test_a_crash_after_a_save_was_written_and_before_the_journal_caught_up(tmp_path,
                                                                          monkeypatch):
    """Saves are written by a thread while later steps run (local._OverlappedSaves): the state
    at step 4 is on the disk, the journal still starts at step 0 and has committed steps 5-8
    when the process dies. The restart loads step 4, recomputes 5-8 from what they took
    without releasing them again, and releases 9-16: the window equals the uninterrupted one.
    (Without the journal's commits after its snapshot, steps 5-8 were released twice.)"""
    oracle, oracle_state = uninterrupted(tmp_path)
    state_dir, out = str(tmp_path / "state"), str(tmp_path / "out")

    def died(journal, step):
        raise KeyboardInterrupt("killed before the journal caught up with the save")
    with monkeypatch.context() as patched:
        patched.setattr(local._OverlappedSaves, "catch_up", lambda saves: None)
        patched.setattr(state_module.Journal, "saved", died)
        with pytest.raises(KeyboardInterrupt):  # at the save of step 8, waiting for step 4's
            local.run_local(worker.QUERY, worker.budget(), worker.stream(), state_dir,
                            local.CsvDirectorySink(out), noise_key=NOISE_KEY, snapshot_every=4)
    journal = [json.loads(line) for line in open(os.path.join(state_dir, "journal.jsonl"))]
    assert WindowState.load(state_dir).step == 4 and journal[0] == {"snapshot": 0}
    assert journal[-1] == {"commit": 8}
    written = []

    def sink(release):
        written.append(release.step)
        local.CsvDirectorySink(out)(release)
    resumed = local.run_local(worker.QUERY, worker.budget(), worker.stream(), state_dir, sink,
                              noise_key=NOISE_KEY, snapshot_every=4)
    assert written == list(range(9, 17))
    assert releases(out) == oracle
    assert_same_state(resumed, oracle_state)


@pytest.mark.parametrize("mechanism", ["tree", "factorization"])
def test_a_loaded_state_recomputes_the_live_selection_streams_bit_for_bit(tmp_path, mechanism):
    """The saved state leaves the selection streams' summaries out (format 5): loading
    recomputes them for every key's live round, and they equal the ones the run computed."""
    state_dir = str(tmp_path / "state")
    stream = [(step, frame) for step, frame in worker.stream() if step <= 11]
    ran = local.run_local(worker.QUERY, worker.budget(mechanism), stream, state_dir,
                          lambda release: None, noise_key=NOISE_KEY, complete_window=False,
                          snapshot_every=1)
    loaded = WindowState.load(state_dir)
    live = ran.column("selection_row")
    live = live[live >= 0]
    assert len(live) and ran.selection.size > len(live)  # some rounds ended
    for name in ("tree_ids", "lengths", "bases", "minima"):
        assert np.array_equal(getattr(loaded.selection, name)[live],
                              getattr(ran.selection, name)[live], equal_nan=True), name


@pytest.mark.parametrize("frame", [
    pd.DataFrame({"unit": np.arange(5), "key": np.arange(5, dtype=np.uint32),
                  "value": [1.5, np.nan, -np.inf, 0.0, -0.0]}),
    pd.DataFrame({"unit": np.array([True, False]), "key": np.array([1.0, np.nan], np.float32)},
                 index=[7, 3]),
    pd.DataFrame({"unit": ["a", None], "key": [1, 2], "value": [np.nan, 1.0]}),
    pd.DataFrame({"unit": pd.array([1, None], dtype="Int64"), "key": [1, 2]}),
    local.empty_batch()], ids=["numeric", "bool-float32", "strings", "nullable", "empty"])
def test_a_taken_micro_batch_reads_back_as_table_from_pandas_would(frame):
    """The journal converts numeric frames to Arrow itself (faster); a recomputed step must see
    exactly the frame the earlier pandas conversion gave back."""
    def read(payload):
        return pa.ipc.open_stream(payload).read_all().to_pandas()
    sink = pa.BufferOutputStream()
    table = pa.Table.from_pandas(frame, preserve_index=False)
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    pd.testing.assert_frame_equal(read(state_module._ipc_payload(frame)),
                                  read(sink.getvalue().to_pybytes()), check_exact=True)


def test_the_state_file_is_what_np_savez_writes(tmp_path):
    """state._write_npz writes np.savez's bytes without its copies: the same members, headers
    and data, for every kind of array a state holds (empty 2-d ones included, as a window's
    value index before its first release)."""
    arrays = {"meta": np.frombuffer(b'{"format": 6}', np.uint8), "flags": np.array([True, False]),
              "empty": np.zeros((0, 8)), "rows": np.arange(12.0).reshape(3, 4)[:, ::2],
              "codes": np.arange(5, dtype=np.int64) << 40, "rounds": np.ones(3, np.int32),
              "scalar": np.array(3.5)}
    with open(tmp_path / "ours.npz", "wb") as out:
        state_module._write_npz(out, arrays)
    np.savez(tmp_path / "numpy.npz", **arrays)
    with zipfile.ZipFile(tmp_path / "ours.npz") as ours, \
            zipfile.ZipFile(tmp_path / "numpy.npz") as theirs:
        assert ours.namelist() == theirs.namelist()
        for name in ours.namelist():
            assert ours.read(name) == theirs.read(name), name


@pytest.mark.parametrize("values", [
    [5, -3, 2 ** 62, 0, -(2 ** 62), 17, 4.0, 9],  # integers (an integral float among them)
    ["b", "a", "é", "B", "", "ab"]])
def test_a_code_table_sorts_its_values_as_pandas_does(values):
    """The release's key order (operator.step) comes from CodeTable.sort_order: for an integer
    table by int64, for any other by pandas, the order pd.Index(values).argsort() gives."""
    table = state_module.CodeTable()
    codes = table.encode(np.array(values, dtype=object))
    chosen = codes[[6, 1, 3, 0, 4]] if len(values) > 6 else codes[[5, 1, 3, 0, 4]]
    expected = np.asarray(pd.Index(table.values[chosen]).argsort(), dtype=np.int64)
    assert table.sort_order(chosen).tolist() == expected.tolist()


def test_the_state_writer_refuses_python_objects(tmp_path):
    """np.savez would pickle an object array; the writer would write its pointers: refused,
    naming the array."""
    with open(tmp_path / "state.npz", "wb") as out, \
            pytest.raises(ValueError, match="'keys' holds Python objects"):
        state_module._write_npz(out, {"keys": np.array(["a", 1], dtype=object)})
