"""The base of sage-tfx's Beam executors (BlockExampleGen, DPTransform, DPAggregate): TFX's BaseBeamExecutor
without the stray Beam argument of TFX's Kubeflow V2 entrypoint.

`kubeflow_v2_run_executor` parses its whole argv with `parse_known_args`, so its own program path
arrives first among the Beam arguments of every task of a compiled job (here and on a cluster).
Beam discards it ("Discarding unparseable args"), but BaseBeamExecutor, given Beam arguments that
name no --setup_file, --extra_package, --requirements_file or --sdk_container_image, builds and
stages an sdist of TFX for the workers in every task (51 MB and 2,260 files copied, seconds to
tens of seconds; the workers would not get sage-tfx from it anyway, docs/running-at-scale.md).
Without that path the task runs as a local pipeline's executor does when given no Beam arguments;
arguments a user gave are kept as given, and TFX treats them as before.
"""
from __future__ import annotations

import sys

from tfx.dsl.components.base import base_beam_executor


class BeamExecutor(base_beam_executor.BaseBeamExecutor):

    def __init__(self, context=None):
        if isinstance(context, base_beam_executor.BaseBeamExecutor.Context):
            arguments = list(context.beam_pipeline_args or [])
            if arguments and arguments[0] == sys.argv[0]:  # the entrypoint's own path
                context.beam_pipeline_args = arguments[1:]
        super().__init__(context)
