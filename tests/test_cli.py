"""The `sage-tfx ledger` contract other tools depend on: arguments, JSON, exit codes."""
import json
import subprocess
import sys

import pytest

from sage_tfx.cli import main


def ledger(store, *args):
    result = subprocess.run([sys.executable, "-m", "sage_tfx.cli", "ledger", "--store", store, *args],
                            capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout, result.stderr


@pytest.fixture
def populated(store_path):
    assert ledger(store_path, "init", "--min-request", "0.1")[0] == 0
    for month in ("2024-01", "2024-02", "2024-03"):
        code, out, _ = ledger(store_path, "add-block", month, "--epsilon", "1", "--delta", "1e-6",
                              "--start", f"{month}-01")
        assert code == 0, out
    return store_path


def test_request_prints_json_and_exit_codes(populated):
    code, out, _ = ledger(populated, "request", "--window", "2", "--epsilon", "0.6",
                          "--delta", "1e-7", "--pipeline", "taxi")
    granted = json.loads(out)
    assert code == 0
    assert granted["granted"] is True and granted["blocks"] == ["2024-03", "2024-02"]
    assert granted["epsilon"] == 0.6 and granted["delta"] == 1e-7 and len(granted["grant_id"]) == 32

    code, out, err = ledger(populated, "request", "--blocks", "2024-02,2024-01", "--epsilon", "0.6",
                            "--delta", "0")
    denied = json.loads(out)
    assert code == 3 and denied["granted"] is False and denied["grant_id"] is None
    assert "2024-02" in err and "0.4" in err  # names the block and what it has left

    for bad in (["--blocks", "2024-01", "--epsilon", "nan", "--delta", "0"],
                ["--blocks", "2024-01", "--epsilon", "-1", "--delta", "0"],
                ["--blocks", "2024-01", "--epsilon", "0.1", "--delta", "1"],
                ["--blocks", "2099-01", "--epsilon", "0.1", "--delta", "0"],
                ["--window", "0", "--epsilon", "0.1", "--delta", "0"]):
        code, out, _ = ledger(populated, "request", *bad)
        assert code == 2, bad
        assert json.loads(out)["granted"] is False

    code, out, _ = ledger(populated, "show", "--json")
    rows = {row["id"]: row for row in json.loads(out)["blocks"]}
    assert code == 0
    assert rows["2024-01"]["epsilon_spent"] == 0 and rows["2024-01"]["charges"] == 0
    assert rows["2024-02"]["epsilon_spent"] == 0.6 and rows["2024-02"]["delta_spent"] == 1e-7
    assert set(rows["2024-03"]) >= {"id", "epsilon_ceiling", "delta_ceiling", "epsilon_spent",
                                    "delta_spent", "retired", "charges"}


def test_show_table_and_plot(populated, tmp_path):
    code, out, _ = ledger(populated, "show")
    assert code == 0 and "2024-03" in out and "live" in out
    png = tmp_path / "ledger.png"
    assert ledger(populated, "plot", "--out", str(png))[0] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_store_and_duplicate_init_are_bad_input(store_path, tmp_path):
    code, _, err = ledger(str(tmp_path / "absent.sqlite"), "show")
    assert code == 2 and "init" in err
    assert not (tmp_path / "absent.sqlite").exists()
    assert ledger(store_path, "init")[0] == 0
    assert ledger(store_path, "init")[0] == 2


def test_ledger_cli_does_not_import_tensorflow(populated, capsys):
    assert main(["ledger", "--store", populated, "show", "--json"]) == 0
    capsys.readouterr()
    code = ("import sys; from sage_tfx.cli import main; "
            f"main(['ledger', '--store', {populated!r}, 'show']); "
            "sys.exit(1 if 'tensorflow' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
