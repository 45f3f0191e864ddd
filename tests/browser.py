"""Debian's headless chromium driven by selenium, for the tests that look at a page as a reader's
browser renders it (a report, the built docs). Skipped with a line saying what to install where the
browser is missing; CI (.ci/run) installs it and sets ``PROBE_REQUIRE_BROWSER=1``, so that there a
missing browser fails instead."""

from __future__ import annotations

import os
import shutil

import pytest


def headless_chromium():
    """A selenium driver of headless chromium at 1280 x 1000, its console log kept."""
    if os.environ.get("PROBE_SKIP_BROWSER") == "1":
        pytest.skip("PROBE_SKIP_BROWSER=1")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        # CI (.ci/run) installs them and sets PROBE_REQUIRE_BROWSER=1, so there a missing browser fails;
        # on a developer's machine without them the test says what to install and is skipped
        message = ("the browser test needs Debian's chromium and chromedriver: "
                   "apt-get install -y chromium chromium-driver")
        if os.environ.get("PROBE_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the browser test needs selenium: pip install -e '.[test]' (or set PROBE_SKIP_BROWSER=1)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1000",
                "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)
