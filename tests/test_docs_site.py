"""The built documentation site as a reader's browser shows it: the executed tutorial without the
build machine's paths or stderr, deciding what it sets out to decide; every figure of a results page
loaded and linked to its full-size file; a copy button on every code block.

Runs where ``PROBE_DOCS_SITE`` names a site built by ``sphinx-build -b html docs DIR`` (CI builds the
site and then runs this file with it set, see ``.ci/run``); skipped elsewhere: the build executes the
tutorial, minutes that the test suite does not spend twice."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from browser import headless_chromium

SITE = os.environ.get("PROBE_DOCS_SITE")
pytestmark = pytest.mark.skipif(not SITE, reason="set PROBE_DOCS_SITE to a site built by sphinx-build -b html docs DIR")

#: what a page says of itself once rendered: its text, stderr outputs, figures, code blocks and copy buttons
PAGE_STATE = """return {
  text: document.querySelector('article').innerText,
  stderr: document.querySelectorAll('.output.stderr').length,
  images: Array.from(document.querySelectorAll('article img')).map(i => ({
      src: i.src, loaded: i.complete && i.naturalWidth > 0,
      link: i.closest('a') ? i.closest('a').href : null})),
  code: document.querySelectorAll('article div.highlight pre').length,
  copy: document.querySelectorAll('article button.copybtn').length,
}"""


@pytest.fixture(scope="module")
def browser():
    driver = headless_chromium()
    yield driver
    driver.quit()


def _state(browser, page: str) -> dict:
    path = Path(SITE) / page
    assert path.is_file(), f"{path} was not built"
    browser.get(path.resolve().as_uri())
    return browser.execute_script(PAGE_STATE)


def _figures_linked_to_themselves(state: dict) -> None:
    assert state["images"], "no figure on the page"
    for image in state["images"]:
        assert image["loaded"], image
        assert image["link"] is not None, f"{image['src']} is not linked to its full-size file"
        assert image["link"].rsplit("/", 1)[-1] == image["src"].rsplit("/", 1)[-1], image


def test_the_tutorial_shows_no_build_machine_and_decides(browser):
    state = _state(browser, "tutorial/first_hour.html")
    assert state["stderr"] == 0
    paths = re.findall(r"(?:/root/|/home/|/tmp/|site-packages|/usr/lib)\S*", state["text"])
    assert not paths, paths  # the build machine's own paths
    assert re.search(r"Does attention track \S+\? no\b", state["text"])  # the study decides
    assert "1 claim (1 supported)" in state["text"]  # and so does the audit
    assert state["code"] > 5 and state["copy"] == state["code"]
    _figures_linked_to_themselves(state)


@pytest.mark.parametrize("page", ["results.html", "results/jain_wallace.html"])
def test_a_results_page_links_every_figure_to_full_size(browser, page):
    state = _state(browser, page)
    _figures_linked_to_themselves(state)
    assert state["copy"] == state["code"]


def test_a_long_shell_command_wraps_inside_the_column(browser):
    path = Path(SITE) / "getting-started.html"
    browser.get(path.resolve().as_uri())
    blocks = browser.execute_script(
        "return Array.from(document.querySelectorAll('article div.highlight-bash pre'))"
        ".map(p => [p.scrollWidth - p.clientWidth, p.innerText.slice(0, 50)])")
    assert blocks, "no shell block on the page"  # the README's two commands are there
    overflow = [b for b in blocks if b[0] > 2]
    assert not overflow, overflow  # a cut command reads as a different command
