"""Debian's headless Chromium, driven through Debian's chromedriver by Selenium (never a browser
or driver download): how the ledger page's tests and benchmarks/ledger_web.py load the page."""
from __future__ import annotations

import os

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Headless and quiet: no GPU, no sandbox (containers, root), no calls home, no first-run pages.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run")


def available() -> bool:
    """Whether Debian's chromium and chromium-driver are installed (`make browser`)."""
    return os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)


def headless_chromium(profile_dir: str, window: str = "1400,2400"):
    """A Selenium driver of a fresh headless Chromium whose profile lives in `profile_dir`
    (its browser console is kept: driver.get_log("browser")). Quit it when done."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile_dir}", f"--window-size={window}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
