"""What every `sage-tfx` command shares: one map of exit codes, documented once, and a quiet
TensorFlow for the commands that need it."""
import re
import subprocess
import sys

from sage_tfx.cli import common, main


def test_the_exit_codes_are_documented_once_in_the_top_level_help(capsys):
    try:
        main(["--help"])
    except SystemExit:
        pass
    text = capsys.readouterr().out
    for name, code in vars(common).items():
        if name.startswith("EXIT_") and isinstance(code, int):
            assert re.search(rf"^  {code} ", text, re.MULTILINE), (name, code)


def test_tensorflow_starts_without_its_oneDNN_and_CUDA_lines():
    code = ("from sage_tfx.cli.common import quiet_tensorflow; quiet_tensorflow(); "
            "import sys; assert 'tensorflow' in sys.modules")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert "oneDNN" not in completed.stderr and "cuda" not in completed.stderr.lower()
    assert completed.stderr == ""
