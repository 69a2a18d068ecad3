"""`sage-tfx kubeflow run-local`: run a compiled PipelineJob here, each task in its own process,
as Kubeflow Pipelines would (pipelines/kubeflow_local.py). TFX is imported only by the tasks'
launcher (pipelines/task_processes.py), not by this process."""
from __future__ import annotations

import json
import sys


def add_parser(groups) -> None:
    parser = groups.add_parser("kubeflow", help="run a compiled Kubeflow job on this machine",
                               description="Commands for Kubeflow Pipelines jobs compiled by "
                                           "`sage-tfx compile --kubeflow`.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run-local}")
    run = commands.add_parser(
        "run-local", help="run each task of a PipelineJob JSON in its own process",
        description="Run each task of a PipelineJob JSON in topological order, each in its own "
                    "process with the container command and arguments the JSON gives, the "
                    "executor input filled as Kubeflow Pipelines fills it, artifacts passed "
                    "through the pipeline root. The tasks reach the ledger at the store the job "
                    "was compiled with (compile with --ledger-store grpc://HOST:PORT; "
                    "`python -m sage_tfx.sage_access.grpc_server` serves a ledger file). The "
                    "first failing task stops the job. Exit 2 if a task failed before the "
                    "job's grant was charged, 7 if after (its budget is spent).")
    run.add_argument("job", help="the PipelineJob JSON")
    run.add_argument("--pipeline-root", required=True,
                     help="a local directory for the run's artifacts (the cluster's would be "
                          "e.g. gs://BUCKET/sage); the run writes under PIPELINE/RUN_ID in it")
    run.set_defaults(run=_run_local)


def _run_local(args) -> int:
    from sage_tfx.cli.common import EXIT_BAD_INPUT, EXIT_RELEASE_FAILED
    from sage_tfx.pipelines.kubeflow_local import JobFailed, JobRefused, run_local

    try:
        with open(args.job) as handle:
            job = json.load(handle)
    except (OSError, ValueError) as error:
        print(f"sage-tfx kubeflow run-local: cannot read the job {args.job}: {error}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        run = run_local(job, args.pipeline_root)
    except (JobRefused, KeyError) as error:
        print(f"sage-tfx kubeflow run-local: {args.job} cannot run: {error}; no task started",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    except JobFailed as failed:
        print(f"sage-tfx kubeflow run-local: {failed}", file=sys.stderr)
        return EXIT_RELEASE_FAILED if failed.run.charged else EXIT_BAD_INPUT
    print(f"run {run.run_id}: all {len(run.tasks)} tasks done in "
          f"{sum(task.seconds for task in run.tasks):.0f} s; artifacts under {run.run_root}")
    return 0
