"""`sage-tfx audit MECHANISM [--trials N] [--confidence C] [--json]`: an empirical
lower bound on a shipped mechanism's epsilon (sage_tfx.audit.bounds). MECHANISM `all` audits each.

Prints, per mechanism, {"mechanism", "claimed_epsilon", "claimed_delta", "epsilon_lower_bound",
"confidence", "trials"} (one JSON object per line with --json). Exit code 0 when every lower bound
is at most its claim, 6 when one exceeds it (the mechanism leaks more than it claims, with
probability >= confidence: a finding, not an internal error), 2 for bad input (cli/common.py).
"""
from __future__ import annotations

import argparse
import json
import sys

from sage_tfx.cli.common import EXIT_AUDIT_FAILED, EXIT_BAD_INPUT, quiet_tensorflow


def add_parser(groups: argparse._SubParsersAction) -> None:
    parser = groups.add_parser("audit", help="empirical lower bound on a mechanism's epsilon",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mechanism", help="a shipped mechanism's name, or `all`")
    parser.add_argument("--trials", type=int, default=20_000,
                        help="runs on each of the two neighbouring inputs (default 20000)")
    parser.add_argument("--confidence", type=float, default=0.95,
                        help="confidence of each lower bound (default 0.95)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per mechanism instead of a sentence")
    parser.set_defaults(run=_audit)


def _audit(args) -> int:
    quiet_tensorflow()  # the DP-SGD adapter runs TensorFlow
    from sage_tfx.audit import mechanisms

    audits = mechanisms.shipped()
    names = list(audits) if args.mechanism == "all" else [args.mechanism]
    unknown = [name for name in names if name not in audits]
    if unknown:
        print(f"sage-tfx audit: unknown mechanism {unknown[0]!r}; choose one of "
              f"{', '.join(audits)} or all", file=sys.stderr)
        return EXIT_BAD_INPUT
    leaked = False
    for name in names:
        try:
            result = audits[name].run(args.trials, args.confidence)
        except ValueError as error:
            print(f"sage-tfx audit: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
        leaked |= result.epsilon_lower_bound > result.claimed_epsilon
        if args.json:
            print(json.dumps(result.as_dict()), flush=True)
        else:
            print(f"{name} ({audits[name].description}): claimed (epsilon "
                  f"{result.claimed_epsilon:.4g}, delta {result.claimed_delta:.3g}); "
                  f"epsilon >= {result.epsilon_lower_bound:.4f} "
                  f"with confidence {result.confidence} over {result.trials} runs per input",
                  flush=True)
    return EXIT_AUDIT_FAILED if leaked else 0
