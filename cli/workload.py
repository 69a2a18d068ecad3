"""`sage-tfx workload-answer`: a workload of counting queries answered from granted blocks.

Beside the `matrix` package, not in it: importing anything inside `matrix` runs its __init__,
which loads the mechanisms (OpenDP, dp-accounting), and `sage-tfx` builds every command's parser
on each run, so `sage-tfx ledger show` would pay for them.

    sage-tfx workload-answer --store S (--window W | --blocks IDS) --epsilon E --delta D
                             --spec SPEC.json --out FILE.csv [--context C] [--pipeline P]

Order (docs/architecture.md, "charge before release"): the spec, the budget and the output path are checked
and the strategy chosen (data independent) before anything is charged; then ONE grant of
(E, D) is charged on the blocks, all or nothing, recording the Gaussian event that will run;
then the blocks' records are read (BlockExampleGen's Examples, or the rows of a table that
`sage-tfx ingest` registered: of each unit's rows in the granted blocks one is kept, chosen at
random, since the table's promise is per unit; executor.granted_histogram), the histogram built
(spec.py's record rule), the matrix mechanism run, and FILE.csv written (query, noisy answer,
expected RMSE). The last stdout line is one JSON object: grant, blocks, epsilon, delta, queries,
expected_rmse, event, unit and guarantee (what one neighbouring step adds or removes: the
table's unit column, or one record of Examples). Nothing data-dependent is printed except the
mechanism's output.

Exit codes: as every sage-tfx command (cli/common.py; `sage-tfx --help` lists them).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os

from sage_tfx.cli.common import add_store_arguments, open_ledger, run

STEP = "matrix_mechanism"


def add_parser(groups: argparse._SubParsersAction) -> None:
    parser = groups.add_parser("workload-answer", help="answer a workload of counting queries "
                               "from granted blocks (the matrix mechanism)",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(parser)
    selector = parser.add_mutually_exclusive_group(required=True)
    selector.add_argument("--blocks", help="comma-separated block ids")
    selector.add_argument("--window", type=int, help="the most recent W blocks that can still pay")
    parser.add_argument("--epsilon", type=float, required=True,
                        help="epsilon of the grant, all spent on the one Gaussian release")
    parser.add_argument("--delta", type=float, required=True, help="delta of the grant, in (0, 1)")
    parser.add_argument("--spec", required=True, help="the workload spec (JSON; see "
                        "sage_tfx.dp_statistics.matrix.spec)")
    parser.add_argument("--out", required=True, help="the CSV to write (its directory must exist)")
    parser.add_argument("--pipeline", default="workload-answer",
                        help="the pipeline name the grant is charged to")
    parser.set_defaults(run=lambda args: run(_answer, args), command="workload-answer")


def _answer(args) -> int:
    from sage_tfx.components.matrix_mechanism.executor import (GUARANTEE, granted_histogram,
                                                                planned_event)
    from sage_tfx.dp_statistics.matrix import UnsupportedWorkload, eigen_design, mechanism
    from sage_tfx.dp_statistics.matrix.spec import parse_spec
    from sage_tfx.sage_access.errors import BadRequest
    from sage_tfx.sage_access.ledger import BlockIds, BlockLedger, RecentWindow
    from sage_tfx.dp_statistics.matrix.workload import DomainError

    if not args.out.endswith(".csv") or not os.path.isdir(os.path.dirname(args.out) or "."):
        raise BadRequest(f"--out must be a .csv file in an existing directory, got {args.out!r}")
    if not (math.isfinite(args.epsilon) and args.epsilon > 0 and 0 < args.delta < 1):
        raise BadRequest(f"--epsilon must be positive and --delta in (0, 1), got "
                         f"{args.epsilon!r}, {args.delta!r}")
    try:
        with open(args.spec) as handle:
            spec = parse_spec(handle.read())
        strategy = eigen_design(spec.workload)
        strategy.require_support(spec.workload)
    except (OSError, DomainError, UnsupportedWorkload, ValueError) as error:
        raise BadRequest(f"workload spec {args.spec}: {error}") from None
    selector = (BlockIds([b for b in args.blocks.split(",") if b]) if args.blocks is not None
                else RecentWindow(args.window))
    ledger = BlockLedger(args.store, args.context)
    # require_data: a block without data is refused inside the grant's transaction, uncharged.
    grant = ledger.request(selector, epsilon=args.epsilon, delta=args.delta,
                           pipeline=args.pipeline, split={STEP: "1"},
                           events={STEP: planned_event(args.epsilon, args.delta)},
                           require_data=True)
    granted = granted_histogram(spec, ledger, grant.blocks)
    release = mechanism.answer_workload(spec.workload, strategy, granted.vector,
                                        epsilon=args.epsilon, delta=args.delta)
    with open(args.out, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["query", "answer", "expected_rmse"])
        writer.writerows(zip(spec.workload.labels(), release.answers, release.query_rmse))
    print(json.dumps({"grant_id": grant.grant_id, "blocks": list(grant.blocks),
                      "epsilon": args.epsilon, "delta": args.delta,
                      "queries": spec.workload.query_count,
                      "expected_rmse": release.expected_rmse, "strategy": strategy.name,
                      "event": str(release.event), "unit": granted.unit,
                      "guarantee": GUARANTEE.format(epsilon=args.epsilon, delta=args.delta,
                                                    unit=granted.unit,
                                                    sensitivity=strategy.l2_sensitivity),
                      "out": args.out}))
    return 0
