"""`make breaks`: deliberate breaks of the release rules, each with the behavioural tests that
must catch it (issue 45 item 8: a break of DP-SQLP's last trigger failed only pinned digests).

cosmic-ray (run.py) mutates operators at random; these are the rules written down one by one, each
as an edit of one place of the code (the exact text it replaces, found exactly once, so a break
that no longer applies after a refactoring is reported, never skipped) and the tests that guard
it, none of them a pinned digest. Each break is applied in a private copy of the repository
(out/mutation/breaks/sage_tfx, as run.py's copies), never in the working tree; its tests must
fail (pytest exit 1). The tests first run on the unbroken copy and must pass.

    .venv/bin/python mutation/breaks.py [--only NAME ...] [--list] [--show]

Exit 0 when every break was caught; otherwise the breaks not caught (or no longer applying) are
printed and the exit code is 1.
"""
import argparse
import shlex
import subprocess
import sys
from typing import NamedTuple

from run import BIN, OUT, copy_tree

RULES = "tests/dp_statistics/continual/test_release_rules.py"
OPERATOR_TESTS = "tests/dp_statistics/continual/test_operator.py"
# Aggregation: every behavioural test of the operator on the local engine (the Beam conformance
# tests are left out, as run.py's dp_aggregation does), never the digests of a fixed-seed release.
AGGREGATION = ["tests/dp_statistics/aggregation", "-k", "not beam and not engines",
               "--ignore=tests/dp_statistics/aggregation/test_fixed_seed_release.py"]


class Break(NamedTuple):
    name: str
    rule: str  # the rule the break violates
    path: str  # relative to the repository root
    old: str  # exact text, found exactly once
    new: str
    tests: list  # pytest arguments (relative to the root): they must fail


OP, BEAM = "dp_statistics/continual/operator.py", "dp_statistics/continual/beam.py"
BREAKS = [
    # -- DP-SQLP (dp_statistics/continual) ------------------------------------------------------
    Break("final-pane-releases-every-evaluated-key",
          "the last trigger releases again only the keys released before (the lead's break; "
          "both engines run operator.evaluate_keys)",
          OP, "    chosen = evaluated[selected]\n",
          "    selected |= t == micro_batches\n    chosen = evaluated[selected]\n", [RULES]),
    Break("no-final-pane",
          "every key released before is released again at the last trigger with all its records",
          OP, "return np.where(final, micro_batches, due).astype(np.int64)",
          "return due.astype(np.int64)", [RULES]),
    Break("a-key-not-released-anew-drops-out",
          "a key once released stays in every later release with its latest number",
          OP, '    columns["released_value"][releasing] = released_values(',
          '    columns["released_value"][:] = np.nan\n'
          '    columns["released_value"][releasing] = released_values(', [RULES]),
    Break("beam-histogram-forgets-earlier-releases",
          "the same rule in the Beam engine's per-trigger release (histograms)",
          BEAM, "released.update({u.key: u.value for u in by_step.get(step, [])})",
          "released = {u.key: u.value for u in by_step.get(step, [])}", [RULES, "-k", "beam"]),
    Break("selected-a-trigger-early",
          "a key is selected at t iff its round count exceeds R(t - origin), not a later leaf's",
          OP, "selected = first == local", "selected = first <= local + 1", [RULES]),
    Break("threshold-plus-noise",
          "R(l) = tau_l - Z(l): the required count is the threshold less the tree's noise",
          "dp_statistics/continual/tree.py",
          "out[miss] = np.where(inside, taus - np.nan_to_num(z), np.inf)",
          "out[miss] = np.where(inside, taus + np.nan_to_num(z), np.inf)", [RULES]),
    Break("a-unit-counts-at-every-step",
          "a unit counts once per (key, round), not once per step it has records",
          OP, 'fresh = state.pairs.count_once(pairs, state.columns["round"][pair_keys])',
          "fresh = np.ones(len(pairs), dtype=bool)", [RULES, "-k", "local"]),
    Break("beam-a-unit-counts-at-every-step",
          "the same rule in the Beam engine's stage 4",
          BEAM, 'fresh = data.previous.steps <= columns["origin"][rows_of]',
          "fresh = np.ones(len(rows_of), dtype=bool)", [RULES, "-k", "beam"]),
    Break("a-new-round-keeps-the-count",
          "a selected key starts a new round whose count starts at 0 (both engines)",
          OP, '    columns["count"][chosen] = 0\n', "", [RULES]),
    Break("no-prediction",
          "a key without records is evaluated at its predicted crossing (Algorithm 4)",
          OP, "evaluated = sorted_unique(np.concatenate([touched, state.take_due(t)]))",
          "evaluated = touched", [RULES, "-k", "local"]),
    Break("beam-no-prediction",
          "the same rule in the Beam engine's stage 4 (a timer at the predicted step)",
          BEAM, "evaluated = sorted_unique(np.concatenate(touched + [predicted]))",
          "evaluated = sorted_unique(np.concatenate(touched + [predicted[:0]]))",
          [RULES, "-k", "beam"]),
    Break("prediction-a-trigger-late",
          "a new round's predicted release is its first crossing, not the trigger after",
          OP, "return rows, np.where(first == NEVER, NEVER, step + first).astype(np.int64)",
          "return rows, np.where(first == NEVER, NEVER, step + first + 1).astype(np.int64)",
          [RULES]),
    Break("c-plus-one-records",
          "a unit's first C records of the window are kept, and no more",
          OP, "return rank < limit - used[units]", "return rank <= limit - used[units]",
          [RULES]),
    Break("a-dropped-record-makes-a-key",
          "only kept records make a key appear (its noise streams follow its code)",
          OP, "    known = state.n_keys\n",
          "    known = state.n_keys\n"
          "    state.keys.encode(clean_batch(batch, query.statistic, grid, bound)[1])\n",
          [RULES, "-k", "local"]),
    Break("values-not-clamped",
          "a value counts clamped to [-L, L], a value that is not finite as 0",
          OP, "    return units, keys, np.clip(round_to_grid(values, grid), -bound, bound)",
          "    return units, keys, round_to_grid(np.nan_to_num(pd.to_numeric(\n"
          '        batch["value"], errors="coerce").to_numpy(np.float64)[valid], posinf=0.0,\n'
          "        neginf=0.0), grid)", [RULES]),
    Break("values-off-the-grid",
          "a record's value is rounded to the release grid before it counts",
          OP, "np.clip(round_to_grid(values, grid), -bound, bound)",
          "np.clip(values, -bound, bound)", [RULES]),
    Break("noise-off-the-grid",
          "the released value is the true prefix plus its noise rounded to the grid",
          OP, "return released_true + round_to_grid(noise_at, grid)",
          "return released_true + noise_at", [RULES]),
    # -- DP SQL aggregation (dp_statistics/aggregation) -----------------------------------------
    Break("laplace-selection-keeps-every-candidate",
          "Laplace thresholding keeps a partition iff its noisy unit count reaches tau",
          "mechanisms/selection.py", "keep = noisy.value >= tau", "keep = noisy.value > -tau",
          AGGREGATION),
    Break("gaussian-selection-keeps-every-candidate",
          "Gaussian thresholding keeps a partition iff its noisy unit count exceeds tau",
          "mechanisms/selection.py", "keep = noisy.value > tau", "keep = noisy.value > -tau",
          AGGREGATION),
    Break("aggregation-a-dropped-partition-is-a-candidate",
          "a partition is a selection candidate only if some unit's kept pair is in it",
          "dp_statistics/aggregation/aggregators.py",
          "contributed = accumulators[:, Layout.UNITS] > 0",
          "contributed = accumulators[:, Layout.UNITS] >= 0", AGGREGATION),
]


def pytest(copy, tests, show=False) -> int:
    # As run.py: `nice` on the shared machine, `-B` so no stale bytecode outlives a break.
    command = (f"nice -n 10 env PYTHONPATH={copy.parent} {BIN}/python -B -m pytest -x -q "
               f"-p no:cacheprovider -m 'not slow' --rootdir {copy} {shlex.join(tests)}")
    quiet = None if show else subprocess.DEVNULL
    return subprocess.run(command, shell=True, cwd=copy, stdout=quiet, stderr=quiet).returncode


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="break names to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the breaks and their rules")
    parser.add_argument("--show", action="store_true", help="print each pytest run's output")
    args = parser.parse_args()
    chosen = [b for b in BREAKS if not args.only or b.name in args.only]
    if args.list:
        for item in chosen:
            print(f"{item.name}: {item.rule} ({item.path})")
        return 0
    copy = OUT / "breaks" / "sage_tfx"
    copy_tree(copy)
    for tests in sorted({tuple(b.tests) for b in chosen}):
        if pytest(copy, list(tests), args.show) != 0:
            print(f"the tests fail without any break: {shlex.join(tests)}", flush=True)
            return 1
    missed = []
    for item in chosen:
        path = copy / item.path
        original = path.read_text()
        if original.count(item.old) != 1:
            missed.append(f"{item.name}: no longer applies ({item.path} holds its text "
                          f"{original.count(item.old)} times)")
            continue
        path.write_text(original.replace(item.old, item.new))
        try:
            code = pytest(copy, item.tests, args.show)
        finally:
            path.write_text(original)
        outcome = {0: "NOT CAUGHT", 1: "caught"}.get(code, f"pytest exit {code}")
        print(f"{item.name}: {outcome}", flush=True)
        if code != 1:
            missed.append(f"{item.name}: {outcome} by {shlex.join(item.tests)}")
    for line in missed:
        print(line)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
