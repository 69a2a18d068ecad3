"""The DP aggregation's Beam engine on the portable runner with 2 worker processes, against the
local engine (tests/dp_statistics/aggregation/test_conformance.py runs the same comparisons on
the DirectRunner, in one process), and against itself with its input split differently."""
import json

import numpy as np
import pandas as pd
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from support.beam_engine import (CONFORMANCE_QUERY, HEAVY_QUERY, accumulate_files_with_beam,
                                 accumulate_with_beam, conformance_frame, heavy_rows,
                                 sorted_by_keys)

from sage_tfx.dp_statistics.aggregation import Aggregate, AggregateKind, AggregationQuery, plan
from sage_tfx.dp_statistics.aggregation import local
from sage_tfx.dp_statistics.aggregation.beam import aggregate_with_beam
from sage_tfx.randomness import secret_rng

pytestmark = pytest.mark.slow


def test_two_workers_accumulate_the_local_engines_pre_noise_sums(portable_runner):
    frame, budget = conformance_frame(), plan(CONFORMANCE_QUERY, 1.0, 1e-6)
    local_keys, local_sums = sorted_by_keys(local.accumulate(frame, CONFORMANCE_QUERY, budget,
                                                             secret_rng(0)))
    beam_keys, beam_sums = sorted_by_keys(accumulate_with_beam(
        frame, CONFORMANCE_QUERY, budget, options=portable_runner.options()))
    pd.testing.assert_frame_equal(local_keys, beam_keys)
    np.testing.assert_allclose(local_sums, beam_sums)


def test_two_workers_select_the_partitions_the_local_engine_selects(portable_runner, tmp_path):
    """The whole release (noise and selection in a worker, the Release handed back through
    --temp_location as on a cluster): 10 partitions of 30 units each and
    10 of one unit, at epsilon 8. Each engine keeps exactly the 30-unit partitions unless a
    threshold draw fails: keeping a one-unit partition has probability <= delta = 1e-6 and
    dropping a 30-unit one is rarer still, so the test fails falsely with probability < 1e-4."""
    rows = [{"key": f"p{k}", "uid": f"u{k}-{u}", "fare": 5.0}
            for k in range(10) for u in range(30) for _ in range(2)]
    rows += [{"key": f"q{k}", "uid": f"lone{k}", "fare": 5.0} for k in range(10)]
    frame = pd.DataFrame(rows)
    query = AggregationQuery(("key",), "uid", (Aggregate.count(),
                                               Aggregate(AggregateKind.SUM, "fare", 0, 10)))
    # epsilon 8, not 20: the weighted Gaussian sampler's rounding delta (1 + e^eps) C 2^-49
    # is then 2e-11, negligible against delta (at 20 it is 3.5e-6 and the plan is refused).
    budget = plan(query, 8.0, 1e-6)
    shared = tmp_path / "shared"
    shared.mkdir()
    beam_release = aggregate_with_beam(frame, query, budget, options=PipelineOptions(
        portable_runner.options(f"--temp_location={shared}")))
    assert list(shared.iterdir()) == []  # the hand-over is cleaned up
    local_release = local.aggregate(frame, query, budget)
    assert sorted(beam_release.table["key"]) == sorted(local_release.table["key"]) == [
        f"p{k}" for k in range(10)]
    assert list(beam_release.events) == list(local_release.events)


def _write_shuffled(rows, directory, files: int, seed: int) -> list[str]:
    order = np.random.default_rng(seed).permutation(len(rows))
    paths = [str(directory / f"rows-{seed}-{index}.jsonl") for index in range(files)]
    for index, path in enumerate(paths):
        with open(path, "w") as file:
            file.writelines(json.dumps(rows[i]) + "\n" for i in order[index::files])
    return paths


def test_a_seeded_run_does_not_depend_on_how_the_input_was_split(portable_runner, tmp_path):
    """The same rows and seed: in one ordered Create on the DirectRunner, in 3 shuffled files on
    the DirectRunner, and in 5 files shuffled otherwise and redistributed among 2 workers; the
    pre-noise sums are equal (up to the order of float additions)."""
    rows, budget = heavy_rows(), plan(HEAVY_QUERY, 1.0, 1e-6)
    runs = [accumulate_with_beam(rows, HEAVY_QUERY, budget, seed=7),
            accumulate_files_with_beam(_write_shuffled(rows, tmp_path, 3, seed=1),
                                       HEAVY_QUERY, budget, seed=7),
            accumulate_files_with_beam(_write_shuffled(rows, tmp_path, 5, seed=2),
                                       HEAVY_QUERY, budget, seed=7,
                                       options=portable_runner.options())]
    keys, sums = sorted_by_keys(runs[0], HEAVY_QUERY)
    assert sums[:, 0].sum() < len(rows)  # the sampling did drop rows
    for run in runs[1:]:
        other_keys, other_sums = sorted_by_keys(run, HEAVY_QUERY)
        pd.testing.assert_frame_equal(keys, other_keys)
        np.testing.assert_allclose(sums, other_sums, rtol=1e-12)
