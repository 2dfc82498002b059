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


def check_dashboard(notebook: OpenNotebook, concurrency_expr: str, shots: str,
                    stop_expr: str = "(session.stop(), dash.close(), session.running)[-1]",
                    stopped: str = "False", auto: bool = False) -> None:
    """Run the dashboard, see it render and stream, move the decode slider, (click "auto"), stop it."""
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
    if auto:
        check_auto(notebook, shots)

    run_cell(page, -1)
    assert error_outputs(page) == []
    now = bokeh_column_length(page, FRAMES, "time_s") or 0
    wait_until(
        lambda: (bokeh_column_length(page, FRAMES, "time_s") or 0) > now,
        timeout=30, what="the dashboard to keep streaming after the notebook's last cell",
    )
    assert notebook.kernel_eval(stop_expr, timeout=90) == stopped


def check_auto(notebook: OpenNotebook, shots: str) -> None:
    """Click "auto": the tuner's moves appear under the verdict, and the toggle goes off when it ends."""
    page = notebook.page
    notebook.kernel_eval("setattr(dash, 'auto_budget_s', 12)")
    button = page.locator(f"{DASHBOARD} button:has-text('auto')")
    button.click()
    log = page.locator(f"{DASHBOARD} .spdl-lab-auto-log")
    # The first measurement shows on the page, or the tuner has ended without one
    # (then the assertion says what its log says instead of a bare timeout).
    wait_until(lambda: "started from" in (log.inner_text() or "")
               or notebook.kernel_eval("getattr(dash.autotuner, 'running', True)") == "False",
               timeout=120, what="the autotuner's first measurement under the verdict", interval=0.5)
    # A tuner that ended first (a 12 s budget) may not be on the page yet: the next refresh brings it.
    try:
        wait_until(lambda: "started from" in (log.inner_text() or ""), timeout=30,
                   what="the tuner's first measurement on the page", interval=0.5)
    except TimeoutError:
        raise AssertionError(notebook.kernel_eval(
            "dash.autotuner.log if dash.autotuner is not None else dash.message.value")) from None
    wait_until(lambda: notebook.kernel_eval("dash.autotuner.running") == "False", timeout=90,
               what="the autotuner to end within its budget", interval=0.5)
    wait_until(lambda: "mod-active" not in (button.get_attribute("class") or ""), timeout=30,
               what="the auto toggle to switch itself off")
    # What the page shows is what the kernel's tuner did, and the sliders show where it left the session.
    last = notebook.kernel_eval("dash.autotuner.log[-1].split(';')[0]")
    wait_until(lambda: last.strip("'\"")[:40] in log.inner_text(), timeout=30, what="the tuner's last line on the page")
    assert notebook.kernel_eval("dash.sliders['decode'].value == session.controls()['decode']") == "True"
    screenshot(page, f"{shots}-auto", DASHBOARD)
    assert error_outputs(page) == []


@pytest.mark.timeout(600)
def test_dashboard_in_jupyterlab(open_notebook):
    notebook = open_notebook(DASHBOARD_NOTEBOOK)
    check_dashboard(notebook, "session.stats().stages['decode'].concurrency", "dashboard", auto=True)


ATTACHED_SCRIPT = '''
import os, time
import numpy as np
import spdl_lab as lab

def decode(i):
    return np.sort(np.random.default_rng(i).standard_normal(20_000))

pipeline = lab.Pipeline(range(10**9)).map(decode, concurrency=1, name="decode").batch(16)
loader = lab.Loader(pipeline, runner="thread")
started = time.monotonic()
for batch in loader:                  # no lab.publish: spdl-lab watch publishes it
    time.sleep(0.02)
    if os.path.exists("stop") or time.monotonic() - started > 240:  # ends even if the test broke
        break
loader.close()
'''

ATTACHED_CELLS = [
    f"""
import os, subprocess, sys, tempfile, time
from pathlib import Path
import spdl_lab as lab
from bokeh.io import output_notebook
from bokeh.resources import INLINE

output_notebook(INLINE, hide_banner=True)
workdir = Path(tempfile.mkdtemp(prefix="spdl_lab_browser_"))
(workdir / "train.py").write_text({ATTACHED_SCRIPT!r})
job = subprocess.Popen([sys.executable, "-m", "spdl_lab", "watch", "--name", "browser-attached",
                        "--record", str(workdir / "run.sqlite"), "--", sys.executable, "train.py"],
                       cwd=workdir)

def stop():
    (workdir / "stop").touch()
    code = job.wait(60)
    deadline = time.monotonic() + 10
    while session.state == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    return code
""",
    """
session = lab.attach("browser-attached", timeout=60)
dash = session.dashboard()
dash
""",
    """
dash
""",
]


@pytest.mark.timeout(300)
def test_dashboard_attached_to_a_script_in_another_process(open_notebook, tmp_path):
    """The dashboard of a RemoteSession: drawn from frames the script publishes, and its
    slider changes the stage's concurrency inside the script."""
    import nbformat

    tutorial = nbformat.read(DASHBOARD_NOTEBOOK, as_version=4)  # the same kernel, named the same way
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.strip()) for c in ATTACHED_CELLS],
                                        metadata=tutorial.metadata)
    path = tmp_path / "attached_dashboard.ipynb"
    nbformat.write(notebook, path)
    opened = open_notebook(path)
    concurrency = "session.stats().stages['decode'].concurrency"
    check_dashboard(opened, concurrency, "attached",
                    stop_expr="(stop(), dash.close(), session.close(), session.state)[-1]",
                    stopped="'finished'")


JOB_CELLS = [
    """
import os, signal, subprocess, sys, tempfile
from pathlib import Path
import spdl_lab as lab
from bokeh.io import output_notebook
from bokeh.resources import INLINE

output_notebook(INLINE, hide_banner=True)
workdir = Path(tempfile.mkdtemp(prefix="spdl_lab_browser_job_"))
torchrun = str(Path(sys.executable).with_name("torchrun"))
process = subprocess.Popen([sys.executable, "-m", "spdl_lab", "watch", "--name", "browser-job", "--record",
                            str(workdir / "job"), "--", torchrun, "--nproc_per_node=2", "--standalone",
                            str(lab.workloads.job_script("ddp")), "--slow-rank", "1", "--slow-ms", "9", "--val-steps", "2",
                            "--seconds", "150"], cwd=workdir, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

def stop():
    os.killpg(process.pid, signal.SIGTERM)
    return process.wait(60)
""",
    """
job = lab.attach("browser-job", timeout=120)
dash = job.dashboard()
dash
""",
    """
dash
""",
]
JOB_DASHBOARD = ".spdl-lab-job-dashboard"


@pytest.mark.timeout(300)
def test_job_dashboard_shows_every_rank_and_names_the_straggler(open_notebook, tmp_path):
    """A torchrun job's dashboard: a line per rank in each plot, a row per rank, and the verdict
    naming the slowed rank, drawn from the frames every rank publishes."""
    import nbformat

    tutorial = nbformat.read(DASHBOARD_NOTEBOOK, as_version=4)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.strip()) for c in JOB_CELLS],
                                        metadata=tutorial.metadata)
    path = tmp_path / "job_dashboard.ipynb"
    nbformat.write(notebook, path)
    opened = open_notebook(path)
    page = opened.page
    try:
        run_all_above_last_cell(page)
        assert error_outputs(page) == []
        # steps/s, data wait, step time, and the DataLoader's fetch and collate: five plots
        wait_until(lambda: bokeh_plot_count(page, JOB_DASHBOARD) >= 5, timeout=90,
                   what="5 Bokeh plots in the job dashboard")
        for rank in (0, 1):
            first = wait_until(lambda r=rank: bokeh_column_length(page, f"spdl-lab-rank{r}", "time_s"),
                               timeout=60, what=f"rank {rank}'s ticks on the page")
            wait_until(lambda r=rank, f=first: (bokeh_column_length(page, f"spdl-lab-rank{r}", "time_s") or 0) > f,
                       timeout=30, what=f"rank {rank}'s line to grow")
        verdict = page.locator(f"{JOB_DASHBOARD} .spdl-lab-job-verdict")
        wait_until(lambda: "rank 1 waits" in (verdict.inner_text() or ""), timeout=90,
                   what="the verdict naming rank 1 on the page", interval=0.5)
        rows = page.locator(f"{JOB_DASHBOARD} .spdl-lab-job-table tr")
        assert rows.count() == 3  # the heading and a row per rank
        screenshot(page, "job-dashboard", JOB_DASHBOARD)
        run_cell(page, -1)
        assert error_outputs(page) == []
    finally:
        code = opened.kernel_eval("(stop(), dash.close(), job.close(), 0)[-1]", timeout=90)
    assert code == "0"
