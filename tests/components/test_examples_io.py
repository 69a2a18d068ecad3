"""The statistics components' reading of Examples (components/util/examples_io.py)."""
import math

import sage_tfx  # noqa: F401  (Keras 2, before TensorFlow loads)
import tensorflow as tf

from sage_tfx.components.util.examples_io import read_rows


def _example(**features) -> bytes:
    example = tf.train.Example()
    for name, value in features.items():
        feature = example.features.feature[name]
        if isinstance(value, float):
            feature.float_list.value.append(value)
        elif isinstance(value, int):
            feature.int64_list.value.append(value)
        else:
            feature.bytes_list.value.append(value.encode())
    return example.SerializeToString()


def test_numbers_that_are_missing_unreadable_or_not_finite_are_null_for_statistics(tmp_path):
    """DPAggregate reads them as NULL (skipped by each aggregate, as BigQuery and the SQL
    engine do); the record rule's 0 stays for the other readers."""
    split = tmp_path / "Split-train"
    split.mkdir()
    records = [_example(key="a", fare=3.5, trips=2), _example(key="a"),
               _example(key="a", fare=math.nan, trips=1), _example(key="a", fare="fast"),
               _example(key="a", fare=math.inf, trips=3), b"not an example"]
    with tf.io.TFRecordWriter(str(split / "data.gz"), options="GZIP") as writer:
        for record in records:
            writer.write(record)
    columns = {"key": "string", "fare": "float", "trips": "int"}
    nulls = read_rows([str(tmp_path)], columns, numeric_nulls=True).to_pydict()
    assert nulls["fare"] == [3.5, None, None, None, None, None]
    assert nulls["trips"] == [2, None, 1, None, 3, None]
    assert nulls["key"] == ["a", "a", "a", "a", "a", ""]  # text keeps the rule's default
    zeros = read_rows([str(tmp_path)], columns).to_pydict()
    assert zeros["fare"] == [3.5, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_a_split_is_read_where_only_tf_filesystems_open_it():
    """Examples on a pipeline root such as gs:// (ram:// here: os and glob cannot open either)
    are read through TF's gfile, as every read after the charge must be."""
    from sage_tfx.components.util.examples_io import read_split

    records = [_example(fare=1.5), _example(fare=2.5)]
    tf.io.gfile.makedirs("ram://examples-io/Split-train")
    with tf.io.TFRecordWriter("ram://examples-io/Split-train/data.gz", options="GZIP") as writer:
        for record in records:
            writer.write(record)
    assert [bytes(r) for r in read_split("ram://examples-io", "train").numpy()] == records
