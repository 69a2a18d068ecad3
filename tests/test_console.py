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


PROGRESS_SCRIPT = """
import io, sys
from sage_tfx import console
stream = io.StringIO()  # not a terminal: occasional lines, no live bar
with console.progress("DPTrainer DP-SGD, 2 epoch(s)", 200, stream=stream) as bar:
    for done in range(1, 201):
        bar.update(done)
sys.stdout.write(stream.getvalue())
sys.exit(1 if 'tensorflow' in sys.modules else 0)
"""


def run_progress(**environment):
    env = {k: v for k, v in os.environ.items() if k != "SAGE_TFX_QUIET"}
    env.update(environment)
    return subprocess.run([sys.executable, "-c", PROGRESS_SCRIPT], capture_output=True,
                          text=True, env=env, timeout=120)


def test_progress_without_a_terminal_prints_public_step_counts_only():
    result = run_progress()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"sage-tfx: DPTrainer DP-SGD, 2 epoch(s): {done}/200 steps" for done in (50, 100, 150, 200)]
    assert "\r" not in result.stdout and "loss" not in result.stdout


def test_quiet_silences_the_progress():
    result = run_progress(SAGE_TFX_QUIET="1")
    assert result.returncode == 0 and result.stdout == ""


def test_progress_on_a_terminal_is_a_live_bar_of_steps(monkeypatch):
    import io

    from sage_tfx import console

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("SAGE_TFX_QUIET", raising=False)
    terminal = Terminal()
    with console.progress("DPTrainer DP-SGD, 1 epoch(s)", 30, stream=terminal) as bar:
        for done in range(1, 31):
            bar.update(done)
    assert "\r" in terminal.getvalue() and "30/30" in terminal.getvalue()
    assert "sage-tfx: DPTrainer DP-SGD, 1 epoch(s): 30/30 steps\n" not in terminal.getvalue()


def test_a_resumed_task_prints_only_the_marks_after_its_start():
    import io

    from sage_tfx.console import progress

    stream = io.StringIO()
    with progress("continual release", 8, unit="trigger", stream=stream, start=4) as bar:
        for done in range(5, 9):
            bar.update(done)
    assert stream.getvalue().splitlines() == [
        "sage-tfx: continual release: 6/8 triggers", "sage-tfx: continual release: 8/8 triggers"]


def test_a_line_goes_to_stderr_as_it_is_when_written(capsys):
    """install() runs once per process; a later test's captured stderr (or a redirect) must
    still get every line: the handler does not keep the stderr it was installed with."""
    import io
    import sys

    from sage_tfx import console
    console.report("first")
    replaced, sys.stderr = sys.stderr, io.StringIO()
    try:
        console.report("second %d", 2)
        assert sys.stderr.getvalue() == "sage-tfx: second 2\n"
    finally:
        sys.stderr = replaced
    console.report("third")
    assert "sage-tfx: third" in capsys.readouterr().err
