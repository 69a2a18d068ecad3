"""The ledger page in a real browser: Debian's headless Chromium, driven through its
chromedriver by Selenium, loads the page served from a store filled through the ledger API."""
import os
import time

import pytest

from sage_tfx.sage_access.ledger import BlockIds, BlockLedger
from support.ledger_web import DENIED_SQL, FAILED_SQL, HOSTILE, QUERY_SQL, rename_by_hand
from sage_tfx.sage_access.web.browser import CHROMEDRIVER, CHROMIUM, headless_chromium
from sage_tfx.sage_access.web.browser import available as browser_available

pytestmark = pytest.mark.skipif(
    not browser_available(),
    reason=f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}); "
           "`make browser` installs them (make test does)")
# Where the screenshot goes: a temporary directory, or $SAGE_TFX_SCREENSHOT_DIR (docs/ uses it).
SCREENSHOT_DIR = os.environ.get("SAGE_TFX_SCREENSHOT_DIR")


@pytest.fixture
def browser(tmp_path):
    driver = headless_chromium(str(tmp_path / "profile"))
    yield driver
    driver.quit()


def wait_for(driver, condition, what, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def column(driver, table, index):
    """The text of column `index` of every row of a table, read in one step (the page may
    replace the rows at any moment as it follows the ledger)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(`#${arguments[0]}-body tr`),"
        " (row) => row.cells[arguments[1]].textContent);", table, index)


def test_the_page_shows_the_ledger_escapes_names_and_follows_new_grants(
        ledger_path, serve, browser, tmp_path):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    rename_by_hand(ledger_path, block_id="2024-05", grant_pipeline="taxi-dpsgd", new_name=HOSTILE)
    served = serve(ledger_path, refresh_seconds=0.2)
    browser.get(served.url + "/")
    wait_for(browser, lambda: browser.find_element(By.TAG_NAME, "body")
             .get_attribute("data-ready") == "true", "the page to load")

    blocks = column(browser, "blocks", 0)
    assert blocks == ["2024-01", "2024-02", "2024-03", "2024-04", HOSTILE, "2024-06", "2024-07",
                      "2024-08"]
    assert column(browser, "blocks", 1).count("retired") == 1
    assert column(browser, "retired", 0) == ["2024-07"]
    # Grants and the denial, newest first, each with its outcome, front door and request.
    outcomes = browser.execute_script(  # the word, before the details behind a click
        "return Array.from(document.querySelectorAll('#grants-body td.outcome'),"
        " (cell) => cell.firstChild.textContent);")
    assert outcomes == ["denied", "failed", "released", "unrecorded", "unrecorded", "unrecorded"]
    assert browser.execute_script(
        "return Array.from(document.querySelectorAll('#grants-body tr'), (r) => r.className);"
    )[:2] == ["outcome-denied", "outcome-failed"]  # set apart, not only by a word
    assert column(browser, "grants", 2)[:4] == ["sage-tfx query", "DPAggregate component",
                                                "sage-tfx query", "—"]
    pipelines = column(browser, "grants", 3)
    assert pipelines == ["—", "taxi-stats", "—", "hostile-split", "taxi-adassp", HOSTILE]
    assert column(browser, "grants", 4)[0] == "2024-03 could not pay"
    assert column(browser, "grants", 5)[:3] == ["2", "0.25", "0.5"]
    splits = column(browser, "grants", 7)
    # Fractions rounded for people (the split recorded 1/6 and 5/6 exactly).
    assert splits[2] == ("count 0.1667: Laplace(noise_multiplier=0.3333); "
                         "sum 0.8333: Laplace(noise_multiplier=6)")
    assert splits[3] == f"{HOSTILE} 1" and "dp_sgd 0.9: Gaussian(noise_multiplier=4)" in splits[5]
    requests = column(browser, "grants", 8)
    assert requests[:2] == [DENIED_SQL, FAILED_SQL]  # `<b>` in a request stays text
    # A request with several lines: its first characters, the whole text behind a click.
    assert requests[2].startswith("SELECT area, COUNT(*) AS trips, ANON_SUM(fare, 0, 100) AS")
    assert requests[2].endswith(QUERY_SQL)
    assert requests[3:] == ["—"] * 3
    denied_why, failed_why, released_what = browser.find_elements(
        By.CSS_SELECTOR, "#grants-body td.outcome details")
    failed_why.find_element(By.TAG_NAME, "summary").click()
    reason = failed_why.find_element(By.TAG_NAME, "div")
    assert reason.is_displayed() and reason.text == "failed while computing (ValueError)"
    assert denied_why.get_attribute("textContent").startswith(
        "why2024-03 had spent (0.75, 0) of ceiling (1, 1e-06)")
    assert released_what.get_attribute("textContent") == "whatreleased out/fares.csv"
    assert "<img src=x onerror=alert(2)>" in column(browser, "blocks", 11)[-1]
    assert column(browser, "waiting", 0) == ["taxi-adassp"]
    # Shown as text: nothing the store holds became an element, and no alert ran.
    assert browser.find_elements(By.CSS_SELECTOR, "main script, main img, main b") == []
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    # Both charts drew: a stacked bar per block (3 parts), and the spent budget over time on
    # one y-axis from zero, one line per pipeline or front door and one for all grants.
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chart-blocks g.point")) == 3 * 8
    y_axes = browser.execute_script(
        "const layout = document.getElementById('chart-timeline')._fullLayout;"
        "return Object.keys(layout).filter((key) => /^yaxis\\d*$/.test(key))"
        ".map((key) => [key, layout[key].range[0], layout[key].title.text]);")
    assert y_axes == [["yaxis", 0, "ε spent on the most-charged block"]]
    legend = [t.text for t in browser.find_elements(By.CSS_SELECTOR,
                                                    "#chart-timeline .legendtext")]
    assert legend[0] == "all grants (the most-charged block)"
    assert set(legend[1:]) == {HOSTILE, "sage-tfx query (no pipeline)", "taxi-stats",
                               "hostile-split", "taxi-adassp"}
    tick_labels = [t.text for t in browser.find_elements(By.CSS_SELECTOR,
                                                         "#chart-blocks .xtick text")]
    assert HOSTILE in tick_labels
    # The chart library is asked for only once the tables are filled, so they never wait for it.
    library_ms, tables_ms = browser.execute_script(
        "return [performance.getEntriesByType('resource').find((r) => r.name.includes("
        "'/static/plotly-')).startTime, Number(document.body.dataset.tablesReadyMs)];")
    assert library_ms >= tables_ms - 1  # tablesReadyMs is rounded to the millisecond

    # The run that spent the DP-SGD grant, with the Model it produced.
    browser.find_element(By.CSS_SELECTOR, "#grants-body button.run-link").click()
    wait_for(browser, lambda: column(browser, "run", 0), "the run's artifacts")
    assert column(browser, "run", 0) == ["Model"]
    assert column(browser, "run", 2) == ["/pipelines/taxi/DPTrainer/model/taxi-dpsgd-run-1"]

    screenshot = os.path.join(SCREENSHOT_DIR or str(tmp_path), "ledger-web.png")
    assert browser.save_screenshot(screenshot)
    with open(screenshot, "rb") as image:
        assert image.read(8) == b"\x89PNG\r\n\x1a\n"

    # A grant made while the page is open appears without a reload.
    browser.execute_script("window.loadedOnce = true;")
    BlockLedger(ledger_path, "default").request(BlockIds(["2024-03"]), epsilon=0.1, delta=0.0,
                                                pipeline="arrived-while-open")
    wait_for(browser, lambda: column(browser, "grants", 3)[:1] == ["arrived-while-open"],
             "the new grant on the page")
    assert browser.execute_script("return window.loadedOnce === true;")
    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert severe == []  # no script error and no Content-Security-Policy violation
