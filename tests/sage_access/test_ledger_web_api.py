"""`sage-tfx ledger serve` without a browser: the JSON endpoints say what the ledger recorded,
change as grants happen, never write the store, and refuse requests without the token."""
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from sage_tfx.sage_access.views import ledger_table
from sage_tfx.sage_access.ledger import BlockIds, BlockLedger
from support.ledger_web import HOSTILE
from support.stores import store_digest
from sage_tfx.sage_access.web import app as web_app


def fetch(url, headers=None, method="GET"):
    """(status, headers, parsed JSON or text) of one request; errors are answers too."""
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(request, timeout=30) as response:
            status, head, body = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, head, body = error.code, error.headers, error.read()
    kind = head.get("content-type", "")
    return status, head, json.loads(body) if "json" in kind else body.decode()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args):
        return None


def test_endpoints_give_what_the_ledger_recorded(ledger_path, serve):
    served = serve(ledger_path)
    status, _, listing = fetch(f"{served.url}/api/contexts")
    assert status == 200 and listing["error"] is None
    summaries = {c["context"]: c for c in listing["contexts"]}
    assert set(summaries) == {"default", "marketing"}
    assert (summaries["default"]["blocks"], summaries["default"]["retired_blocks"],
            summaries["default"]["grants"]) == (8, 1, 3)
    assert summaries["default"]["waiting_pipelines"] == ["taxi-adassp"]

    api = f"{served.url}/api/contexts/default"
    expected = ledger_table(BlockLedger(ledger_path, "default", read_only=True))["blocks"]
    _, _, first = fetch(f"{api}/blocks?offset=0&limit=5")
    _, _, rest = fetch(f"{api}/blocks?offset=5&limit=5")
    assert (first["total"], len(first["rows"]), len(rest["rows"])) == (8, 5, 3)
    assert first["rows"] + rest["rows"] == expected  # the rows of `ledger show --json`
    _, _, retired = fetch(f"{api}/blocks?state=retired")
    assert [row["id"] for row in retired["rows"]] == ["2024-07"]
    assert retired["rows"][0]["epsilon_spent"] == pytest.approx(0.045)

    _, _, grants = fetch(f"{api}/grants?limit=2")
    assert grants["total"] == 3
    newest, adassp = grants["rows"]  # newest first
    assert newest["pipeline"] == "hostile-split" and newest["steps"][0]["step"] == HOSTILE
    assert adassp["pipeline"] == "taxi-adassp" and adassp["blocks"] == ["2024-07"]
    _, _, oldest = fetch(f"{api}/grants?offset=2&limit=2")
    [dpsgd] = oldest["rows"]
    assert (dpsgd["epsilon"], dpsgd["delta"], dpsgd["run_id"]) == (0.3, 1e-7, "taxi-dpsgd-run-1")
    assert dpsgd["blocks"] == ["2024-06", "2024-05", "2024-04"]
    assert {s["step"]: (s["fraction"], s["event"]) for s in dpsgd["steps"]} == {
        "sampling_count": ("0.1", None), "dp_sgd": ("0.9", "Gaussian(noise_multiplier=4)")}
    _, _, only = fetch(f"{api}/grants?pipeline=taxi-adassp")
    assert [g["grant_id"] for g in only["rows"]] == [adassp["grant_id"]]

    _, _, run = fetch(f"{api}/grants/{dpsgd['grant_id']}/run")
    assert run["runs"] == [{"type": "pipeline_run", "name": "taxi-dpsgd-run-1"}]
    assert [(a["type"], a["uri"]) for a in run["artifacts"]] == [
        ("Model", "/pipelines/taxi/DPTrainer/model/taxi-dpsgd-run-1")]
    _, _, no_run = fetch(f"{api}/grants/{adassp['grant_id']}/run")
    assert no_run["runs"] == [] and no_run["artifacts"] == []

    _, _, held = fetch(f"{api}/reservations")
    [adassp_reservation] = held["pipelines"]
    live_reserving = [row for row in expected
                      if not row["retired"] and row["budget"]["reserved"].get("taxi-adassp")]
    assert adassp_reservation["blocks"] == len(live_reserving) > 0
    assert adassp_reservation["reserved"] == pytest.approx(
        sum(row["budget"]["reserved"]["taxi-adassp"] for row in live_reserving))

    _, _, chart = fetch(f"{api}/chart")
    assert [bar["label"] for bar in chart["bars"]] == [row["id"] for row in expected]
    _, _, line = fetch(f"{api}/timeline")
    assert sum(b["grants"] for b in line["buckets"]) == 3
    assert line["buckets"][-1]["epsilon_total"] == pytest.approx(3 * 0.3 + 0.045 + 2 * 0.2)

    assert fetch(f"{served.url}/api/contexts/nowhere")[0] == 404
    assert fetch(f"{api}/grants/0123/run")[0] == 404
    assert fetch(f"{api}/blocks?limit=100000")[0] == 422


def test_a_grant_made_while_serving_is_served_without_a_restart(ledger_path, serve,
                                                                 monkeypatch):
    # Without the margin of re-read executions, so that every change is read exactly once.
    monkeypatch.setattr(web_app, "RECHECK_IDS", 0)
    served = serve(ledger_path, refresh_seconds=0.1)
    api = f"{served.url}/api/contexts/default"
    before = fetch(api)[2]
    BlockLedger(ledger_path, "default").request(BlockIds(["2024-02"]), epsilon=0.25, delta=0.0,
                                                pipeline="late-pipeline")
    deadline = time.monotonic() + 20
    while (summary := fetch(api)[2])["version"] == before["version"]:
        assert time.monotonic() < deadline, "the new grant never reached the server"
        time.sleep(0.1)
    assert summary["grants"] == before["grants"] + 1
    assert fetch(f"{api}/grants?limit=1")[2]["rows"][0]["pipeline"] == "late-pipeline"
    [block] = [row for row in fetch(f"{api}/blocks")[2]["rows"] if row["id"] == "2024-02"]
    assert block["charges"] == 2 and block["epsilon_spent"] == pytest.approx(0.2 + 0.25)

    # A new block and a finished pipeline (its reservations return on every block): the
    # served rows are again exactly `ledger show --json`'s.
    writer = BlockLedger(ledger_path, "default")
    for change in (lambda: writer.add_block("2024-09", 1.0, 1e-6),
                   lambda: writer.finish_pipeline("taxi-adassp")):
        before = fetch(api)[2]
        change()
        while (summary := fetch(api)[2])["version"] == before["version"]:
            assert time.monotonic() < deadline + 20, "the change never reached the server"
            time.sleep(0.1)
        reader = BlockLedger(ledger_path, "default", read_only=True)
        assert fetch(f"{api}/blocks")[2]["rows"] == ledger_table(reader)["blocks"]
        assert summary["waiting_pipelines"] == reader.waiting_pipelines()


def test_serving_never_writes_the_store(ledger_path, serve):
    before = store_digest(ledger_path)
    sqlite = not ledger_path.startswith("mysql://")
    files = set(os.listdir(os.path.dirname(ledger_path))) if sqlite else None
    served = serve(ledger_path)
    grant = fetch(f"{served.url}/api/contexts/default/grants")[2]["rows"][-1]
    for path in ("/", "/api/contexts", "/api/contexts/default", "/openapi.json",
                 *(f"/api/contexts/default/{part}" for part in (
                     "blocks", "chart", "timeline", "reservations", "grants",
                     f"grants/{grant['grant_id']}/run"))):
        assert fetch(served.url + path)[0] == 200, path
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        assert fetch(f"{served.url}/api/contexts/default/blocks", method=method)[0] == 405
    served.views.refresh()
    with pytest.raises(Exception, match="(?i)read.?only"):  # the server's own connection
        served.views.ledger("default").register_pipeline("intruder")
    assert store_digest(ledger_path) == before
    if sqlite:
        assert set(os.listdir(os.path.dirname(ledger_path))) == files  # no journal, no WAL


def test_a_token_is_required_when_given_and_hosts_are_checked_without_one(ledger_path, serve):
    token = "a-token-of-at-least-16-chars"
    locked = serve(ledger_path, token=token)
    api = f"{locked.url}/api/contexts"
    assert fetch(api)[0] == 401
    assert fetch(api, {"Authorization": "Bearer wrong-token-wrong-token"})[0] == 401
    assert fetch(f"{locked.url}/?token=wrong")[0] == 401
    assert fetch(api, {"Authorization": f"Bearer {token}"})[0] == 200
    status, head, _ = fetch(f"{locked.url}/?token={token}")
    assert status == 303 and head["location"] == "/"
    cookie = head["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    assert fetch(api, {"Cookie": cookie.split(";")[0]})[0] == 200

    open_ = serve(ledger_path)
    assert fetch(f"{open_.url}/api/contexts", {"Host": "ledger.example.com"})[0] == 403
    status, head, page = fetch(f"{open_.url}/")
    assert status == 200 and "script-src 'self'" in head["content-security-policy"]
    assert "<script>" not in page.replace('<script src="/static/ledger.js" defer></script>', "")


def test_openapi_documents_every_endpoint_and_assets_are_local(ledger_path, serve):
    served = serve(ledger_path)
    schema = fetch(f"{served.url}/openapi.json")[2]
    paths = schema["paths"]
    assert {"/api/contexts", "/api/contexts/{context}", "/api/contexts/{context}/blocks",
            "/api/contexts/{context}/chart", "/api/contexts/{context}/timeline",
            "/api/contexts/{context}/grants", "/api/contexts/{context}/grants/{grant_id}/run",
            "/api/contexts/{context}/reservations"} == set(paths)
    assert all(set(route) == {"get"} and route["get"]["description"]
               for route in paths.values())
    assert fetch(f"{served.url}/docs")[0] == 404  # Swagger UI would load from a CDN
    plotly = fetch(f"{served.url}/api/contexts")[2]["plotly"]
    status, head, script = fetch(served.url + plotly)
    # The basic partial bundle the page needs (bar and scatter), not the 4.8 MB full one.
    assert status == 200 and "plotly.js (basic" in script[:200]
    assert 1_000_000 < len(script) < 2_000_000
    for name in ("index.html", "ledger.js", "ledger.css"):
        text = (fetch(f"{served.url}/") if name == "index.html"
                else fetch(f"{served.url}/static/{name}"))[2]
        assert not re.search(r"(src|href)=\"(https?:)?//", text), name


def test_the_cli_generates_a_token_off_loopback_and_exits_2_on_bad_input(ledger_path, tmp_path):
    command = [sys.executable, "-m", "sage_tfx.cli", "ledger", "serve", "--store", ledger_path]
    missing = subprocess.run(command[:-1] + [str(tmp_path / "absent.sqlite")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no ledger store" in missing.stderr
    unknown = subprocess.run(command + ["--context", "nowhere"], capture_output=True, text=True,
                             timeout=120)
    assert unknown.returncode == 2 and "no ledger context 'nowhere'" in unknown.stderr
    server = subprocess.Popen(command + ["--host", "0.0.0.0", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, SAGE_TFX_LEDGER_TOKEN=""))
    try:
        lines = []
        while not (lines and lines[-1].startswith("serving ledger")):
            line = server.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        token = re.search(r"open the address below once\): (\S+)", "".join(lines)).group(1)
        port, shown = re.search(r":(\d+)/\?token=(\S+) ", lines[-1]).groups()
        assert shown == token and len(token) >= 32
        api = f"http://127.0.0.1:{port}/api/contexts"
        assert fetch(api)[0] == 401
        assert fetch(api, {"Authorization": f"Bearer {token}"})[0] == 200
    finally:
        server.terminate()
        server.wait(timeout=30)
