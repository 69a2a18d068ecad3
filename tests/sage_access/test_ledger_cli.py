"""The `sage-tfx ledger` contract other tools and users depend on: arguments, JSON, exit codes,
and that no command harms a file that is not a ledger. Every test runs the console script."""
import argparse
import json
import os
import re
import sqlite3
import struct
import subprocess
import sys

import pytest

from sage_tfx.sage_access import BlockLedger

from support import REPO_ROOT
from support.stores import execute_sql

CLI = [sys.executable, "-m", "sage_tfx.cli"]


def run(*args, env=None, **kwargs):
    environment = {k: v for k, v in os.environ.items() if k != "SAGE_TFX_LEDGER_STORE"}
    environment.update(env or {})
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120,
                            env=environment, **kwargs)
    return result.returncode, result.stdout, result.stderr


def ledger(store, *args, **kwargs):
    return run("ledger", "--store", store, *args, **kwargs)


def assert_one_line_error(err):
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


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
                ["--blocks", "2024-01", "--epsilon", "0.1"],
                ["--blocks", "2099-01", "--epsilon", "0.1", "--delta", "0"],
                ["--window", "0", "--epsilon", "0.1", "--delta", "0"],
                ["--window", "two", "--epsilon", "0.1", "--delta", "0"],
                ["--epsilon", "0.1", "--delta", "0"]):
        code, out, err = ledger(populated, "request", *bad)
        assert code == 2, bad
        assert json.loads(out)["granted"] is False
        assert "Traceback" not in err

    code, out, _ = ledger(populated, "show", "--json")
    rows = {row["id"]: row for row in json.loads(out)["blocks"]}
    assert code == 0
    assert rows["2024-01"]["epsilon_spent"] == 0 and rows["2024-01"]["charges"] == 0
    assert rows["2024-02"]["epsilon_spent"] == 0.6 and rows["2024-02"]["delta_spent"] == 1e-7


def _application_database(path):
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    connection.execute("INSERT INTO users VALUES (1, 'ada')")
    connection.commit()
    connection.close()


@pytest.mark.slow
def test_no_command_changes_a_file_that_is_not_a_ledger(tmp_path, store_path):
    """Section 1: an application database, an empty file, a truncated ledger, a directory, and
    an ML Metadata store without a ledger are refused by every command and stay byte-for-byte
    as they were (MLMD used to add its ~30 tables to them)."""
    if store_path.startswith("mysql://"):
        pytest.skip("about files that are not a ledger: SQLite only (test_store_mysql.py "
                    "refuses another application's database)")
    app = tmp_path / "app.sqlite"
    _application_database(app)
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    BlockLedger.create(store_path).add_block("b1", 1.0, 1e-6)
    truncated = tmp_path / "truncated.sqlite"
    truncated.write_bytes(open(store_path, "rb").read()[:20000])
    directory = tmp_path / "a-directory"
    directory.mkdir()
    commands = [["show"], ["show", "--json"], ["plot", "--out", str(tmp_path / "p.png")],
                ["grants"], ["audit"], ["contexts"], ["register", "p"], ["finish", "p"],
                ["add-block", "b2", "--epsilon", "1", "--delta", "0"],
                ["request", "--window", "1", "--epsilon", "0.1", "--delta", "0"]]
    for target in (app, empty, truncated, directory):
        before = None if target.is_dir() else target.read_bytes()
        for command in commands + [["init"]] * (target != truncated):
            code, out, err = ledger(str(target), *command)
            assert code == 2, (target, command, err)
            assert_one_line_error(err)
            if command[0] == "request":
                assert json.loads(out)["granted"] is False
        if before is not None:
            assert target.read_bytes() == before, target
        assert sorted(os.listdir(tmp_path)) == sorted(
            ["app.sqlite", "empty.sqlite", "ledger.sqlite", "truncated.sqlite", "a-directory"])


def test_only_init_creates_and_only_at_a_path_or_grpc(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = ledger("absent.sqlite", "show")
    assert code == 2 and "init" in err
    for spec in ("http://localhost:8080", "grpc://nowhere", "grpc://:8080", "file:///x.sqlite"):
        code, _, err = ledger(spec, "init")
        assert code == 2 and spec in err, spec
        assert_one_line_error(err)
    code, _, err = ledger(str(tmp_path / "missing" / "ledger.sqlite"), "init")
    assert code == 2 and "does not exist" in err
    assert os.listdir(tmp_path) == []  # no ./http:/ directory, no store, no parent directory
    assert ledger("ledger.sqlite", "init")[0] == 0
    assert ledger("ledger.sqlite", "init")[0] == 2  # the context exists


def test_unreachable_grpc_store_has_its_own_exit_code():
    code, out, err = ledger("grpc://nowhere.invalid:1", "request", "--window", "1",
                            "--epsilon", "0.1", "--delta", "0")
    assert code == 5 and "unreachable" in err
    assert json.loads(out)["granted"] is False
    assert_one_line_error(err)
    assert ledger("grpc://nowhere.invalid:1", "show")[0] == 5


def test_show_separates_spent_reserved_and_free(store_path):
    """Section 2, the issue's case: p1 spent 0.3 of a block reserved for p1 and p2. The block's
    0.7 is reserved (p1 0.2, p2 0.5), none is free, and a grant outside the reservations is
    denied, as the table says."""
    assert ledger(store_path, "init")[0] == 0
    for pipeline in ("p1", "p2"):
        assert ledger(store_path, "register", pipeline)[0] == 0
    assert ledger(store_path, "add-block", "b1", "--epsilon", "1", "--delta", "1e-6")[0] == 0
    assert ledger(store_path, "request", "--blocks", "b1", "--epsilon", "0.3", "--delta", "0",
                  "--pipeline", "p1")[0] == 0
    code, out, _ = ledger(store_path, "show", "--json")
    [row] = json.loads(out)["blocks"]
    assert row["budget"]["spent"] == pytest.approx(0.3)
    assert row["budget"]["reserved"] == pytest.approx({"p1": 0.2, "p2": 0.5})
    assert row["budget"]["free"] == pytest.approx(0.0, abs=1e-12)
    code, out, _ = ledger(store_path, "show")
    line = next(l for l in out.splitlines() if l.startswith("b1"))
    assert "0.3000" in line and "0.7000" in line and "p1 0.2, p2 0.5" in line
    assert ledger(store_path, "request", "--blocks", "b1", "--epsilon", "0.6",
                  "--delta", "0")[0] == 3
    # p2 may draw its own 0.5; finishing p1 returns its 0.2 to p2.
    assert ledger(store_path, "finish", "p1")[0] == 0
    code, out, _ = ledger(store_path, "show", "--json")
    assert json.loads(out)["blocks"][0]["budget"]["reserved"] == pytest.approx({"p2": 0.7})
    assert ledger(store_path, "request", "--blocks", "b1", "--epsilon", "0.7", "--delta", "0",
                  "--pipeline", "p2")[0] == 0


def test_grants_contexts_and_audit(populated):
    assert ledger(populated, "init", "--context", "other")[0] == 0
    assert ledger(populated, "contexts")[1].split() == ["default", "other"]
    ledger(populated, "request", "--window", "2", "--epsilon", "0.25", "--delta", "1e-8",
           "--pipeline", "taxi")
    code, out, _ = ledger(populated, "grants", "--json")
    [grant] = json.loads(out)
    assert code == 0 and grant["pipeline"] == "taxi" and grant["blocks"] == ["2024-03", "2024-02"]
    assert grant["epsilon"] == 0.25 and grant["delta"] == 1e-8 and grant["time_ms"] > 0
    assert "taxi" in ledger(populated, "grants")[1]
    code, out, _ = ledger(populated, "audit")
    assert code == 0 and "agree" in out
    # Tamper with a block's materialised balance behind the ledger's back: audit must say so.
    execute_sql(populated, "UPDATE ArtifactProperty SET string_value = '[0.0, 0.0]' "
                "WHERE name = 'spent' AND artifact_id = (SELECT id FROM Artifact "
                "WHERE name = 'default/2024-03')")
    code, out, _ = ledger(populated, "audit")
    assert code == 6 and "2024-03" in out


def test_rdp_ledger_takes_gaussian_and_pure_requests_and_shows_its_guarantee(store_path):
    assert ledger(store_path, "init", "--accounting", "rdp")[0] == 0
    assert ledger(store_path, "add-block", "b1", "--epsilon", "1", "--delta", "1e-6")[0] == 0
    code, out, _ = ledger(store_path, "request", "--blocks", "b1",
                          "--gaussian-noise-multiplier", "20", "--compositions", "2")
    granted = json.loads(out)
    assert code == 0 and granted["granted"]
    # Gaussian RDP at order a: compositions * a / (2 sigma^2), from dp-accounting.
    assert granted["rdp_curve"][1] == pytest.approx(2 * 2.0 / (2 * 20 ** 2))
    code, out, err = ledger(store_path, "request", "--blocks", "b1", "--epsilon", "0.1",
                            "--delta", "1e-7")
    assert code == 2 and "rdp_curve" in err and "--gaussian-noise-multiplier" in err
    assert ledger(store_path, "request", "--blocks", "b1", "--epsilon", "0.05",
                  "--delta", "0")[0] == 0
    code, out, _ = ledger(store_path, "show", "--json")
    table = json.loads(out)
    assert "ceiling" in table["guarantee"]
    budget = table["blocks"][0]["budget"]
    assert budget["unit"].startswith("share of RDP capacity") and 0 < budget["spent"] < 1
    assert budget["spent"] + budget["free"] == pytest.approx(1.0)
    assert "odometer" not in ledger(store_path, "show")[1]


def _png_size(path):
    width, height = struct.unpack(">II", open(path, "rb").read()[16:24])
    return width, height


@pytest.mark.slow
def test_plot_stays_readable_and_show_survives_a_closed_pipe_at_300_blocks(store_path,
                                                                            tmp_path):
    ledger_api = BlockLedger.create(store_path)
    for index in range(300):
        ledger_api.add_block(f"d{index:03d}", 1.0, 1e-6)
    png = tmp_path / "ledger.png"
    code, out, _ = ledger(store_path, "plot", "--out", str(png))
    assert code == 0 and "300 blocks, 60 bars" in out
    width, _ = _png_size(png)
    assert width <= 1600  # was 0.5 inch per block: 15,200 px for 300 blocks
    for bad, message in ((tmp_path / "missing" / "p.png", "does not exist"),
                         (tmp_path / "p.txt", "must end in")):
        code, _, err = ledger(store_path, "plot", "--out", str(bad))
        assert code == 2 and message in err
        assert not bad.exists() and not (tmp_path / "missing").exists()
    # `show --json | head -1` (about 200 KB, more than a pipe holds): the reader closes the
    # pipe early; no traceback, no error, exit 0.
    result = subprocess.run(f"{' '.join(CLI)} ledger --store {store_path} show --json | head -1;"
                            " exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash",
                            capture_output=True, text=True, timeout=120)
    assert result.stdout == "{\n" and result.stderr == "" and result.returncode == 0


def test_input_validation_names_the_option(populated):
    for args, message in ((["add-block", "x", "--epsilon", "1", "--delta", "0",
                            "--start", "yesterday"], "--start"),
                          (["add-block", "x", "--epsilon", "1", "--delta", "0",
                            "--start", "2024-02-01", "--end", "2024-01-01"], "before --end"),
                          (["init", "--context", "c2", "--min-request", "-1"], "--min-request")):
        code, _, err = ledger(populated, *args)
        assert code == 2 and message in err, err
        assert_one_line_error(err)
    assert "x" not in ledger(populated, "show")[1].split()


def test_store_after_the_command_and_from_the_environment(populated):
    code, out, _ = run("ledger", "show", "--store", populated)
    assert code == 0 and "2024-03" in out
    code, out, _ = run("ledger", "show", env={"SAGE_TFX_LEDGER_STORE": populated})
    assert code == 0 and "2024-03" in out
    code, _, err = run("ledger", "show")
    assert code == 2 and "SAGE_TFX_LEDGER_STORE" in err


def test_version_and_help_on_every_option():
    code, out, _ = run("--version")
    assert code == 0 and out.startswith("sage-tfx 0.")
    code, out, _ = run("--help")
    assert code == 0 and "ledger" in out and "init" in out
    from sage_tfx.cli import main  # every option of every command says what it is for
    parsers = []
    with pytest.raises(SystemExit):
        original = argparse.ArgumentParser.parse_args
        argparse.ArgumentParser.parse_args = lambda self, *a, **k: parsers.append(self) or \
            original(self, *a, **k)
        try:
            main(["--bad-option"])
        finally:
            argparse.ArgumentParser.parse_args = original
    pending, missing = list(parsers), []
    while pending:
        parser = pending.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
            elif not action.help:
                missing.append((parser.prog, action.dest))
    assert not missing


def test_ledger_cli_does_not_import_tensorflow(populated):
    code = ("import sys; from sage_tfx.cli import main; "
            f"main(['ledger', '--store', {populated!r}, 'show']); "
            f"main(['ledger', '--store', {populated!r}, 'plot', '--out', "
            f"{populated + '.png'!r}]); "
            "import sage_tfx, sage_tfx.components, sage_tfx.validators; "
            "sys.exit(1 if 'tensorflow' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_documented_cli_section_matches_the_parser():
    """Every command the CLI section of docs/ledger.md lists exists and every command is listed;
    the exit codes it documents are the ones the CLI uses."""
    from sage_tfx.cli import common
    from sage_tfx.cli import ledger as ledger_cli

    with open(os.path.join(REPO_ROOT, "docs", "ledger.md")) as handle:
        document = handle.read()
    section = document[document.index("## CLI"):]
    listed = set(re.findall(r"sage-tfx ledger --store PATH ([a-z-]+)", section))
    groups = argparse.ArgumentParser().add_subparsers()
    ledger_cli.add_parser(groups)
    [commands] = [a for a in groups.choices["ledger"]._actions
                  if isinstance(a, argparse._SubParsersAction)]
    assert listed == set(commands.choices)
    for code, meaning in ((common.EXIT_BAD_INPUT, "bad input"),
                          (common.EXIT_DENIED, "denied"), (common.EXIT_BUSY, "concurrent"),
                          (common.EXIT_UNREACHABLE, "unreachable"),
                          (common.EXIT_AUDIT_FAILED, "audit"),
                          (common.EXIT_RELEASE_FAILED, "nothing released")):
        assert re.search(rf"{code} [^;]*{meaning}", section), (code, meaning)


@pytest.mark.slow
def test_init_adds_a_ledger_to_an_existing_metadata_store(tmp_path):
    """A pipeline's own ML Metadata store may hold the ledger (grants then show in its lineage)."""
    from sage_tfx.sage_access import connect

    store = str(tmp_path / "metadata.sqlite")
    connect(store)  # what TFX's LocalDagRunner leaves: MLMD's tables, no ledger
    code, _, err = ledger(store, "show")
    assert code == 2 and "without a sage-tfx ledger" in err
    assert ledger(store, "init")[0] == 0
    assert ledger(store, "show")[0] == 0


def _rdp_ledger_with_api_and_cli_grants(store_path):
    """An rdp ledger, p1 and p2 waiting, two blocks; p1's grant made through the Python API with
    a split and DP events (as the BlockLedger component makes it), p2's a CLI Gaussian."""
    import dp_accounting

    from sage_tfx.sage_access import BlockIds
    from sage_tfx.sage_access.accounting import pure_dp_event

    assert ledger(store_path, "init", "--accounting", "rdp")[0] == 0
    for pipeline in ("p1", "p2"):
        assert ledger(store_path, "register", pipeline)[0] == 0
    for block in ("b1", "b2"):
        assert ledger(store_path, "add-block", block, "--epsilon", "1", "--delta", "1e-6")[0] == 0
    training = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(40.0), 3)
    BlockLedger(store_path).request(BlockIds(["b1", "b2"]), epsilon=0.3, delta=1e-7,
                                    pipeline="p1", split={"training": "0.9", "validation": "0.1"},
                                    events={"training": training,
                                            "validation": pure_dp_event(0.03)})
    code, out, _ = ledger(store_path, "request", "--blocks", "b1", "--pipeline", "p2",
                          "--gaussian-noise-multiplier", "20", "--compositions", "2")
    assert code == 0 and json.loads(out)["granted"]


@pytest.mark.slow
def test_rdp_ledger_shows_the_filters_guarantee_after_api_and_cli_grants(store_path, tmp_path):
    """After the merge of the CLI and the grant work: every view of an rdp ledger shows the
    filter's guarantee (the ceiling of a charged block), never a converted spent curve labelled
    as spent epsilon, and spent + reserved + free is the whole capacity at the order shown."""
    _rdp_ledger_with_api_and_cli_grants(store_path)
    code, out, _ = ledger(store_path, "show", "--json")
    table = json.loads(out)
    assert code == 0 and "ceiling" in table["guarantee"]
    for row in table["blocks"]:
        assert "epsilon_spent" not in row and "delta_spent" not in row
        assert (row["guarantee_epsilon"], row["guarantee_delta"]) == (1.0, 1e-6)
        budget = row["budget"]
        assert budget["spent"] + sum(budget["reserved"].values()) + budget["free"] == \
            pytest.approx(1.0)
    b1, b2 = table["blocks"]
    assert 0 < b2["budget"]["spent"] < b1["budget"]["spent"] < 1  # b1 also paid p2's Gaussian
    code, out, _ = ledger(store_path, "show")
    assert code == 0 and "odometer" not in out and "guarantee eps" in out
    line = next(l for l in out.splitlines() if l.startswith("b1"))
    assert f"{100 * b1['budget']['spent']:.1f}" in line and " 1 " in line  # spent %, guarantee
    code, out, err = ledger(store_path, "plot", "--out", str(tmp_path / "rdp.png"))
    assert code == 0 and "share of capacity" in out, err


@pytest.mark.slow
def test_rdp_grants_show_split_and_events_and_denials_name_reservations(store_path):
    _rdp_ledger_with_api_and_cli_grants(store_path)
    code, out, err = ledger(store_path, "grants")
    assert code == 0, err
    api_line, api_split, cli_line, cli_request = out.splitlines()[1:]
    assert cli_request.startswith("    request: --blocks b1")  # the CLI grant's own terms
    assert api_split.startswith("    split: training=0.9: 3x Gaussian(noise_multiplier=40)")
    assert "validation=0.1: zCDP(rho=0.00045)" in api_split
    assert cli_line.split()[3:5] == ["rdp", "-"]  # an RDP curve, no (epsilon, delta)
    code, out, _ = ledger(store_path, "grants", "--json")
    api_grant, cli_grant = json.loads(out)
    assert api_grant["split"] == {"training": "0.9", "validation": "0.1"}
    assert api_grant["events"]["training"]["event"]["noise_multiplier"] == 40.0
    assert cli_grant["rdp_curve"] and cli_grant["events"] == {}
    # No free budget is left on b1: a denial names what is reserved for the other pipelines.
    code, out, err = ledger(store_path, "request", "--blocks", "b1", "--pipeline", "p1",
                            "--gaussian-noise-multiplier", "1", "--compositions", "5")
    assert code == 3 and json.loads(out)["granted"] is False
    reserved_p2 = json.loads(ledger(store_path, "show", "--json")[1])["blocks"][0]["budget"]
    assert "reserved for other pipelines: p2" in err and "available to p1" in err
    others = err.split("reserved for other pipelines: ")[1]
    assert others.strip() == f"p2 {reserved_p2['reserved']['p2']:.1%}"  # not p1's own
    code, out, err = ledger(store_path, "request", "--blocks", "b1",
                            "--gaussian-noise-multiplier", "1")
    assert code == 3 and "reserved for other pipelines: p1" in err and ", p2 " in err


def test_audit_counts_the_blocks_and_grants_it_read(populated, monkeypatch, capsys):
    """`audit` reports the counts its own reading gave, without reading blocks or grants again."""
    from sage_tfx import cli

    assert ledger(populated, "request", "--window", "2", "--epsilon", "0.25", "--delta",
                  "0")[0] == 0
    reads = []
    read_blocks = BlockLedger.blocks

    def blocks(self, *args, **kwargs):
        reads.append("blocks")
        return read_blocks(self, *args, **kwargs)

    monkeypatch.setattr(BlockLedger, "blocks", blocks)
    monkeypatch.setattr(BlockLedger, "grant_records", lambda *_: pytest.fail("grants re-read"))
    assert cli.main(["ledger", "--store", populated, "audit"]) == 0
    assert "3 blocks and 1 grants agree with the history" in capsys.readouterr().out
    assert reads == ["blocks"]  # the audit's own read


SHOWN_ROWS = {  # one block of each mode as `show` prints it
    "basic": ({"budget": {"spent": 0.3, "reserved": {"p1": 0.2, "p2": 0.5}, "free": 0.0},
               "epsilon_ceiling": 1.0, "delta_spent": 0.0, "delta_ceiling": 1e-6},
              "b1                      0.3000    0.7000    0.0000      1.0000           0      "
              "1e-06       1  live     p1 0.2, p2 0.5"),
    "rdp": ({"budget": {"spent": 0.098, "reserved": {"p1": 0.4023, "p2": 0.5}, "free": 0.0,
                        "order": 64.0}, "guarantee_epsilon": 1.0, "guarantee_delta": 1e-6},
            "b1                        9.8       90.2     0.0    64             1    1e-06       "
            "1  live     p1 40.23, p2 50")}


@pytest.mark.parametrize("mode", sorted(SHOWN_ROWS))
def test_show_lays_a_block_out_as_its_accounting_presents_it(mode):
    from sage_tfx.sage_access.accounting import accounting_for
    from sage_tfx.sage_access.views import format_table

    row, shown = SHOWN_ROWS[mode]
    row = dict(row, id="b1", retired=False, charges=1)
    lines = format_table({"context": "default", "accounting": mode, "min_request_epsilon": 0.01,
                          "waiting_pipelines": ["p1", "p2"], "blocks": [row]}).splitlines()
    columns = accounting_for(mode).show_columns
    assert lines[-3].split()[:2] == ["block", columns[0].title.split()[0]]
    assert lines[-1] == shown


def _released_failed_and_denied(store):
    """Through the release protocol: a released grant (a long SQL request), a grant whose
    computation raised (failed), and a request larger than what is left (denied)."""
    from dp_accounting import dp_event

    from sage_tfx.release import ReleaseFailed, ReleasePlan, charge
    from sage_tfx.sage_access.errors import BudgetExhausted
    from sage_tfx.sage_access.ledger import BlockIds

    def plan(front_door, request, epsilon, pipeline=None):
        return ReleasePlan(front_door, request, epsilon, 0.0, {"count": "1/6", "sum": "5/6"},
                           {"count": dp_event.LaplaceDpEvent(1 / 3),
                            "sum": dp_event.LaplaceDpEvent(6.0)}, pipeline=pipeline)

    ledger = BlockLedger(store)
    with charge(ledger, plan("sage-tfx query", LONG_SQL, 0.5), BlockIds(["2024-01"])) as charged:
        charged.released(["out/fares.csv"])
    with pytest.raises(ReleaseFailed):
        with charge(ledger, plan("DPAggregate component", FAILED_SQL, 0.25,
                                 pipeline="taxi-stats"), BlockIds(["2024-01", "2024-02"])):
            raise ValueError("a value that quotes the data")
    with pytest.raises(BudgetExhausted):
        charge(ledger, plan("sage-tfx query", "SELECT COUNT(*) FROM trips", 5.0),
               BlockIds(["2024-01"]))


# A terminal escape someone wrote into a request: the text view shows it, never obeys it.
FAILED_SQL = "SELECT SUM(fare) FROM trips -- \x1b[2J"
LONG_SQL = ("SELECT area,\n       COUNT(*) AS trips,\n       ANON_SUM(fare, 0, 100) AS fares\n"
            "FROM trips WHERE fare > 0 GROUP BY area ORDER BY area -- " + "x" * 200)


def test_grants_and_show_list_outcome_front_door_and_request_of_grants_and_denials(populated):
    ledger(populated, "request", "--blocks", "2024-03", "--epsilon", "0.1", "--delta", "0")
    _released_failed_and_denied(populated)

    code, out, err = ledger(populated, "grants", "--json")
    assert code == 0, err
    entries = json.loads(out)
    assert [(e["kind"], e["outcome"], e["front_door"]) for e in entries] == [
        ("grant", "issued", "sage-tfx ledger request"),  # a bare grant, handed to its caller
        ("grant", "released", "sage-tfx query"),
        ("grant", "failed", "DPAggregate component"),
        ("denial", "denied", "sage-tfx query")]
    _, released, failed, denied = entries
    assert released["request"] == LONG_SQL  # whole, newlines included
    assert released["steps"]["count"]["artifacts"] == ["out/fares.csv"]
    assert released["split"] == {"count": "1/6", "sum": "5/6"}  # exact
    assert failed["steps"]["count"]["reason"] == "failed while computing"
    assert (denied["epsilon"], denied["request"], list(denied["free"])) == (
        5.0, "SELECT COUNT(*) FROM trips", ["2024-01"])

    code, out, err = ledger(populated, "grants")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["time", "(UTC)", "outcome", "epsilon"]
    [issued] = [line for line in lines if " issued " in line]
    assert issued.split()[2:9] == ["issued", "0.1", "0", "-", "sage-tfx", "ledger", "request"]
    at = {line.split()[2]: index for index, line in enumerate(lines) if line[:2] == "20"}
    released_lines = lines[at["released"]:at["failed"]]
    assert released_lines[0].split()[2:7] == ["released", "0.5", "0", "-", "sage-tfx"]
    assert "    split: count=0.1667: Laplace(noise_multiplier=0.3333); sum=0.8333: " \
           "Laplace(noise_multiplier=6)" in released_lines
    assert "    released: out/fares.csv" in released_lines
    [request] = [line for line in released_lines if line.startswith("    request: ")]
    # One line, whitespace collapsed, cut to 100 characters and saying how long it was.
    assert request.startswith("    request: SELECT area, COUNT(*) AS trips, ANON_SUM(")
    assert request.endswith(f"… ({len(' '.join(LONG_SQL.split()))} characters)")
    assert len(request) < 140
    failed_lines = lines[at["failed"]:at["denied"]]
    assert failed_lines[0].split()[2:8] == ["failed", "0.25", "0", "taxi-stats", "DPAggregate",
                                            "component"]
    assert failed_lines[0].endswith("2024-01,2024-02")
    assert "    count, sum: failed while computing" in failed_lines
    assert "    request: SELECT SUM(fare) FROM trips -- \\x1b[2J" in failed_lines
    assert "\x1b" not in out
    assert "quotes the data" not in out
    denied_lines = lines[at["denied"]:]
    assert denied_lines[0].split()[2:4] == ["denied", "5"]
    assert denied_lines[0].endswith("2024-01 could not pay")
    assert denied_lines[1].startswith("    2024-01 had: spent (0.75, 0) of ceiling (1, 1e-06)")
    assert denied_lines[-1] == "    request: SELECT COUNT(*) FROM trips"

    code, out, err = ledger(populated, "show", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert [row["id"] for row in shown["blocks"]] == ["2024-01", "2024-02", "2024-03"]
    assert shown["history"] == entries
    code, out, err = ledger(populated, "show")
    assert code == 0, err
    table, listed = out.split("\n\ngrants and denials, oldest first:\n")
    assert table.splitlines()[-1].startswith("2024-03")
    assert listed.rstrip("\n") == ledger(populated, "grants")[1].rstrip("\n")


def test_init_for_tests_is_recorded_and_shown(tmp_path):
    """`ledger init --for-tests` (issue 45, item 5): the ledger accepts fixed seeds, and says
    so where it is read; a ledger made without it does not."""
    from sage_tfx.sage_access.views import format_table, ledger_table

    store = str(tmp_path / "ledger.sqlite")
    code, out, err = ledger(store, "init", "--for-tests")
    assert code == 0 and "for tests: fixed seeds accepted" in out, err
    assert ledger(store, "init", "--context", "real")[0] == 0
    for_tests, real = BlockLedger(store), BlockLedger(store, "real")
    assert for_tests.for_tests and not real.for_tests
    assert ledger_table(for_tests)["for_tests"] is True
    assert "created for tests" in format_table(ledger_table(for_tests))
    assert "created for tests" not in format_table(ledger_table(real))
