"""`sage-tfx workload-answer`: a workload of counting queries answered from granted blocks.

In the CLI package, not in `matrix`: importing anything inside `matrix` runs its __init__, which
loads the mechanisms (OpenDP, dp-accounting), and `sage-tfx` builds every command's parser on
each run, so `sage-tfx ledger show` would pay for them. It never imports TensorFlow (a block of
BlockExampleGen's Examples does, when one is granted).

    sage-tfx workload-answer --store S (--window W | --blocks IDS) --epsilon E --delta D
                             --spec SPEC.json --out FILE.csv [--context C] [--pipeline P]

Order (docs/architecture.md, "the release protocol"): the spec, the budget and the output path
are checked and the strategy chosen (data independent) before anything is charged; then ONE grant of
(E, D) is charged on the blocks, all or nothing, recording the Gaussian event that will run;
then the blocks' records are read (BlockExampleGen's Examples, or the rows of a table that
`sage-tfx ingest` registered: of each unit's rows in the granted blocks one is kept, chosen at
random, since the table's promise is per unit; executor.granted_histogram), the histogram built
(spec.py's record rule), the matrix mechanism run, and FILE.csv written (query, noisy answer,
expected RMSE). The last stdout line is one JSON object: grant, blocks, epsilon, delta, queries,
expected_rmse, strategy (the family chosen: selection.py), event, unit and guarantee (what one neighbouring step adds or removes: the
table's unit column, or one record of Examples). Nothing data-dependent is printed except the
mechanism's output.

Exit codes: as every sage-tfx command (cli/common.py; `sage-tfx --help` lists them).
"""
from __future__ import annotations

import argparse
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
    from sage_tfx import release
    from sage_tfx.dp_statistics.matrix import UnsupportedWorkload, best_strategy, mechanism
    from sage_tfx.dp_statistics.matrix.granted import (answers_table, granted_histogram,
                                                       mechanism_text, planned_event)
    from sage_tfx.dp_statistics.matrix.spec import parse_spec
    from sage_tfx.dp_statistics.matrix.workload import DomainError
    from sage_tfx.sage_access.errors import BadRequest
    from sage_tfx.sage_access.ledger import BlockIds, RecentWindow

    if not args.out.endswith(".csv") or not os.path.isdir(os.path.dirname(args.out) or "."):
        raise BadRequest(f"--out must be a .csv file in an existing directory, got {args.out!r}")
    if not (math.isfinite(args.epsilon) and args.epsilon > 0 and 0 < args.delta < 1):
        raise BadRequest(f"--epsilon must be positive and --delta in (0, 1), got "
                         f"{args.epsilon!r}, {args.delta!r}")
    try:
        with open(args.spec) as handle:
            spec_text = handle.read()
        spec = parse_spec(spec_text)
        strategy = best_strategy(spec.workload).strategy  # a candidate supports the workload
    except (OSError, DomainError, UnsupportedWorkload, ValueError) as error:
        raise BadRequest(f"workload spec {args.spec}: {error}") from None
    selector = (BlockIds([b for b in args.blocks.split(",") if b]) if args.blocks is not None
                else RecentWindow(args.window))
    ledger = open_ledger(args)
    # require_data: a block without data is refused inside the grant's transaction, uncharged.
    plan = release.ReleasePlan.single_step(
        "sage-tfx workload-answer", spec_text, STEP, args.epsilon, args.delta,
        planned_event(args.epsilon, args.delta), pipeline=args.pipeline, require_data=True)
    with release.charge(ledger, plan, selector) as charged:
        charged.share(STEP)
        charged.phase = "reading the granted blocks"
        granted = granted_histogram(spec, ledger, charged.grant.blocks)
        charged.phase = "answering the workload"
        answered = mechanism.answer_workload(spec.workload, strategy, granted.vector,
                                             epsilon=args.epsilon, delta=args.delta)
        (unit, unit_column), *other_units = granted.units
        guarantee = charged.guarantee(unit, unit_column, mechanism_text(strategy),
                                      other_units=other_units)
        charged.phase = "writing the answers"
        release.write_csv(answers_table(spec.workload.labels(), answered), args.out, guarantee)
        charged.released([os.path.abspath(args.out)], guarantee)
    print(json.dumps({"grant_id": charged.grant.grant_id, "blocks": list(charged.grant.blocks),
                      "epsilon": args.epsilon, "delta": args.delta,
                      "queries": spec.workload.query_count,
                      "expected_rmse": answered.expected_rmse, "strategy": strategy.name,
                      "event": str(answered.event), "unit": guarantee.neighbours,
                      "guarantee": guarantee.sentence(), "out": args.out}))
    return 0
