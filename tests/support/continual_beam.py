"""Driving the continual-release Beam engine (dp_statistics/continual/beam.py) in tests: a
TestStream that honours its source contract, and a streaming DirectRunner run that returns
what a PCollection held; the stream both engines are compared on and the micro-batches the local
engine reads of it."""
import os
import pickle
import tempfile
import uuid
from typing import Iterable

import apache_beam as beam
import numpy as np
import pandas as pd
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms import window

from sage_tfx.dp_statistics.continual.beam import STAGES, MicroBatches, StreamRecord


def replay(records: Iterable[tuple], batches: MicroBatches) -> TestStream:
    """``(unit, key, value, event_time)`` tuples (input order = list order) as a TestStream:
    each micro-batch's records in input order, then the watermark through the instants at which
    the stages act on it, one at a time. Records outside the window come first (the pipeline
    drops them)."""
    by_step: dict = {}
    for order, (unit, key, value, event_time) in enumerate(records):
        element = window.TimestampedValue(StreamRecord(unit, key, value, order), event_time)
        by_step.setdefault(batches.step_of(float(event_time)), []).append(element)
    stream = TestStream()
    if by_step.get(0):
        stream = stream.add_elements(by_step[0])
    for step in range(1, batches.count + 1):
        if by_step.get(step):
            stream = stream.add_elements(by_step[step])
        for stage in range(STAGES):
            stream = stream.advance_watermark_to(batches.trigger_timestamp(step, stage))
    return stream.advance_watermark_to_infinity()


def collect(build, arguments=()) -> list:
    """Run ``build(pipeline)`` -> PCollection in a streaming pipeline of its own (DirectRunner
    unless pipeline ``arguments`` say otherwise); its elements, which cross from the workers as
    one pickle file each."""
    options = PipelineOptions(list(arguments))  # not sys.argv (pytest's)
    options.view_as(StandardOptions).streaming = True
    with tempfile.TemporaryDirectory() as directory:
        def save(element):
            with open(os.path.join(directory, uuid.uuid4().hex), "wb") as file:
                pickle.dump(element, file)

        with beam.Pipeline(options=options) as pipeline:
            _ = build(pipeline) | "Save" >> beam.Map(save)
        elements = []
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name), "rb") as file:
                elements.append(pickle.load(file))
        return elements


def conformance_stream():
    """66 records of 30 units over 4 keys (seed 4 chosen so that, with NOISE_KEY, key "d" is
    released at step 4 without records at step 4 (Algorithm 4) and "a" in a second round), a
    fifth key seen at step 1 only, and records both engines drop."""
    rng = np.random.default_rng(4)
    records = []
    for unit in range(30):
        for _ in range(rng.integers(1, 4)):
            key = rng.choice(["a", "b", "c", "d"], p=[.5, .25, .15, .1])
            records.append((f"u{unit}", str(key), float(rng.integers(-3, 6)),
                            float(rng.uniform(0, 40))))
    # key "e": two units at the end of step 1 only (never selected: no later evaluation)
    return records + [(None, "a", 1.0, 5.0), ("u1", "a", 1.0, 40.0), ("u2", "b", 1.0, -1.0),
                      ("u90", "e", 1.0, 9.5), ("u91", "e", 2.0, 9.6)]


def local_batches(records, batches):
    """The micro-batches local.run_local reads: in arrival order (step, event time, input
    order), records outside the window or without a unit left out, as sources.py does."""
    rows = sorted((batches.step_of(time), time, order, unit, key, value)
                  for order, (unit, key, value, time) in enumerate(records)
                  if unit and batches.step_of(time))
    return [(step, pd.DataFrame({"unit": [r[3] for r in rows if r[0] == step],
                                 "key": [r[4] for r in rows if r[0] == step],
                                 "value": [r[5] for r in rows if r[0] == step]}))
            for step in range(1, batches.count + 1)]
