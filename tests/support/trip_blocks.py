"""Blocks of trip records as BlockExampleGen writes them (for the matrix mechanism's tests)."""
import os

import tensorflow as tf

# A workload over them: all ranges of the duration bins, and the (duration, payment) cells.
TRIP_SPEC = {
    "attributes": [{"name": "seconds", "feature": "trip_seconds", "bins": [0, 60, 120, 300]},
                   {"name": "payment", "feature": "payment_type",
                    "categories": ["Cash", "Credit Card"]}],
    "queries": [{"kind": "all_ranges", "attributes": ["seconds"]},
                {"kind": "marginals", "way": 2}]}
TRIPS = [(30.0, b"Cash"), (200.0, b"Credit Card"), (90.0, b"Cash")]


def write_block(directory, records=TRIPS):
    """Gzipped TFRecords of (trip_seconds, payment_type) in Split-train and Split-eval; the last
    record of train is no tf.Example (the record rule's default cells)."""
    write_examples(directory, [{"trip_seconds": seconds, "payment_type": payment}
                               for seconds, payment in records], garbage=True)


def write_examples(directory, records, garbage=False):
    """Gzipped TFRecords of `records` ({feature: float, int or bytes}) as BlockExampleGen writes
    them: all but the last in Split-train, the last in Split-eval; with `garbage`, train ends
    with a record that is no tf.Example."""
    for split, rows in (("train", records[:-1]), ("eval", records[-1:])):
        os.makedirs(os.path.join(directory, f"Split-{split}"))
        path = os.path.join(directory, f"Split-{split}", "data.gz")
        with tf.io.TFRecordWriter(path, options="GZIP") as writer:
            for record in rows:
                example = tf.train.Example()
                for name, value in record.items():
                    kind = ("bytes_list" if isinstance(value, bytes) else "float_list"
                            if isinstance(value, float) else "int64_list")
                    getattr(example.features.feature[name], kind).value.append(value)
                writer.write(example.SerializeToString())
            if split == "train" and garbage:
                writer.write(b"not an example")
