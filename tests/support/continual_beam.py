"""Driving the continual-release Beam engine (dp_statistics/continual/beam.py) in tests: a
TestStream that honours its source contract, and a streaming DirectRunner run that returns
what a PCollection held."""
import os
import pickle
import tempfile
import uuid
from typing import Iterable

import apache_beam as beam
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
