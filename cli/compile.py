"""`sage-tfx compile --kubeflow`: its arguments here, TFX imported only when it runs."""
from __future__ import annotations

import os
import sys

from sage_tfx.cli.common import quiet_tensorflow


def add_parser(groups) -> None:
    """`sage-tfx compile`: its arguments here, TFX imported only when it runs."""
    parser = groups.add_parser(
        "compile", help="compile a pipeline (taxi, or your own module) for Kubeflow",
        description="Compile one pipeline run into a Kubeflow Pipelines V2 PipelineJob JSON. "
                    "Without --pipeline-module it compiles the taxi example.")
    parser.add_argument("--kubeflow", action="store_true", required=True,
                        help="Kubeflow Pipelines V2 (the only target for now)")
    parser.add_argument("--out", required=True,
                        help="the PipelineJob JSON to write; its directory must exist")
    parser.add_argument("--image", required=True,
                        help="the container image every step runs in (see the Dockerfile)")
    parser.add_argument("--pipeline-root", required=True,
                        help="where runs write their artifacts, e.g. gs://BUCKET/sage")
    parser.add_argument("--pipeline-module",
                        help="your pipeline: PATH.py[:FUNCTION]; FUNCTION (default "
                             "create_pipeline) is called with pipeline_root=... and must return "
                             "a tfx Pipeline")
    taxi = parser.add_argument_group("the taxi example (without --pipeline-module)")
    taxi.add_argument("--data-root", help="where the new months' CSV files arrive (required for "
                                          "taxi), e.g. gs://BUCKET/taxi/new-months")
    taxi.add_argument("--first-month", default="2013-01",
                      help="first month (YYYY-MM) this run ingests (default: the sample's first, "
                           "2013-01); blocks are immutable, so each run names new months")
    taxi.add_argument("--last-month", default="2016-12",
                      help="last month (YYYY-MM) this run ingests (default: the sample's last, "
                           "2016-12)")
    # TrainerMode's values, spelled out: importing it imports TFX, too slow for --help.
    taxi.add_argument("--mode", choices=("adassp", "dp_sgd"), default="adassp",
                      help="the trainer (default: adassp)")
    taxi.add_argument("--window", type=int,
                      help="blocks the iteration trains on (default: the mode's first window, "
                           "MIN_WINDOW in examples/taxi/pipeline.py)")
    taxi.add_argument("--epsilon", type=float,
                      help="the iteration's epsilon (default: the mode's INITIAL_EPSILON)")
    taxi.add_argument("--tuning-share", type=float, default=0.0,
                      help="dp_sgd only: tune first (DPTuner, a private selection of the "
                           "learning rate and clip norm) on this fraction of the training "
                           "share; DPTrainer trains with the released best setting. A small "
                           "share gives noisy trials: e.g. 0.5 with --epsilon 2 (default 0: no "
                           "tuning)")
    taxi.add_argument("--ledger-store", default=None,
                      help="the ledger's ML Metadata server as the job's pods reach it, "
                           "grpc://HOST:PORT (default: Kubeflow's own, "
                           "grpc://metadata-grpc-service:8080)")
    taxi.add_argument("--seed", type=int, default=None,
                      help="tests only: fixes the sampler's and trainer's randomness (never use "
                           "it for a release: default, a seed from the OS). The job's "
                           "BlockLedger task refuses it, before the charge, unless the ledger "
                           "was created for tests (`sage-tfx ledger init --for-tests`)")
    taxi.add_argument("--module-file", default="sage_tfx.examples.taxi.taxi_module",
                      help="the taxi module inside the image: a path under /opt/sage-tfx or a "
                           "module path (default: %(default)s, the installed package's)")
    parser.set_defaults(run=_compile)


def _compile(args) -> int:
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        print(f"sage-tfx compile: directory {parent} does not exist; create it first "
              "(nothing written)", file=sys.stderr)
        return 2
    if args.pipeline_module is None and args.data_root is None:
        print("sage-tfx compile: the taxi example needs --data-root (where new CSV files "
              "arrive); or pass --pipeline-module for your own pipeline", file=sys.stderr)
        return 2
    quiet_tensorflow()  # compiling imports TFX, hence TensorFlow
    from sage_tfx.pipelines import kubeflow
    if args.pipeline_module:
        return kubeflow.compile_command(args.pipeline_module, args.out, args.image,
                                        args.pipeline_root)
    try:
        build, summary = _taxi_example(args)
    except ValueError as error:
        print(f"sage-tfx compile: {error}; nothing written", file=sys.stderr)
        return 2
    return kubeflow.compile_command(build, args.out, args.image, args.pipeline_root, summary)


def _taxi_example(args):
    """The CLI's example pipeline (without --pipeline-module): a function building one taxi
    iteration, and what it grants (for the summary line)."""
    import dataclasses
    import functools

    from sage_tfx.examples.taxi.pipeline import (DP_SGD_TUNING, INITIAL_EPSILON, MIN_WINDOW,
                                                 SPECS, kubeflow_pipeline)
    from sage_tfx.sage_access.store import KUBEFLOW_LEDGER_STORE, parse
    ledger_store = args.ledger_store or KUBEFLOW_LEDGER_STORE
    if isinstance(parse(ledger_store), str):  # parse refuses a malformed grpc:// address
        # A file here is a path of this machine, which the job's pods do not have.
        raise ValueError(f"--ledger-store {ledger_store!r}: the job's pods reach the ledger "
                         "over gRPC; give grpc://HOST:PORT")
    spec = dataclasses.replace(SPECS[args.mode](args.seed), module_file=args.module_file)
    window = MIN_WINDOW[args.mode] if args.window is None else args.window
    epsilon = INITIAL_EPSILON[args.mode] if args.epsilon is None else args.epsilon
    tuned = ""
    if args.tuning_share:
        spec = dataclasses.replace(spec, tuning=DP_SGD_TUNING)
        _refuse_untunable(args, spec, epsilon)
        tuned = f", {args.tuning_share:g} of its training share tuning first"
    build = functools.partial(kubeflow_pipeline, spec, data_root=args.data_root, window=window,
                              epsilon=epsilon, months=(args.first_month, args.last_month),
                              ledger_store=ledger_store, tuning_share=args.tuning_share)
    return build, (f"; a grant of epsilon {epsilon:g} on {window} block(s){tuned}; ledger at "
                   f"{ledger_store}")


def _refuse_untunable(args, spec, epsilon: float) -> None:
    """ValueError, before anything is written, for a --tuning-share the job could not run: not
    DP-SGD, out of [0, 1), or a share whose search no noise can pay for (the BlockLedger task
    would refuse it before its charge, after the job started)."""
    from sage_tfx.pipelines.adaptive import iteration_split, preflight_iteration
    from sage_tfx.pipelines.policy import Policy

    if args.mode != "dp_sgd":
        raise ValueError(f"--tuning-share tunes DP-SGD; --mode is {args.mode}")
    Policy(tuning_share=args.tuning_share).check()
    spec.check()
    preflight_iteration(spec, epsilon, iteration_split(spec, args.tuning_share))
