"""Drive a real JupyterLab in headless Chromium for UI tests.

Starts an isolated `jupyter lab` on 127.0.0.1, opens a notebook in Chromium through
Playwright, runs cells with JupyterLab's own commands, and reads state back from the
notebook's kernel (jupyter_client) and from BokehJS in the page.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:  # playwright is imported only when a browser test runs
    from playwright.sync_api import Page

REPO_ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT_DIR = REPO_ROOT / "build" / "screenshots"
CHROMIUM = Path(os.environ.get("SPDL_LAB_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]
VIEWPORT = {"width": 1600, "height": 1440}  # tall enough for the whole dashboard
# Playwright's own default (30 s) is too short for a loaded 2-core machine.
ACTION_TIMEOUT_MS = 120_000
# Front-end plugins the dashboard needs; missing ones mean the server runs from an
# environment without ipywidgets' or jupyter_bokeh's labextension.
REQUIRED_PLUGINS = ("@jupyter-widgets/jupyterlab-manager:plugin", "@bokeh/jupyter_bokeh")

# Settings for a fresh user-settings dir. Windowing off: with JupyterLab's default
# windowing, cells outside the viewport are detached or left unlaid-out, so locators
# and Bokeh canvases would depend on scroll position. News/update checks off: they
# pop a notification over the notebook and try the network.
_LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
    # A test's notebook is a throwaway copy: saving it (every 120 s by default) would
    # store widget outputs whose models die with the kernel.
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


def browser_missing_message() -> str | None:
    """Why the browser tests cannot run here, or None when Chromium and Playwright are present."""
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        return f"Chromium not found at {CHROMIUM}; run `make browser-deps` to install it"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing; run `make venv` (it is a dev dependency)"
    return None


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1):
    """Poll `predicate` until it returns something truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


@dataclass
class JupyterLabServer:
    """A `jupyter lab` process serving `root` on 127.0.0.1 with a random token."""

    home: Path
    port: int
    token: str
    process: subprocess.Popen
    log_path: Path

    @property
    def root(self) -> Path:
        return self.home / "root"

    @property
    def runtime_dir(self) -> Path:
        return self.home / "runtime"

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}{sep}token={self.token}"

    def api(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url(path), data=data, method=method)
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"jupyter lab exited with code {self.process.returncode} while starting; "
                f"log tail:\n{self.log_tail()}"
            )
        try:
            self.api("GET", "api/status", timeout=2.0)
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def kernel_connection_file(self, notebook: str) -> Path:
        """The connection file of the kernel the server's session for `notebook` uses."""
        sessions = self.api("GET", "api/sessions")
        for s in sessions:
            if s.get("path") == notebook and s.get("kernel"):
                return self.runtime_dir / f"kernel-{s['kernel']['id']}.json"
        raise LookupError(f"no kernel session for {notebook!r}; sessions: {sessions}")

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the server and every kernel it started; never raises."""
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            children = []
        if self.process.poll() is None:
            try:
                self.api("POST", "api/shutdown", timeout=5.0)
            except Exception:
                pass
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(self.process.pid, signal.SIGTERM)
                try:
                    self.process.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    _kill_group(self.process.pid, signal.SIGKILL)
                    self.process.wait(timeout=5.0)
        # Kernels run in their own sessions (jupyter_client starts them so), so the
        # server's process group does not cover them: reap what the shutdown missed.
        _, alive = psutil.wait_procs(children, timeout=5.0)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5.0)


def _kill_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_jupyter_lab(home: Path, timeout: float = 120.0) -> JupyterLabServer:
    """Start `jupyter lab` serving `home/root`; state (runtime, workspaces, settings) under `home`."""
    for sub in ("root", "runtime", "workspaces", "settings"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    for rel, value in _LAB_SETTINGS.items():
        path = home / "settings" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))

    port = _free_port()
    token = secrets.token_hex(24)
    command = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={home / 'root'}",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
        f"--LabApp.user_settings_dir={home / 'settings'}",
        "--LabApp.expose_app_in_browser=True",
        "--ServerApp.terminals_enabled=False",
    ]
    if os.getuid() == 0:
        command.append("--allow-root")
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(home / "runtime"), PYTHONUNBUFFERED="1")
    log_path = home / "jupyter-lab.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=home / "root", env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    server = JupyterLabServer(home=home, port=port, token=token, process=process, log_path=log_path)
    try:
        wait_until(server._ready, timeout, f"jupyter lab on port {port} to answer /api/status")
    except BaseException:
        server.stop()
        raise
    return server


# ---------------------------------------------------------------------------
# The notebook's kernel, seen from the test process
# ---------------------------------------------------------------------------


class KernelError(RuntimeError):
    """An expression evaluated in the notebook's kernel raised."""


@dataclass
class NotebookKernel:
    """A second client of the kernel a notebook runs on, for reading its state."""

    connection_file: Path
    _client: Any = field(default=None, repr=False)

    def _connect(self):
        if self._client is None:
            from jupyter_client import BlockingKernelClient

            client = BlockingKernelClient(connection_file=str(self.connection_file))
            client.load_connection_file()
            # Shell only. Not wait_for_ready(): it drains IOPub until 0.2 s pass with no
            # message, which never happens while the dashboard streams comm messages.
            client.start_channels(iopub=False, stdin=False, hb=False, control=False)
            self._client = client
        return self._client

    def eval(self, expr: str, timeout: float = 30.0) -> str:
        """`repr` of `expr` evaluated in the kernel's user namespace.

        Uses `user_expressions` on a silent execute: no cell output, no history, no
        execution-count bump in the notebook. The request queues behind any running cell.
        """
        client = self._connect()
        msg_id = client.execute("", silent=True, store_history=False, user_expressions={"v": expr})
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = client.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"kernel did not evaluate {expr!r} within {timeout:.0f} s") from None
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        result = reply["content"].get("user_expressions", {}).get("v")
        if reply["content"]["status"] != "ok" or result is None:
            raise KernelError(f"kernel could not run {expr!r}: {reply['content']}")
        if result.get("status") != "ok":
            raise KernelError(f"{expr!r} raised {result.get('ename')}: {result.get('evalue')}")
        return result["data"]["text/plain"]

    def close(self) -> None:
        if self._client is not None:
            self._client.stop_channels()
            self._client = None


# ---------------------------------------------------------------------------
# The page: open a notebook, run cells, read outputs
# ---------------------------------------------------------------------------

# Installed before JupyterLab's own scripts on every load of the page:
# __spdlPanel finds the NotebookPanel for the notebook this page was opened on,
# __spdlBusy says why the notebook is not idle ('' once it is).
_JS_INIT = """
window.__spdlNotebook = %s;
window.__spdlPanel = () => {
  const app = window.jupyterapp;
  if (!app) return null;
  for (const w of app.shell.widgets('main')) {
    if (w.context && w.context.path === window.__spdlNotebook && w.content && w.sessionContext) {
      return w;
    }
  }
  return null;
};
window.__spdlBusy = () => {
  const p = window.__spdlPanel();
  if (!p || !p.context.isReady || p.content.widgets.length === 0) return 'notebook not open';
  const kernel = p.sessionContext.session && p.sessionContext.session.kernel;
  if (!kernel) return 'no kernel';
  if (kernel.connectionStatus !== 'connected') return 'kernel ' + kernel.connectionStatus;
  if (kernel.status !== 'idle') return 'kernel ' + kernel.status;
  for (const el of p.content.node.querySelectorAll('.jp-InputArea-prompt')) {
    if (el.textContent.includes('*')) return 'a cell is queued or running';
  }
  return '';
};
"""

# Runs a command with cell `index` active and alone selected. The command's promise
# (JupyterLab resolves it once the cells it queued have run) is parked on window, so
# Python polls it with a deadline instead of holding one long page.evaluate open.
_JS_RUN_COMMAND = """
([command, index]) => {
  const app = window.jupyterapp;
  const panel = window.__spdlPanel();
  if (!panel) throw new Error('notebook not open: ' + window.__spdlNotebook);
  app.shell.activateById(panel.id);
  const nb = panel.content;
  nb.activeCellIndex = index < 0 ? nb.widgets.length + index : index;
  nb.deselectAll();
  const token = Math.random().toString(36).slice(2);
  window.__spdlRuns = window.__spdlRuns || {};
  window.__spdlRuns[token] = null;
  app.commands.execute(command).then(
    (ran) => { window.__spdlRuns[token] = {ok: ran !== false, error: 'a cell raised'}; },
    (e) => { window.__spdlRuns[token] = {ok: false, error: String(e)}; });
  return token;
}
"""


def open_notebook(page, server: JupyterLabServer, name: str, timeout: float = 120.0) -> None:
    """Open `name` (relative to the server root) in `page`; return once its kernel is idle."""
    page.add_init_script(_JS_INIT % json.dumps(name))
    # A workspace of its own: the default one would restore the tabs an earlier test
    # left open (their kernels shut down, their widgets "model not found"), and start
    # kernels for them.
    workspace = f"t{secrets.token_hex(6)}"
    page.goto(server.url(f"lab/workspaces/{workspace}/tree/{name}"), wait_until="domcontentloaded")
    wait_for_idle(page, timeout)
    missing = page.evaluate(
        "(ids) => ids.filter((id) => !window.jupyterapp.isPluginActivated(id))",
        list(REQUIRED_PLUGINS),
    )
    if missing:
        raise RuntimeError(
            f"JupyterLab front-end plugins not active: {missing}; is the server running "
            f"from the environment where ipywidgets and jupyter_bokeh are installed?"
        )


def _run_command(page, command: str, index: int, timeout: float) -> None:
    token = page.evaluate(_JS_RUN_COMMAND, [command, index])
    page.wait_for_function(
        "(t) => window.__spdlRuns[t] !== null", arg=token, timeout=timeout * 1000, polling=100
    )
    outcome = page.evaluate("(t) => window.__spdlRuns[t]", token)
    wait_for_idle(page, timeout)
    if not outcome["ok"]:
        errors = "\n".join(error_outputs(page)) or "(no error output in the page)"
        raise RuntimeError(f"{command} with cell {index} active failed: {outcome['error']}\n{errors}")


def run_all_above_last_cell(page, timeout: float = 180.0) -> None:
    """Select the last cell and run every cell above it; return once they have run."""
    _run_command(page, "notebook:run-all-above", -1, timeout)


def run_cell(page, index: int, timeout: float = 120.0) -> None:
    """Run cell `index` (negative counts from the end); return once it has run."""
    _run_command(page, "notebook:run-cell", index, timeout)


def wait_for_idle(page, timeout: float = 120.0) -> None:
    """Wait until the notebook's kernel is idle and no cell shows a `[*]` prompt."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "() => !!window.__spdlBusy && window.__spdlBusy() === ''",
            timeout=timeout * 1000, polling=100,
        )
    except PlaywrightTimeout as exc:
        state = page.evaluate("() => window.__spdlBusy ? window.__spdlBusy() : 'page not loaded'")
        raise TimeoutError(f"notebook not idle after {timeout:.0f} s: {state}") from exc


_JS_ERRORS = """
() => {
  const found = [];
  const stderr = document.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"], '
    + '.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]');
  for (const el of stderr) {
    const t = el.textContent;
    if (/Traceback|Error/.test(t) && !found.includes(t)) found.push(t);
  }
  for (const el of document.querySelectorAll('.jp-OutputArea-output')) {
    const t = el.textContent;
    if (t.includes('Error displaying widget') && !found.includes(t)) found.push(t);
  }
  // ipywidgets 8 replaces a widget it cannot build with an icon; the JS error is in the console.
  for (const el of document.querySelectorAll('.jupyter-widgets-error-widget')) {
    found.push('a widget failed to render (ipywidgets error widget; see the browser console)');
  }
  return found;
}
"""


def error_outputs(page) -> list[str]:
    """Texts of error outputs, tracebacks on stderr, and widgets that failed to render."""
    return page.evaluate(_JS_ERRORS)


def screenshot(page, name: str, selector: str | None = None, timeout: float = 120.0) -> Path:
    """Save build/screenshots/<name>.png: of the element `selector` when given, else the page.

    A live dashboard is never "stable" as Playwright's element screenshot waits for it to
    be (its header, verdict and plots change several times a second, and on a busy
    machine a redraw spans animation frames), so the element is shot as a clip of the
    page at its current box: the picture of one moment, which is what a reader sees.
    """
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOT_DIR / f"{name}.png"
    clip = None
    if selector is not None:
        element = page.locator(selector).first
        element.wait_for(state="visible", timeout=timeout * 1000)
        # Scrolled by the page itself: Playwright's own scrolling also waits for stability.
        page.evaluate("(sel) => document.querySelector(sel).scrollIntoView({block: 'start'})", selector)
        box, view = element.bounding_box(), page.viewport_size
        if box is not None and view is not None:
            x, y = max(0.0, box["x"]), max(0.0, box["y"])
            clip = {"x": x, "y": y, "width": max(1.0, min(box["x"] + box["width"], view["width"]) - x),
                    "height": max(1.0, min(box["y"] + box["height"], view["height"]) - y)}
    page.screenshot(path=str(path), timeout=timeout * 1000, clip=clip, animations="disabled")
    return path


# ---------------------------------------------------------------------------
# Bokeh in the page
# ---------------------------------------------------------------------------

# jupyter_bokeh's BokehView builds one Bokeh Document per widget and renders it with
# Bokeh.embed.add_document_standalone, which registers its root views in the global
# Bokeh.index; a source is found by name in those documents. Roots whose element has
# left the page (a re-run cell) are skipped.
_JS_COLUMN_LENGTH = """
([source, column]) => {
  const B = window.Bokeh;
  if (!B || !B.index) return null;
  const seen = new Set();
  let length = null;
  for (const view of B.index.roots) {
    const doc = view.model.document;
    if (!view.el || !view.el.isConnected || !doc || seen.has(doc)) continue;
    seen.add(doc);
    const model = doc.get_model_by_name(source);
    const values = model && typeof model.get_column === 'function' ? model.get_column(column) : null;
    if (values != null) length = Math.max(length ?? 0, values.length);
  }
  return length;
}
"""


def bokeh_column_length(page, source_name: str, column: str) -> int | None:
    """Length of `column` of the ColumnDataSource named `source_name`, as BokehJS holds it.

    None when no rendered Bokeh document has that source, or the source lacks `column`.
    """
    return page.evaluate(_JS_COLUMN_LENGTH, [source_name, column])


def bokeh_plot_count(page, selector: str = ".jp-Notebook") -> int:
    """Number of Bokeh plots inside `selector` that have drawn a canvas of non-zero size.

    Each plot has one `.bk-Canvas` element (in the figure's shadow root) holding its
    canvas layers in a shadow root of its own; Playwright's CSS engine pierces open
    shadow roots, so the locator below reaches it.
    """
    return page.locator(f"{selector} .bk-Canvas").evaluate_all(
        """(els) => els.filter((el) => Array.from((el.shadowRoot || el).querySelectorAll('canvas'))
                                .some((c) => c.width > 0 && c.height > 0)).length"""
    )


# ---------------------------------------------------------------------------
# A notebook open in a page, with a line to its kernel
# ---------------------------------------------------------------------------


@dataclass
class OpenNotebook:
    """A copy of the notebook `source` in the server root, shown in `page`."""

    page: Page
    server: JupyterLabServer
    source: Path
    _kernel: NotebookKernel | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.source.name

    def open(self, timeout: float = 120.0) -> None:
        """Copy the notebook into the server root and open it; return once its kernel is idle."""
        shutil.copy2(self.source, self.server.root / self.name)
        open_notebook(self.page, self.server, self.name, timeout)

    def kernel_eval(self, expr: str, timeout: float = 30.0) -> str:
        """`repr` of `expr` evaluated in the kernel this notebook runs on."""
        if self._kernel is None:
            self._kernel = NotebookKernel(self.server.kernel_connection_file(self.name))
        return self._kernel.eval(expr, timeout)

    def close(self) -> None:
        """Close the page and shut the notebook's kernel down."""
        if self._kernel is not None:
            self._kernel.close()
        self.page.close()
        try:
            for s in self.server.api("GET", "api/sessions"):
                if s.get("path") == self.name:
                    self.server.api("DELETE", f"api/sessions/{s['id']}", timeout=30.0)
        except (urllib.error.URLError, OSError):
            pass  # the server is gone; its stop() reaps kernels
