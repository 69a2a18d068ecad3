"""`make mutation`: cosmic-ray mutation testing of the privacy-critical modules, run by hand.

Each module is mutated in a private copy of the repository (out/mutation/<name>/sage_tfx, put first
on PYTHONPATH), never in the working tree, so an interrupted run leaves no mutant behind and other
work can go on meanwhile. Each module runs only the fast tests that guard it, with a per-mutant
timeout (a timed-out mutant counts as killed, and is reported apart). A module with more mutants
than --max-mutants is sampled with a fixed seed and the report says so.

    .venv/bin/python mutation/run.py [--only NAME ...] [--max-mutants N]

Writes out/mutation/<name>.sqlite (the cosmic-ray session), out/mutation/<name>.survivors.txt (the
diff of every surviving mutant) and out/mutation/summary.json; docs/mutation.md reports them.
"""
import argparse
import json
import random
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "mutation"
BIN = Path(sys.executable).parent

# name, module paths (relative to the root), pytest arguments selecting the tests that guard them,
# per-mutant timeout (seconds). The validators' 35 s Laplace-scale test is left out of their run
# (it would triple the time per mutant); the other validator tests check the scales' effects.
MODULES = [
    ("slaed", ["validators/slaed.py"],
     ["tests/validators/test_slaed.py", "-k", "not test_noise_has_the_stated_laplace_scales"], 240),
    ("mechanisms", ["mechanisms/additive.py", "mechanisms/release.py"],
     ["tests/mechanisms/test_additive.py"], 90),
    ("dp_analyzers", ["components/dp_transform/analyzers.py"],
     ["tests/components/test_dp_transform.py"], 300),
    ("sampling_accounting", ["components/oblivious_sample_gen/accounting.py"],
     ["tests/components/test_oblivious_sampling.py", "-k",
      "accounting or epsilon or size or descriptor or truncation"], 300),
    ("calibrate", ["components/dp_trainer/calibrate.py"],
     ["tests/components/test_dp_trainer.py", "-k", "calibrat"], 300),
    ("adassp", ["components/dp_trainer/adassp.py"],
     ["tests/components/test_dp_trainer.py", "-k", "adassp"], 300),
    ("allocation", ["sage_access/allocation.py"], ["tests/sage_access/test_allocation.py"], 90),
    ("ledger_accounting", ["sage_access/accounting.py"],
     ["tests/sage_access/test_accounting.py", "tests/sage_access/test_allocation.py"], 90),
    # The Beam conformance tests are left out (DirectRunner start-up per mutant); the local
    # engine runs the same aggregators.py.
    ("dp_aggregation", ["dp_statistics/aggregation/aggregators.py",
                        "dp_statistics/aggregation/budget.py"],
     ["tests/dp_statistics/aggregation", "-k", "not beam and not engines"], 120),
]

# Operators left out: swaps to bitwise/modulo operators and to identity comparisons (`is`), and
# unary `~`: on floats and arrays they crash at once, so they add run time and no information.
EXCLUDED_OPERATORS = [
    r"core/ReplaceBinaryOperator_.*_(Mod|FloorDiv|RShift|LShift|BitOr|BitAnd|BitXor)$",
    r"core/ReplaceBinaryOperator_(RShift|LShift|BitOr|BitAnd|BitXor)_.*",
    r"core/ReplaceComparisonOperator_(Eq|NotEq|Lt|LtE|Gt|GtE)_(Is|IsNot)$",
    r"core/ReplaceUnaryOperator_.*Invert.*",
]
SAMPLE_SEED = 20240524


def copy_tree(copy):
    """Refresh the private copy the mutants are written into."""
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
        ".venv", ".git", "out", "__pycache__", ".pytest_cache", ".hypothesis", "*.egg-info"))


def write_config(name, copy, modules, tests, timeout):
    # `nice`: the machine is shared; `-B`: no stale bytecode between two mutants of one file.
    command = (f"nice -n 10 env PYTHONPATH={copy.parent} {BIN}/python -B -m pytest -x -q "
               f"-p no:cacheprovider -m 'not slow' --rootdir {copy} {shlex.join(tests)}")
    paths = ", ".join(f'"{copy / m}"' for m in modules)
    excluded = ", ".join(f"'{e}'" for e in EXCLUDED_OPERATORS)
    config = OUT / f"{name}.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f"module-path = [{paths}]\n"
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        f'test-command = "{command}"\n\n'
        "[cosmic-ray.distributor]\n"
        'name = "local"\n\n'
        "[cosmic-ray.filters.operators-filter]\n"
        f"exclude-operators = [{excluded}]\n")
    return config


def sample(session, max_mutants):
    """Mark all but a seeded random sample of max_mutants pending mutants as skipped."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult
    with use_db(str(session), WorkDB.Mode.open) as db:
        pending = sorted(item.job_id for item in db.pending_work_items)
        if max_mutants <= 0 or len(pending) <= max_mutants:
            return len(pending), len(pending)
        keep = set(random.Random(SAMPLE_SEED).sample(pending, max_mutants))
        dropped = [job for job in pending if job not in keep]
        db.set_multiple_results(dropped, WorkResult(output="not sampled",
                                                    worker_outcome=WorkerOutcome.SKIPPED))
        return len(pending), max_mutants


def summarize(name, session, generated, sampled):
    """Count outcomes and write the surviving mutants' diffs."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome
    counts = {"generated": generated, "run": 0, "killed": 0, "timeout": 0, "survived": 0,
              "incompetent": 0}
    survivors = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            counts["run"] += 1
            if result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                mutation = item.mutations[0]
                survivors.append(f"### {mutation.operator_name} line {mutation.start_pos[0]}\n"
                                 f"{result.diff}\n")
            elif result.test_outcome == TestOutcome.KILLED:
                counts["timeout" if result.output == "timeout" else "killed"] += 1
            else:
                counts["incompetent"] += 1
    scored = counts["killed"] + counts["timeout"] + counts["survived"]
    counts["score"] = round((counts["killed"] + counts["timeout"]) / scored, 3) if scored else None
    counts["sampled"] = sampled
    (OUT / f"{name}.survivors.txt").write_text("\n".join(survivors))
    return counts


def report(name):
    """Recount a session that exists; a stopped run's pending mutants count as not run."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome
    session = OUT / f"{name}.sqlite"
    if not session.exists():
        return
    with use_db(str(session), WorkDB.Mode.open) as db:
        filtered = sum(1 for _, r in db.results if r.output == "Filtered operator")
        not_sampled = sum(1 for _, r in db.results if r.output == "not sampled")
        generated = db.num_work_items - filtered
        sampled = generated - not_sampled
    counts = summarize(name, session, generated, sampled)
    counts["sampled"] = sampled
    summary_path = OUT / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary[name] = counts
    summary_path.write_text(json.dumps(summary, indent=1, sort_keys=True))
    print(name, counts, flush=True)


def run(cmd, cwd):
    subprocess.run([str(c) for c in cmd], check=True, cwd=cwd)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="module names to run (default: all)")
    parser.add_argument("--max-mutants", type=int, default=20,
                        help="sample this many mutants per module (0: run all)")
    parser.add_argument("--recheck", action="store_true",
                        help="re-run only the surviving mutants of the existing sessions against "
                             "the current tests (after adding tests that should kill them)")
    parser.add_argument("--report", action="store_true",
                        help="only recount the existing sessions (e.g. after stopping a run)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, modules, tests, timeout in MODULES:
        if args.only and name not in args.only:
            continue
        if args.report:
            report(name)
            continue
        copy = OUT / name / "sage_tfx"
        copy_tree(copy)
        config = write_config(name, copy, modules, tests, timeout)
        session = OUT / f"{name}.sqlite"
        if args.recheck:
            with sqlite3.connect(session) as db:  # survivors become pending again
                db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")
        else:
            run([BIN / "cosmic-ray", "init", config, session, "--force"], copy)
            run([BIN / "cr-filter-operators", session, config], copy)
            generated, sampled = sample(session, args.max_mutants)
            print(f"{name}: {generated} mutants after the operator filter, running {sampled}",
                  flush=True)
        run([BIN / "cosmic-ray", "baseline", config], copy)
        run([BIN / "cosmic-ray", "exec", config, session], copy)
        report(name)


if __name__ == "__main__":
    main()
