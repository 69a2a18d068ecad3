"""The Beam engine moves rows in batches (issue 47): far fewer elements than rows cross the
shuffle by unit, and the pre-noise sums and the released bits are the local engine's; a seeded
run samples what it sampled before batching. Beam runs on the DirectRunner, in this process."""
import hashlib
import json
import os
import pickle
import subprocess
import sys

import apache_beam as beam
import numpy as np
import pandas as pd
import pytest
from apache_beam.metrics.metric import MetricsFilter
from support.beam_engine import HEAVY_QUERY, accumulate_with_beam, heavy_rows, sorted_by_keys
from support.seeded_noise import seeded_measurement

from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregateKind, AggregationQuery,
                                                GuaranteeUnit, local, plan)
from sage_tfx.dp_statistics.aggregation.beam import AccumulateTransform, GatherAccumulated
from sage_tfx.mechanisms import additive
from sage_tfx.randomness import secret_rng

QUERY = AggregationQuery(
    ("area", "day"), "uid",
    (Aggregate.count(), Aggregate.count_distinct(), Aggregate(AggregateKind.SUM, "fare", 0, 50),
     Aggregate(AggregateKind.AVG, "fare", 0, 40), Aggregate(AggregateKind.VAR, "fare", 0, 40),
     Aggregate.median("fare", 0, 40)),
    max_partitions_contributed=4, max_contributions_per_partition=4)


def frame(seed: int = 3) -> pd.DataFrame:
    """3,000 units, each in 1 or 4 of 60 partitions with 1-4 rows in each (nothing for the
    sampling to drop under C_u = m = 4, so both engines keep the same rows), fares multiples of
    1/4 in [0, 60) and selection weights 1 or 1/2: every sum is exact in any order, so the two
    engines' sums can be compared bit for bit."""
    rng = np.random.default_rng(seed)
    rows = []
    for unit in range(3000):
        for key in rng.choice(60, size=rng.choice([1, 4]), replace=False):
            for _ in range(rng.integers(1, 5)):
                rows.append((f"a{key % 20}", int(key // 20), f"u{unit}",
                             float(rng.integers(0, 240)) / 4))
    return pd.DataFrame(rows, columns=["area", "day", "uid", "fare"])


def _accumulate_in_batches(data: pd.DataFrame, batches: int, output: str):
    """AccumulateTransform on ``batches`` slices of ``data`` (each one element, several
    bundles); (the local.Accumulated, the elements that crossed the shuffle by unit)."""
    pipeline = beam.Pipeline(options=beam.options.pipeline_options.PipelineOptions(
        ["--direct_running_mode=in_memory"]))
    budget = plan(QUERY, 8.0, 1e-6)
    _ = (pipeline | beam.Create([data.iloc[start::batches] for start in range(batches)])
         | AccumulateTransform(QUERY, budget, batched=True) | GatherAccumulated(QUERY)
         | beam.Map(lambda accumulated: _write(output, accumulated)))
    result = pipeline.run()
    result.wait_until_finish()
    [counter] = result.metrics().query(MetricsFilter().with_name(
        "unit_shuffle_elements"))["counters"]
    with open(output, "rb") as file:
        return pickle.load(file), counter.committed


def _write(path: str, value) -> None:
    with open(path, "wb") as file:
        pickle.dump(value, file)


def test_batches_cross_the_unit_shuffle_and_the_sums_and_released_bits_are_the_local_engines(
        monkeypatch, tmp_path):
    data = frame()
    accumulated, elements = _accumulate_in_batches(data, 7, str(tmp_path / "sums.pickle"))
    # at most one element per (batch, bucket of units): 7 x 16, for 9,000-odd rows
    assert 7 <= elements <= 7 * 16
    assert elements * 50 < len(data)
    budget = plan(QUERY, 8.0, 1e-6)
    local_keys, local_sums = sorted_by_keys(
        local.accumulate(data, QUERY, budget, secret_rng(0)), QUERY)
    beam_keys, beam_sums = sorted_by_keys(accumulated, QUERY)
    pd.testing.assert_frame_equal(local_keys, beam_keys)
    np.testing.assert_array_equal(local_sums, beam_sums)
    # the release from each engine's sums, the noise drawn from the same seeded stream: the
    # same table, bit for bit
    tables, streams = [], [seeded_measurement(), seeded_measurement()]
    for (keys, sums), stream in zip(((local_keys, local_sums), (beam_keys, beam_sums)), streams):
        monkeypatch.setattr(additive, "_measurement", stream)
        tables.append(local.release_accumulated(
            QUERY, budget, local.Accumulated(keys, sums, accumulated.bounds, {}),
            GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ).table)
    assert len(tables[0]) > 10
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)


def test_a_seeded_run_samples_the_rows_it_sampled_before_batching():
    """Pinned from main before issue 47 (commit 1c7f875): with seed 7, each area's units after
    step 2 and the median's tree of the rows step 1 kept (integer counts, exact)."""
    budget = plan(HEAVY_QUERY, 1.0, 1e-6)
    for rows in (heavy_rows(), pd.DataFrame(heavy_rows())):
        keys, sums = sorted_by_keys(accumulate_with_beam(rows, HEAVY_QUERY, budget, seed=7),
                                    HEAVY_QUERY)
        assert keys["area"].tolist() == [f"a{k}" for k in (0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9)]
        assert sums[:, 0].tolist() == [6, 8, 8, 12, 7, 8, 11, 8, 8, 6, 4, 4]
        tree = np.ascontiguousarray(sums[:, 4:88].astype(np.int64))
        assert hashlib.sha256(tree.tobytes()).hexdigest() == (
            "87e1a903f85336779753971e9839bf0f40997e380e8f75bd7566d07efa979956")


WORKER_IMPORTS = r"""
import json, sys
import apache_beam.runners.worker.sdk_worker_main  # what a portable runner's worker imports
import pandas as pd
from sage_tfx.dp_statistics.aggregation import plan
from sage_tfx.dp_statistics.aggregation import beam as engine  # what its DoFns unpickle into
from sage_tfx.dp_statistics.aggregation.local import aggregate
from sage_tfx.dp_statistics.continual import beam as continual_engine
from test_beam_batches import QUERY, frame
# the release step, run by a worker: Laplace and Gaussian noise, the weighted Gaussian selection
aggregate(frame().head(500), QUERY, plan(QUERY, 1.0, 1e-6))
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in
                        ("sklearn", "polars", "tensorflow") or name.startswith("opendp.extras"))))
"""


@pytest.mark.slow  # a fresh interpreter importing Beam and the engine: 5-25 s
def test_a_beam_worker_imports_only_what_the_engine_and_its_release_use():
    """Each Beam worker imports the engine's modules when it unpickles the DoFns, once per
    worker per job: on a portable runner that start-up was most of a small job's CPU (issue 47,
    docs/measurements.md). OpenDP's prelude pulled in its extras (scikit-learn, Polars, ...),
    which no DP step uses; the mechanisms import OpenDP's own modules instead. Run in a fresh
    interpreter, through the release (noise and selection), so a later import counts too."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(__file__), *sys.path])}
    result = subprocess.run([sys.executable, "-c", WORKER_IMPORTS], capture_output=True,
                            text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
