"""sage_tfx.console: outcome lines shown by default, hidden by SAGE_TFX_QUIET, and TFX's repeated
warnings dropped once sage_tfx.components is imported (without importing TensorFlow)."""
import os
import subprocess
import sys

SCRIPT = """
import logging, sys
import sage_tfx.components  # installs the console
from absl import logging as absl_logging
from sage_tfx import console
absl_logging.warning('ArtifactQuery.property_predicate is not supported.')
absl_logging.warning('AutoGraph could not transform <function f> and will run it as-is.')
absl_logging.warning('a warning users should see')
console.report('DPTrainer epoch %d/%d: epsilon spent %.4g of %.4g', 1, 2, 0.25, 0.5)
sys.exit(1 if 'tensorflow' in sys.modules else 0)
"""


def run(**environment):
    env = {k: v for k, v in os.environ.items() if k != "SAGE_TFX_QUIET"}
    env.update(environment)
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=120)


def test_outcome_lines_are_shown_and_noise_is_not():
    result = run()
    assert result.returncode == 0, result.stderr
    assert "sage-tfx: DPTrainer epoch 1/2: epsilon spent 0.25 of 0.5" in result.stderr
    assert "a warning users should see" in result.stderr
    assert "property_predicate" not in result.stderr and "AutoGraph" not in result.stderr


def test_quiet_hides_the_outcome_lines():
    result = run(SAGE_TFX_QUIET="1")
    assert result.returncode == 0
    assert "sage-tfx:" not in result.stderr and "a warning users should see" in result.stderr
