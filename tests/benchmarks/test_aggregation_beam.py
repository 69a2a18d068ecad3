"""benchmarks/aggregation.py --engine beam: the Beam engine against the local engine on the same
data, with the figures docs/running-at-scale.md reports (throughput, fixed cost, CPU per
process)."""
import json
import os
import subprocess
import sys

import pytest

from support import REPO_ROOT


@pytest.mark.slow  # two Beam jobs
def test_the_beam_mode_reports_both_engines_on_the_same_rows():
    completed = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "aggregation.py"), "--engine",
         "beam", "--runner", "direct", "--workers", "1", "--rows", "20000", "--no-pipeline-dp",
         "--json"],
        capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert (report["rows"], report["runner"], report["workers"]) == (20000, "direct", 1)
    for engine in ("beam", "local"):
        assert report[engine]["rows_per_second"] > 0
    assert report["beam"]["fixed_seconds"] > 0
    assert set(report["beam"]["cpu_seconds_by_process"]) == {"driver", "workers"}
    assert report["beam"]["cpu_seconds"] == pytest.approx(
        sum(report["beam"]["cpu_seconds_by_process"].values()))
    assert report["beam_over_local"] == pytest.approx(
        report["beam"]["rows_per_second"] / report["local"]["rows_per_second"])
