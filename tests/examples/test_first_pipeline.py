"""The README's plain-Pipeline example (examples/first_pipeline.py) runs on LocalDagRunner, shows
its outcome, and re-running the same DAG on the same files fails with an error that says why and
how to fix it."""
import os
import re
import subprocess
import sys

import pytest

from sage_tfx.sage_access import BlockLedger, connect

from support.ingest import write_csv


@pytest.mark.slow
def test_first_pipeline_runs_and_a_rerun_explains_immutable_blocks(tmp_path):
    """Run as a user would (`python -m sage_tfx.examples.first_pipeline`): the outcome is shown
    by default, TFX's repeated warnings are not, and nothing printed is a non-DP number."""
    workdir, data = str(tmp_path / "run"), str(tmp_path / "data")
    write_csv(data, trips_per_month=40)
    os.makedirs(workdir)
    store = os.path.join(workdir, "metadata.sqlite")
    BlockLedger.create(store, min_request_epsilon=0.05)  # the ledger comes first
    command = [sys.executable, "-m", "sage_tfx.examples.first_pipeline", "--data-root", data,
               "--workdir", workdir, "--first-month", "2024-01", "--last-month", "2024-03"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]

    shown = [line for line in first.stderr.splitlines() if line.startswith("sage-tfx: ")]
    # Without a terminal the step progress is a line per quarter of the (public) step count.
    progress = [line for line in shown if line.startswith("sage-tfx: DPTrainer DP-SGD, ")]
    # (The step count follows from the sampler's DP count of the records, so it varies.)
    assert re.fullmatch(r"sage-tfx: DPTrainer DP-SGD, 2 epoch\(s\): (\d+)/\1 steps", progress[-1])
    shown = [line for line in shown if line not in progress]
    assert shown[0].startswith("sage-tfx: BlockLedger: grant ")
    assert "(1.0, 1e-07) on 2024-03, 2024-02" in shown[0]
    assert "sage-tfx: DPTrainer epoch 1/2: epsilon spent" in shown[2]
    assert shown[3].endswith("epsilon spent 0.8 of 0.8")  # the training share of 1.0
    validator = shown[4]
    assert validator.startswith("sage-tfx: SLAedValidator: ") and " in [" in validator
    assert "property_predicate" not in first.stderr and "AutoGraph" not in first.stderr
    # The only loss printed is the validator's DP estimate (DP-SGD's training loss is not DP);
    # the validator's statement of its guarantee names the loss, and holds no number of it.
    guarantee = "sage-tfx: SLAedValidator: guarantee of "
    lines = first.stderr.splitlines()
    assert [line for line in lines if line.startswith(guarantee)] != []
    assert [line for line in lines if "loss" in line and not line.startswith(guarantee)] == \
        [validator]

    ledger = BlockLedger(store)
    assert [round(b.spent[0], 9) for b in ledger.blocks()] == [0.0, 1.0, 1.0]
    [grant] = ledger.grant_records()
    assert grant["pipeline"] == "first" and grant["blocks"] == ["2024-03", "2024-02"]
    [blessing] = connect(store).get_artifacts_by_type("ModelBlessing")
    outcome = blessing.custom_properties["outcome"].string_value
    assert outcome in validator
    assert os.path.isdir(os.path.join(workdir, "serving")) == (outcome == "ACCEPT")

    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode != 0
    assert "immutable once registered" in again.stderr and "new input directory" in again.stderr
    assert len(BlockLedger(store).grant_records()) == 1  # the failed run charged nothing


def test_a_date_string_block_key_is_read_as_an_iso_date():
    import tensorflow as tf

    from sage_tfx.components.block_example_gen.executor import _key_value

    def key_of(feature_value):
        example = tf.train.Example()
        feature = example.features.feature["trip_start_timestamp"]
        if isinstance(feature_value, bytes):
            feature.bytes_list.value.append(feature_value)
        else:
            feature.int64_list.value.append(feature_value)
        return _key_value(example, "trip_start_timestamp")

    assert key_of(1704067200) == 1704067200
    assert key_of(b"2024-01-01") == 1704067200  # a date without a zone is UTC
    assert key_of(b"2024-01-01T01:00:00+01:00") == 1704067200
    assert key_of(b"last tuesday") is None  # dropped, never an error that depends on a record


# A user's copy of the example run as a script: it imports TFX's Pusher before sage_tfx, so
# TensorFlow has chosen Keras 3 before sage_tfx could ask for Keras 2.
TFX_FIRST = """
import os, sys
os.environ.pop("TF_USE_LEGACY_KERAS", None)
from tfx.components.pusher.component import Pusher  # TensorFlow picks Keras 3 here
from sage_tfx.examples import first_pipeline
sys.exit(first_pipeline.main())
"""


@pytest.mark.slow
def test_a_pipeline_that_imports_tfx_first_is_refused_before_the_charge(tmp_path):
    """Issue 29 item 9: DPTrainer needs Keras 2, which this process cannot have; the grant's
    preflight refuses before anything is charged, in one line that says how to fix it. The
    re-run (blocks already registered) is one line too, naming the blocks and what to do."""
    workdir, data = str(tmp_path / "run"), str(tmp_path / "data")
    write_csv(data, trips_per_month=40)
    os.makedirs(workdir)
    store = os.path.join(workdir, "metadata.sqlite")
    BlockLedger.create(store, min_request_epsilon=0.05)
    command = [sys.executable, "-c", TFX_FIRST, "--data-root", data, "--workdir", workdir,
               "--first-month", "2024-01", "--last-month", "2024-03"]

    def ours(stderr):  # TFX logs "Execution N failed" itself; no traceback follows
        assert "Traceback" not in stderr
        return [line for line in stderr.splitlines() if line.startswith("first_pipeline: ")]

    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 2, first.stderr[-3000:]
    [refusal] = ours(first.stderr)
    assert ("refused before the charge (nothing was charged): DPTrainer: DP-SGD needs Keras 2"
            in refusal)
    assert "Import sage_tfx before tfx" in refusal and "TF_USE_LEGACY_KERAS=1" in refusal
    ledger = BlockLedger(store)
    assert [b.block_id for b in ledger.blocks()] == ["2024-01", "2024-02", "2024-03"]
    assert [tuple(b.spent) for b in ledger.blocks()] == [(0.0, 0.0)] * 3
    assert ledger.grant_records() == []

    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2, again.stderr[-3000:]
    [refusal] = ours(again.stderr)
    assert "already has block(s) ['2024-01', '2024-02', '2024-03']" in refusal
    assert "immutable once registered" in refusal and "without BlockExampleGen" in refusal
    assert BlockLedger(store).grant_records() == []
