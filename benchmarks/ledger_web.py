"""`sage-tfx ledger serve` at scale: 10,000 blocks and 100,000 grants. Prints JSON.

    python benchmarks/ledger_web.py [--blocks 10000] [--grants 100000] [--store PATH]

The store is filled through the ledger API (every grant a real `request`: about 15 minutes on
this 2-core machine for the default size) and kept at PATH (default out/benchmarks/...), so a
second run measures at once. Measured:
* `startup_s`: reading every context when the server starts (all blocks and grants);
* `endpoint_ms`: median latency of each JSON endpoint the page calls (what one page costs);
* `page_ready_ms`: in headless Chromium (when installed, a fresh profile: an empty cache), from
  navigation to the tables filled (`*_tables`) and to the whole page drawn (`*_charts`: both
  charts too), on the first visit (the browser fetches and compiles plotly.js's basic bundle,
  `chart_library_bytes`, which the page asks for only once the tables are filled) and the
  median of 3 later visits; target < 1,000 ms;
* `refresh_after_grant_s`: a grant made while serving, until the server's version moved.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request

from sage_tfx.sage_access.errors import BudgetExhausted, BadRequest
from sage_tfx.sage_access.ledger import BlockIds, BlockLedger
from sage_tfx.sage_access.web.app import BackgroundServer
from sage_tfx.sage_access.web.browser import CHROMIUM, headless_chromium
from sage_tfx.sage_access.web.browser import available as browser_available

STEPS = {"sampling_count": "0.1", "train": "0.8", "validate": "0.1"}


def build(path: str, blocks: int, grants: int) -> None:
    """`blocks` blocks (every tenth with a small ceiling, so that some retire), two waiting
    pipelines from the middle on, and `grants` grants of 1-3 recent blocks each."""
    rng = random.Random(0)
    ledger = BlockLedger.create(path, "default", min_request_epsilon=0.01)
    for index in range(blocks):
        if index == blocks // 2:
            for pipeline in ("taxi-adassp", "taxi-dpsgd"):
                ledger.register_pipeline(pipeline)
        ledger.add_block(f"b{index:05d}", 0.2 if index % 10 == 0 else 10.0, 1e-5)
    made = 0
    while made < grants:
        newest = rng.randrange(blocks)
        chosen = sorted({f"b{max(0, newest - rng.randrange(8)):05d}"
                         for _ in range(rng.randint(1, 3))})
        try:
            ledger.request(BlockIds(chosen), epsilon=0.01, delta=1e-9,
                           pipeline=rng.choice(("taxi-adassp", "taxi-dpsgd", "reports")),
                           run_id=f"run-{made // 100}" if made % 100 == 0 else None,
                           split=STEPS)
            made += 1
        except (BudgetExhausted, BadRequest):  # a retired or exhausted block: pick others
            continue
        if made % 10000 == 0:
            print(f"built {made} grants", file=sys.stderr, flush=True)


def get_ms(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        response.read()
    return 1000 * (time.perf_counter() - started)


def page_ready_ms(url: str, loads: int) -> list[dict]:
    from selenium.webdriver.common.by import By

    with tempfile.TemporaryDirectory() as profile:
        driver = headless_chromium(profile)
        try:
            times = []
            for _ in range(loads):
                driver.get(url)
                deadline = time.monotonic() + 60
                body = driver.find_element(By.TAG_NAME, "body")
                while not body.get_attribute("data-ready-ms"):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the page did not finish drawing within 60 s")
                    time.sleep(0.02)
                rows = len(driver.find_elements(By.CSS_SELECTOR, "#blocks-body tr"))
                bars = len(driver.find_elements(By.CSS_SELECTOR, "#chart-blocks g.point"))
                times.append({"ms": int(body.get_attribute("data-ready-ms")), "block_rows": rows,
                              "tables_ms": int(body.get_attribute("data-tables-ready-ms")),
                              "bars": bars})
            return times
        finally:
            driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10_000)
    parser.add_argument("--grants", type=int, default=100_000)
    parser.add_argument("--store", help="the store to measure (built there when absent)")
    parser.add_argument("--json", action="store_true", help="accepted for `make benchmark`; "
                                                            "the output is always JSON")
    args = parser.parse_args()
    path = args.store or os.path.join("out", "benchmarks",
                                      f"ledger-web-{args.blocks}-{args.grants}.sqlite")
    result = {"store": path}
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        started = time.monotonic()
        build(path + ".partial", args.blocks, args.grants)
        os.replace(path + ".partial", path)
        result["build_s"] = round(time.monotonic() - started, 1)

    started = time.monotonic()
    served = BackgroundServer(path, refresh_seconds=0.2)
    result["startup_s"] = round(time.monotonic() - started, 2)
    try:
        api = f"{served.url}/api/contexts/default"
        summary = json.load(urllib.request.urlopen(api))
        result.update(blocks=summary["blocks"], retired_blocks=summary["retired_blocks"],
                      grants=summary["grants"])  # each run adds one grant (see below)
        endpoints = {"contexts": f"{served.url}/api/contexts", "summary": api,
                     "blocks (50 rows)": f"{api}/blocks?limit=50",
                     "blocks, last page": f"{api}/blocks?offset={args.blocks - 50}&limit=50",
                     "retired (50 rows)": f"{api}/blocks?state=retired&limit=50",
                     "grants (50 rows)": f"{api}/grants?limit=50",
                     "grants, last page": f"{api}/grants?offset={args.grants - 50}&limit=50",
                     "chart": f"{api}/chart", "timeline": f"{api}/timeline",
                     "reservations": f"{api}/reservations"}
        result["endpoint_ms"] = {name: round(statistics.median(get_ms(url) for _ in range(7)), 1)
                                 for name, url in endpoints.items()}
        if browser_available():
            loads = page_ready_ms(served.url + "/", 4)
            result["page_ready_ms"] = {
                "first_tables": loads[0]["tables_ms"], "first_charts": loads[0]["ms"],
                "later_tables": statistics.median(load["tables_ms"] for load in loads[1:]),
                "later_charts": statistics.median(load["ms"] for load in loads[1:]),
                "block_rows": loads[0]["block_rows"], "bar_points": loads[0]["bars"]}
            library = json.load(urllib.request.urlopen(f"{served.url}/api/contexts"))["plotly"]
            with urllib.request.urlopen(served.url + library) as response:
                result["chart_library_bytes"] = len(response.read())
        else:
            result["page_ready_ms"] = f"not measured: {CHROMIUM} is not installed"
        version = summary["version"]
        ledger = BlockLedger(path, "default")
        live = ledger.live_blocks(page=16)[:1]
        started = time.monotonic()
        ledger.request(BlockIds([live[0].block_id]), epsilon=0.01, delta=0.0,
                       pipeline="taxi-adassp")
        while json.load(urllib.request.urlopen(api))["version"] == version:
            time.sleep(0.05)
        result["refresh_after_grant_s"] = round(time.monotonic() - started, 2)
    finally:
        served.stop()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
