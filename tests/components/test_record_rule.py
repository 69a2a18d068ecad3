"""The record rule: a record's bad content (NaN, infinity, a missing or malformed feature) becomes
a public default before any DP component bounds it, so it cannot make a run raise after its
grant was charged, nor turn a release into NaN."""

import numpy as np
import pytest
import tensorflow as tf

from sage_tfx.components.dp_trainer.adassp import adassp
from sage_tfx.components.util.user_module import RecordDecoder, UserModule
from sage_tfx.components.record_rule import (RecordRuleError, finite, sanitise_record,
                                             sanitise_records)
from sage_tfx.validators.executor import per_example_metric
from sage_tfx.validators.slaed import loss_validator

from support import TRIP_MODULE

SPEC = {"trip_miles": tf.io.FixedLenFeature([1], tf.float32),
        "trip_seconds": tf.io.FixedLenFeature([1], tf.int64)}


def trip(**features) -> bytes:
    """A serialized tf.Example; a float list for floats, an int64 list for ints."""
    feature = {}
    for name, values in features.items():
        if all(isinstance(v, int) for v in values):
            feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        else:
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def parsed(record: bytes, spec=SPEC) -> dict:
    return {name: value.numpy().tolist()
            for name, value in tf.io.parse_single_example(record, spec).items()}


GOOD = trip(trip_miles=[2.5], trip_seconds=[600])
BAD = [trip(trip_miles=[float("nan")], trip_seconds=[600]),
       trip(trip_miles=[float("inf")], trip_seconds=[600]),
       trip(trip_seconds=[600]),                                # trip_miles missing
       trip(trip_miles=[1.0, 2.0], trip_seconds=[600]),         # two values for a [1] feature
       trip(trip_miles=[2.5], trip_seconds=[600.5]),            # a float for an int64 feature
       b"\xff\x00 not a tf.Example"]


def test_bad_features_become_their_defaults_and_good_ones_stay():
    assert parsed(sanitise_record(GOOD, SPEC)) == {"trip_miles": [2.5], "trip_seconds": [600]}
    expected = [{"trip_miles": [0.0], "trip_seconds": [600]}] * 5 + [
        {"trip_miles": [0.0], "trip_seconds": [0]}]
    expected[4] = {"trip_miles": [2.5], "trip_seconds": [0]}
    assert [parsed(record) for record in sanitise_records(BAD, SPEC)] == expected
    # Without the rule, parsing the same records raises (after the grant was charged).
    for record in BAD[2:5]:
        with pytest.raises(tf.errors.InvalidArgumentError):
            tf.io.parse_example(tf.constant([record]), SPEC)


def test_a_default_declared_in_the_spec_is_used_and_must_be_finite():
    spec = {"hour": tf.io.FixedLenFeature([2], tf.float32, default_value=[12.0, 1.0])}
    assert parsed(sanitise_record(trip(), spec), spec) == {"hour": [12.0, 1.0]}
    # A NaN is replaced position by position; the other value is kept.
    assert parsed(sanitise_record(trip(hour=[float("nan"), 3.0]), spec), spec) == {
        "hour": [12.0, 3.0]}
    with pytest.raises(RecordRuleError, match="must be finite"):
        sanitise_records([GOOD], {"x": tf.io.FixedLenFeature([1], tf.float32,
                                                             default_value=[float("nan")])})
    with pytest.raises(RecordRuleError, match="FixedLenFeature and VarLenFeature only"):
        sanitise_records([GOOD], {"x": tf.io.RaggedFeature(tf.float32)})


def test_finite_maps_non_finite_entries_to_zero():
    values = finite(tf.constant([[1.0, np.nan], [-np.inf, np.inf]])).numpy()
    assert values.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert finite(tf.constant([3], tf.int64)).numpy().tolist() == [3]


def test_the_decoder_gives_finite_inputs_and_labels_for_bad_records():
    decoder = RecordDecoder(UserModule.load(TRIP_MODULE, "adassp"))
    inputs, labels = decoder.decode([GOOD] + BAD)
    assert np.isfinite(inputs.numpy()).all() and np.isfinite(labels.numpy()).all()
    assert inputs.numpy()[:, 0].tolist() == [2.5, 0.0, 0.0, 0.0, 0.0, 2.5, 0.0]
    assert decoder.labels(decoder.sanitise([GOOD] + BAD)).numpy().reshape(-1).tolist() == [600] * 5 + [0, 0]


def test_adassp_after_the_decoder_fits_finite_weights_despite_one_nan_and_one_inf():
    # Without the rule the NaN row makes X^T X NaN: adassp raises after the charge (LinAlgError
    # on main, the mechanisms' refusal of non-finite values since).
    rng = np.random.default_rng(0)
    miles = rng.uniform(0.5, 5.0, 200)
    records = [trip(trip_miles=[float(m)], trip_seconds=[int(100 + 200 * m)]) for m in miles]
    records[:2] = BAD[:2]
    inputs, labels = RecordDecoder(UserModule.load(TRIP_MODULE, "adassp")).decode(records)
    result = adassp(inputs.numpy(), labels.numpy().reshape(-1), 1.0, 1e-6, feature_bound=6.0,
                    label_bound=1200.0)
    assert np.isfinite(result.weights).all()
    with pytest.raises(ValueError):  # np.linalg.LinAlgError is a ValueError
        raw = np.array([[np.nan]] + [[m] for m in miles[2:]])
        adassp(raw, labels.numpy().reshape(-1)[1:], 1.0, 1e-6, 6.0, 1200.0)


def test_a_non_finite_prediction_or_label_counts_as_the_loss_bound():
    module = UserModule.load(TRIP_MODULE, "loss")
    labels = np.array([[1.0], [np.nan], [2.0], [1.0]])
    outputs = np.array([[1.5], [1.0], [np.inf], [np.nan]])
    values = per_example_metric("loss", module, labels, outputs)
    assert values[0] == pytest.approx(0.25) and np.isnan(values[1:]).all()
    # The validator counts NaN as its bound B, so its release stays finite. (400 values at
    # epsilon 1: the DP count is <= 0, making the upper bound infinite, with probability
    # about exp(-200).)
    release = loss_validator(np.tile(values, 100), 0.5, 1.0, loss_bound=1.0)
    assert all(np.isfinite([release.dp_estimate, release.lower_bound, release.upper_bound]))


def test_csv_rows_are_read_one_at_a_time_so_one_odd_row_changes_no_other(tmp_path):
    """TFX's CSV reader infers a column's type from every row: one "1.5" in an integer column
    turns the column to floats for every record. BlockExampleGen types each cell alone, and the
    record rule converts exact numbers to the spec's type, so the other records do not move."""
    from sage_tfx.components.block_example_gen.csv_rows import csv_records

    rows = ["trip_start_timestamp,trip_seconds,trip_miles", "1704067200,300,2",
            "1704070800,600,1.5", '1704074400,"900",']
    plain, odd = tmp_path / "plain.csv", tmp_path / "odd.csv"
    plain.write_text("\n".join(rows) + "\n")
    odd.write_text("\n".join(rows + ["1704078000,abc,NaN"]) + "\n")
    with_odd = list(csv_records(str(odd)))
    assert with_odd[:3] == list(csv_records(str(plain)))
    spec = {"trip_seconds": tf.io.FixedLenFeature([1], tf.int64),
            "trip_miles": tf.io.FixedLenFeature([1], tf.float32, default_value=[0.0])}
    parsed = tf.io.parse_example(sanitise_records(with_odd, spec), spec)
    assert parsed["trip_seconds"].numpy().ravel().tolist() == [300, 600, 900, 0]
    assert parsed["trip_miles"].numpy().ravel().tolist() == [2.0, 1.5, 0.0, 0.0]


def test_a_column_typed_from_all_its_cells_reads_each_record_as_typed_alone():
    """TFX's CsvExampleGen (ContinualRelease's documented input) types a column from all its
    cells: one unit's "soon" in the time column made every record's time text, read as the
    default 0, so that one unit emptied the whole continual release; a text column whose cells
    all look like integers became int64, every id read as "" (all units merged)."""
    spec = {"time": tf.io.FixedLenFeature([1], tf.int64),
            "fare": tf.io.FixedLenFeature([1], tf.float32),
            "uid": tf.io.FixedLenFeature([1], tf.string)}

    def record(time, fare, uid):
        example = tf.train.Example()
        for name, value in (("time", time), ("fare", fare), ("uid", uid)):
            kind = {bytes: "bytes_list", int: "int64_list", float: "float_list"}[type(value)]
            getattr(example.features.feature[name], kind).value.append(value)
        return example.SerializeToString()

    as_numbers = [record(1356998400, 2.5, 17), record(2 ** 62, 3.0, -4)]
    as_text = [record(b"1356998400", b"2.5", b"17"), record(b" 4611686018427387904", b"3", b"-4")]
    expected = {"time": [[1356998400], [2 ** 62]], "fare": [[2.5], [3.0]],
                "uid": [[b"17"], [b"-4"]]}
    for records in (as_numbers, as_text):
        parsed = tf.io.parse_example(sanitise_records(records, spec), spec)
        assert {name: value.numpy().tolist() for name, value in parsed.items()} == expected
    # The unit whose cells made the columns text: each cell still maps on its own.
    odd = tf.io.parse_example(sanitise_records(
        [record(b"soon", b"NaN", b"u9"), record(b"1e3", b"\xff", b"x")], spec), spec)
    assert {name: value.numpy().tolist() for name, value in odd.items()} == {
        "time": [[0], [1000]], "fare": [[0.0], [0.0]], "uid": [[b"u9"], [b"x"]]}


def test_a_record_with_an_unplaceable_key_or_no_example_cannot_stop_ingestion():
    """Keys far outside any calendar, and bytes that are no tf.Example, are dropped: block_of
    alone cannot place such keys, and one record must not fail the ingestion."""
    from sage_tfx.components.block_example_gen.executor import block_of, place

    first, last = 1704067200, 1706745600  # 2024-01, as month_schedule("2024-01", "2024-01")

    def record(value):
        example = tf.train.Example()
        example.features.feature["t"].float_list.value.append(value)
        return example.SerializeToString()

    for bad_key in (1e20, -1e15, 253402300799.0):
        with pytest.raises((OverflowError, ValueError, OSError)):
            block_of(bad_key, "hour", 0)
        assert place(record(bad_key), "t", "hour", 0, first, last) is None
    assert place(b"\xff\x00 not an example", "t", "month", 0, first, last) is None
    assert place(record(1704070800.0), "t", "month", 0, first, last) == "2024-01"
