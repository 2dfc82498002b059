"""Fixtures for the browser tests: one JupyterLab server and one Chromium per test session.

Without Chromium these tests skip; with SPDL_LAB_REQUIRE_BROWSER=1 they fail instead, for
runs where a missing browser must not pass silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from jupyter_browser import (
    ACTION_TIMEOUT_MS,
    CHROMIUM,
    CHROMIUM_ARGS,
    VIEWPORT,
    JupyterLabServer,
    OpenNotebook,
    browser_missing_message,
    screenshot,
    start_jupyter_lab,
)

if TYPE_CHECKING:
    from playwright.sync_api import Browser

_REPORTS = pytest.StashKey[dict]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


@pytest.fixture(scope="session")
def chromium() -> Path:
    reason = browser_missing_message()
    if reason is not None:
        if os.environ.get("SPDL_LAB_REQUIRE_BROWSER") == "1":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return CHROMIUM


# Module scope, not session: the server, its kernels and Chromium's helper
# processes are our children while they live, and Chromium starts new ones at
# will. Torn down after the browser tests, they cannot show up as "left behind"
# in the no_child_leak check of the tests that follow.
@pytest.fixture(scope="module")
def jupyter_lab(chromium, tmp_path_factory) -> Iterator[JupyterLabServer]:
    server = start_jupyter_lab(tmp_path_factory.mktemp("jupyterlab"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(chromium) -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(chromium), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def open_notebook(
    request, jupyter_lab: JupyterLabServer, browser: Browser
) -> Iterator[Callable[[Path], OpenNotebook]]:
    """Open a copy of a notebook in a fresh page; on failure, keep a screenshot and logs."""
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(ACTION_TIMEOUT_MS)
    console_errors: list[str] = []
    opened: list[OpenNotebook] = []

    def _open(source: Path) -> OpenNotebook:
        page = context.new_page()
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: console_errors.append(f"uncaught: {e}"))
        notebook = OpenNotebook(page=page, server=jupyter_lab, source=source)
        opened.append(notebook)  # before opening, so a failed open is still cleaned up
        notebook.open()
        return notebook

    try:
        yield _open
    finally:
        reports = request.node.stash.get(_REPORTS, {})
        failed = any(r.failed for r in reports.values())
        for notebook in opened:
            if failed:
                try:
                    path = screenshot(notebook.page, f"{request.node.name}-failure")
                    print(f"screenshot of the failure: {path}")
                except Exception as exc:  # the page may be what broke
                    print(f"no failure screenshot: {exc}")
            notebook.close()
        context.close()
        if failed:
            print("browser console errors:", *console_errors[-20:], sep="\n  ")
            print("jupyter lab log tail:\n" + jupyter_lab.log_tail())
