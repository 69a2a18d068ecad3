"""Public stand-in records: random values of a feature spec's types and shapes, from a fixed
seed, the same on every run. The components that spend a grant run their user's code on them
before they read a record (dp_trainer/stand_in.py, dp_transform.executor.stand_in_pass), so a
failure of that code depends on no record and its cause may be shown."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

SEED = 45
IDS = 8  # integer features are drawn from [0, IDS): ids that fit a small table
COUNT = 4


def stand_in_records(feature_spec, count: int = COUNT, seed: int = SEED) -> list[bytes]:
    """`count` serialized tf.Examples holding random values of each feature's type and shape:
    floats standard normal, integers uniform in [0, IDS), strings of 1-8 random letters, and
    1-3 values for a VarLenFeature."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        example = tf.train.Example()
        for name, spec in sorted(feature_spec.items()):
            size = (int(np.prod(spec.shape, dtype=np.int64)) if isinstance(
                spec, tf.io.FixedLenFeature) else int(rng.integers(1, 4)))
            feature = example.features.feature[name]
            if spec.dtype == tf.string:
                feature.bytes_list.value.extend(
                    bytes(rng.integers(97, 123, int(rng.integers(1, 9))).astype(np.uint8))
                    for _ in range(size))
            elif spec.dtype.is_integer:
                feature.int64_list.value.extend(rng.integers(0, IDS, size).tolist())
            else:
                feature.float_list.value.extend(rng.standard_normal(size).tolist())
        records.append(example.SerializeToString())
    return records


def cause(error: BaseException) -> str:
    """What failed, in one line: the innermost error of the chain (Beam and TensorFlow wrap the
    op's own error), its type and the first line of its message, or, for Keras and autograph,
    whose messages end with what failed after a traceback of the user's code, the last line
    before the call's arguments."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = lines[:next((i for i, line in enumerate(lines)
                         if line.startswith("Call arguments received")), len(lines))]
    text = "" if not lines else lines[-1] if "in user code:" in lines[0] else lines[0]
    return text if text.startswith(f"{type(error).__name__}:") else \
        f"{type(error).__name__}: {text}"
