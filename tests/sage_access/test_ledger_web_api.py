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

from sage_tfx.release import charge
from sage_tfx.sage_access.errors import BudgetExhausted
from sage_tfx.sage_access.views import ledger_table
from sage_tfx.sage_access.ledger import BlockIds, BlockLedger
from support.ledger_web import DENIED_SQL, FAILED_SQL, HOSTILE, QUERY_SQL, query_plan
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
            summaries["default"]["grants"], summaries["default"]["denials"]) == (8, 1, 5, 1)
    assert summaries["default"]["outcomes"] == {"unrecorded": 3, "released": 1, "failed": 1,
                                                "denied": 1}
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

    _, _, grants = fetch(f"{api}/grants?limit=5")
    assert grants["total"] == 6  # 5 grants and a denial
    denied, failed, released, newest, adassp = grants["rows"]  # newest first
    assert (denied["kind"], denied["outcome"], denied["front_door"], denied["request"],
            denied["epsilon"], list(denied["free"])) == (
        "denial", "denied", "sage-tfx query", DENIED_SQL, 2.0, ["2024-03"])
    assert denied["free"]["2024-03"].startswith("spent (0.75, 0) of ceiling (1, 1e-06)")
    assert (failed["kind"], failed["outcome"], failed["front_door"], failed["request"],
            failed["pipeline"], failed["blocks"]) == (
        "grant", "failed", "DPAggregate component", FAILED_SQL, "taxi-stats",
        ["2024-02", "2024-03"])
    assert [(s["step"], s["outcome"], s["reason"]) for s in failed["steps"]] == [
        ("count", "failed", "failed while computing"),
        ("sum", "failed", "failed while computing")]
    assert (released["outcome"], released["request"], released["pipeline"]) == (
        "released", QUERY_SQL, None)  # the request whole, newlines included
    # Exact in JSON; the event's parameters are words for people (rounded).
    assert [(s["step"], s["fraction"], s["event"], s["artifacts"]) for s in released["steps"]] == [
        ("count", "1/6", "Laplace(noise_multiplier=0.3333)", ["out/fares.csv"]),
        ("sum", "5/6", "Laplace(noise_multiplier=6)", ["out/fares.csv"])]
    assert newest["pipeline"] == "hostile-split" and newest["steps"][0]["step"] == HOSTILE
    assert (newest["outcome"], newest["front_door"], newest["steps"][0]["outcome"]) == (
        "unrecorded", None, None)  # charged by BlockLedger.request, outside the protocol
    assert adassp["pipeline"] == "taxi-adassp" and adassp["blocks"] == ["2024-07"]
    _, _, refused = fetch(f"{api}/grants?outcome=denied")
    assert [row["execution_id"] for row in refused["rows"]] == [denied["execution_id"]]
    assert fetch(f"{api}/grants?outcome=lost")[0] == 422
    _, _, oldest = fetch(f"{api}/grants?offset=5&limit=2")
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
    # Spent budget on one axis: all grants together reach the most-charged block's epsilon
    # (2024-03: 0.5 released + 0.25 failed, whose budget is spent all the same), the number
    # the blocks table gives; each pipeline (or front door) its own most-charged block's.
    assert line["all"][-1] == pytest.approx(max(row["epsilon_spent"] for row in expected))
    assert line["all"][-1] == pytest.approx(0.75)
    assert {series["name"]: series["values"][-1] for series in line["series"]} == pytest.approx({
        "taxi-dpsgd": 0.3, "taxi-adassp": 0.045, "hostile-split": 0.2, "taxi-stats": 0.25,
        "sage-tfx query (no pipeline)": 0.5})
    for values in [line["all"]] + [series["values"] for series in line["series"]]:
        assert len(values) == len(line["end_ms"]) and values == sorted(values)  # cumulative
    assert line["axis"] == "ε spent on the most-charged block" and line["without_epsilon"] == 0

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
    assert block["charges"] == 3 and block["epsilon_spent"] == pytest.approx(0.2 + 0.25 + 0.25)

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


def test_outcomes_and_denials_recorded_while_serving_are_served(ledger_path, serve,
                                                                monkeypatch):
    """A grant read while its release computes is `incomplete`; its outcome, recorded later on
    that older grant, and a denial reach the server as they happen."""
    monkeypatch.setattr(web_app, "RECHECK_IDS", 0)  # every change read exactly once
    served = serve(ledger_path, refresh_seconds=0.1)
    api = f"{served.url}/api/contexts/default"
    writer = BlockLedger(ledger_path, "default")

    def after(change, what):
        before = fetch(api)[2]["version"]
        change()
        deadline = time.monotonic() + 20
        while fetch(api)[2]["version"] == before:
            assert time.monotonic() < deadline, f"{what} never reached the server"
            time.sleep(0.1)
        return fetch(f"{api}/grants?limit=1")[2]["rows"][0], fetch(api)[2]

    opened = []  # the release under way: charged, not yet recorded
    newest, summary = after(lambda: opened.append(charge(writer, query_plan(
        "ContinualRelease component", "window 7d", 0.1, "live"), BlockIds(["2024-04"]))),
        "the grant")
    [charged] = opened
    assert (newest["pipeline"], newest["outcome"]) == ("live", "incomplete")
    newest, summary = after(lambda: charged.released(["out/window.parquet"]), "the outcome")
    assert (newest["pipeline"], newest["outcome"], newest["front_door"]) == (
        "live", "released", "ContinualRelease component")
    assert newest["steps"][0]["artifacts"] == ["out/window.parquet"]
    assert summary["outcomes"]["released"] == 2 and "incomplete" not in summary["outcomes"]

    def denied():
        with pytest.raises(BudgetExhausted):
            charge(writer, query_plan("sage-tfx query", "SELECT 2", 9.0), BlockIds(["2024-05"]))
    newest, summary = after(denied, "the denial")
    assert (newest["kind"], newest["request"], newest["epsilon"]) == ("denial", "SELECT 2", 9.0)
    assert summary["denials"] == 2
    # Read incrementally, it is what a fresh read gives.
    fresh = web_app.read_snapshot(BlockLedger(ledger_path, "default", read_only=True), None)
    served.views.refresh()
    assert served.views.snapshot("default").history == fresh.history


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


def test_spent_budget_over_time_is_epsilon_on_the_most_charged_block_per_pipeline():
    """The chart's numbers: per pipeline the most it charged one block, over time; past eight
    lines the smallest share one line, whose value is their most-charged block (not a sum)."""
    def grant(second, pipeline, blocks, epsilon):
        return {"time_ms": 1_000_000 + 1000 * second, "pipeline": pipeline, "blocks": blocks,
                "epsilon": epsilon, "front_door": "sage-tfx query"}

    grants = [grant(index, f"p{index}", [f"b{index}"], 0.1 * (index + 1)) for index in range(10)]
    grants += [grant(20, "p0", ["b0", "b9"], 0.05), grant(30, None, ["b9"], 0.95),
               grant(30, "rdp", ["b1"], None)]  # an RDP curve: no epsilon
    line = web_app.timeline(grants, "basic", buckets=31)
    assert line["bucket_ms"] == 1000 and len(line["end_ms"]) == 31
    named = {series["name"]: series["values"] for series in line["series"]}
    assert list(named) == ["p9", "sage-tfx query (no pipeline)", "p8", "p7", "p6", "p5", "p4",
                           "4 other pipelines"]  # largest first
    assert named["p9"][8] == 0 and named["p9"][9:] == [pytest.approx(1.0)] * 22
    # p0 to p3 charged a block each: their line is the largest so far (0.3 after p2, 0.4
    # after p3), not their sum; p0's second grant (0.1 + 0.05 on b0) leaves it at 0.4.
    assert named["4 other pipelines"][2:4] == pytest.approx([0.3, 0.4])
    assert named["4 other pipelines"][-1] == pytest.approx(0.4)
    # All grants: b9 had 1.0, then 1.05, then 2.0.
    assert (line["all"][9], line["all"][20], line["all"][30]) == pytest.approx((1.0, 1.05, 2.0))
    assert line["without_epsilon"] == 1 and "1 grant(s) charged an RDP curve" in line["note"]
    assert "basic composition" in line["note"]
    rdp = web_app.timeline(grants, "rdp")
    assert rdp["note"].startswith("RDP accounting:") and "upper bound" in rdp["note"]
    assert web_app.timeline([grants[-1]], "rdp")["series"] == []
