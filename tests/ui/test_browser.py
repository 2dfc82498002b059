"""The live dashboard in a real JupyterLab and Chromium: it renders, streams, and steers.

Each test runs every cell above the notebook's last one, checks the page and the
kernel, then runs the last cell, which leaves the dashboard live on screen (the
tutorial ends that way), checks it still streams, and stops the work itself.
"""

from __future__ import annotations

import pytest
from jupyter_browser import (
    REPO_ROOT,
    OpenNotebook,
    bokeh_column_length,
    bokeh_plot_count,
    error_outputs,
    run_all_above_last_cell,
    run_cell,
    screenshot,
    wait_until,
)

DASHBOARD_NOTEBOOK = REPO_ROOT / "notebooks" / "03_live_dashboard.ipynb"
DASHBOARD = ".spdl-lab-dashboard"
FRAMES = "spdl_lab_frames"


def _kernel_int(notebook: OpenNotebook, expr: str) -> int:
    return int(notebook.kernel_eval(expr))


def check_dashboard(notebook: OpenNotebook, concurrency_expr: str, shots: str) -> None:
    """Run the dashboard, see it render and stream, move the decode slider, stop it."""
    page = notebook.page
    run_all_above_last_cell(page)
    assert error_outputs(page) == []

    wait_until(
        lambda: bokeh_plot_count(page, DASHBOARD) >= 4,
        timeout=60, what="4 Bokeh plots drawn inside the dashboard",
    )
    first = wait_until(
        lambda: bokeh_column_length(page, FRAMES, "time_s"),
        timeout=30, what=f"frames in the page's {FRAMES} source",
    )
    # New frames keep arriving: the length grows within a few sampling periods.
    wait_until(
        lambda: (bokeh_column_length(page, FRAMES, "time_s") or 0) > first,
        timeout=15, what=f"{FRAMES}.time_s to grow past {first} rows",
    )
    screenshot(page, f"{shots}-rendered", DASHBOARD)

    before = _kernel_int(notebook, concurrency_expr)
    handle = page.locator(f"{DASHBOARD} .spdl-lab-slider-decode .noUi-handle")
    handle.focus()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    wait_until(
        lambda: _kernel_int(notebook, concurrency_expr) == before + 2,
        timeout=60, what=f"{concurrency_expr} to go from {before} to {before + 2}",
    )
    screenshot(page, f"{shots}-slider", DASHBOARD)
    assert error_outputs(page) == []

    run_cell(page, -1)
    assert error_outputs(page) == []
    now = bokeh_column_length(page, FRAMES, "time_s") or 0
    wait_until(
        lambda: (bokeh_column_length(page, FRAMES, "time_s") or 0) > now,
        timeout=30, what="the dashboard to keep streaming after the notebook's last cell",
    )
    assert notebook.kernel_eval("(session.stop(), dash.close(), session.running)[-1]") == "False"


@pytest.mark.timeout(300)
def test_dashboard_in_jupyterlab(open_notebook):
    notebook = open_notebook(DASHBOARD_NOTEBOOK)
    check_dashboard(notebook, "session.stats().stages['decode'].concurrency", "dashboard")
