"""One epoch of oblivious SWO and Poisson sampling against shuffle-and-split, same run.

    python benchmarks/oblivious_sampling.py --n N [--json] [--repeats R]

Records are N rows of 32 float32 features. SWO uses m = 256 and Poisson gamma = 256 / N. The
baseline is the non-oblivious shuffle-and-split with m = 256. Each timing is the median of R
runs after one warm-up run. Prints {"n", "swo_s", "poisson_s", "baseline_s", "swo_ratio",
"poisson_ratio", "peak_rss_mb", ...}. Memory: peak_rss_mb is the whole process's high-water mark
(TensorFlow included). sampling_peak_over_dataset is the high-water mark after one epoch of each
oblivious sampler minus the RSS once the dataset is loaded, divided by the dataset size: the
working memory sampling adds, in units of the dataset.
Targets (issue 3) at N = 1,000,000: ratios <= 5 (aim 3), sampling memory <= 3x the dataset.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import numpy as np
import psutil

FEATURES = 32
SAMPLE_SIZE = 256


def median_seconds(run, repeats: int) -> float:
    run()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    args = parser.parse_args()

    import tensorflow as tf

    from sage_tfx.components.oblivious_sample_gen.sampling import (samples_poisson, samples_swo,
                                                                   shuffle_and_split)
    records = tf.constant(np.random.default_rng(0).standard_normal((args.n, FEATURES),
                                                                   dtype=np.float32))
    dataset_mb = args.n * FEATURES * 4 / 2 ** 20
    loaded_mb = psutil.Process().memory_info().rss / 2 ** 20
    # Working memory of one epoch of each oblivious sampler, before repeated runs let the
    # allocator's caches grow the high-water mark.
    samples_swo(records, SAMPLE_SIZE)
    samples_poisson(records, SAMPLE_SIZE / args.n)
    sampling_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - loaded_mb

    # Eager CPU ops return once computed, so each call is a finished epoch of samples.
    baseline_s = median_seconds(lambda: shuffle_and_split(records, SAMPLE_SIZE), args.repeats)
    swo_s = median_seconds(lambda: samples_swo(records, SAMPLE_SIZE), args.repeats)
    poisson_s = median_seconds(lambda: samples_poisson(records, SAMPLE_SIZE / args.n),
                               args.repeats)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {
        "n": args.n, "swo_s": round(swo_s, 4), "poisson_s": round(poisson_s, 4),
        "baseline_s": round(baseline_s, 4), "swo_ratio": round(swo_s / baseline_s, 2),
        "poisson_ratio": round(poisson_s / baseline_s, 2), "peak_rss_mb": round(peak_mb, 1),
        "dataset_mb": round(dataset_mb, 1),
        "sampling_peak_over_dataset": round(sampling_peak_mb / dataset_mb, 2),
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
