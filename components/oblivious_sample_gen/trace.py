"""Sample a synthetic dataset with the oblivious samplers and print their access-trace hash.

    python -m sage_tfx.components.oblivious_sample_gen.trace --scheme swo|poisson --n N
           (--m M | --gamma G) --seed S --data-seed D [--repeat R] [--json]

The dataset has N records with random features drawn from D and an id column. The samples are
drawn with secret seed S (draw r uses S + r). For each draw the command prints the SHA-256 of
the external-memory trace and the record ids of every sample, read back from the moved
records: one JSON object, or with --repeat a JSON list of R of them. The hash must be the same for every S and D at equal N and M/G; the samples differ.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from sage_tfx.components.oblivious_sample_gen.descriptor import Scheme

FEATURES = 4


def dataset(n: int, data_seed: int) -> np.ndarray:
    features = np.random.default_rng(data_seed).standard_normal((n, FEATURES))
    return np.column_stack([np.arange(n, dtype=np.float64), features])


def draw(scheme: str, records: np.ndarray, parameter, seed: int) -> dict:
    from sage_tfx.components.oblivious_sample_gen.access_trace import AccessTrace
    from sage_tfx.components.oblivious_sample_gen.sampling import samples_poisson, samples_swo
    trace = AccessTrace()
    sampler = samples_swo if scheme == Scheme.SWO else samples_poisson
    samples = sampler(records, parameter, seed=seed, trace=trace)
    ids = [batch[:, 0].astype(np.int64).tolist() for batch in samples.batches()]
    return {"trace_sha256": trace.sha256(), "reads": trace.reads, "writes": trace.writes,
            "slots": int(samples.descriptor.slots_per_epoch), "samples": ids}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sage_tfx.components.oblivious_sample_gen.trace",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=(Scheme.SWO.value, Scheme.POISSON.value), required=True)
    parser.add_argument("--n", type=int, required=True)
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--m", type=int)
    size.add_argument("--gamma", type=float)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--data-seed", type=int, required=True)
    parser.add_argument("--repeat", type=int)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    parameter = args.m if args.scheme == Scheme.SWO else args.gamma
    if parameter is None:
        parser.error(f"--scheme {args.scheme} needs {'--m' if args.scheme == 'swo' else '--gamma'}")
    if args.n <= 0 or (args.repeat is not None and args.repeat <= 0):
        parser.error("--n and --repeat must be positive")
    records = dataset(args.n, args.data_seed)
    try:
        draws = [draw(args.scheme, records, parameter, args.seed + r)
                 for r in range(args.repeat or 1)]
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # One draw: its object. With --repeat: a list of R draw objects.
    if args.json:
        print(json.dumps(draws if args.repeat else draws[0]))
    else:
        for index, one in enumerate(draws):
            print(f"draw {index}: trace_sha256={one['trace_sha256']} "
                  f"samples={len(one['samples'])} sizes={[len(s) for s in one['samples']][:10]}...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
