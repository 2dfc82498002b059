"""The live dashboard: a header, concurrency controls, five Bokeh plots, a stage table and a verdict.
It reads only the session's frames and acts only through its control methods; one publisher thread
pushes new ticks at ``hz``, under the lock every change takes (slider callbacks come on subshells)."""

from __future__ import annotations

import contextlib
import html
import math
import threading
import time
from typing import Any

import ipywidgets as widgets
import numpy as np
from bokeh.io import output_notebook
from bokeh.io.state import curstate
from bokeh.resources import INLINE
from IPython import get_ipython
from jupyter_bokeh.widgets import BokehModel

from .._integrations import PER_WORKER
from .._interpreter import describe
from .._pipeline import check_ints
from .._runners import RUNNERS
from .._table import num
from .._telemetry.live_verdict import Window, live_verdict
from ..errors import SpdlLabError
from .live_plots import CPU_SERIES, DEFAULT_ROLLOVER, WINDOWS_S, LivePlots

#: Plot pushes per second: each is comm messages that take the GIL from the training loop.
DEFAULT_HZ = 2.0
#: The stage table averages over this many seconds (the verdict over its own window).
TABLE_WINDOW_S = 2.0
#: The header, stage table and verdict are rewritten at most this often (or on a state change).
TEXT_EVERY_S = 1.0
#: The "auto" toggle's budget (seconds), and how many of its latest moves are shown.
AUTO_BUDGET_S = 60.0
AUTO_LOG_LINES = 8
#: The stage table's columns after stage and concurrency: (series, format).
_TABLE = (("qps", ".1f"), ("p50_ms", ".2f"), ("p99_ms", ".2f"), ("busy_frac", ".0%"))
#: Plots wait this long for the runner to name its queues (a child process takes a while).
QUEUE_WAIT_S = 10.0


class LiveView(widgets.VBox):
    """What both dashboards share: a publisher thread (``_run``, every 1/``hz`` s), one Bokeh view
    (``_show``), and ``close()``, which stops them and leaves what they show as it is."""

    def __init__(self, css_class: str, hz: float) -> None:
        self._closed = threading.Event()  # first: ipywidgets' __del__ calls close() even then
        self._publisher: threading.Thread | None = None
        self._bokeh: Any = None
        if not isinstance(hz, (int, float)) or not hz > 0:
            raise SpdlLabError(f"{type(self).__name__}: hz must be a number > 0 (updates per "
                               f"second), got {hz!r}")
        super().__init__()
        self.add_class(css_class)
        if get_ipython() is not None and not curstate().notebook:  # BokehJS once, INLINE: offline
            output_notebook(INLINE, hide_banner=True)
        self.interval_s = 1.0 / hz
        self._plot_box = widgets.Box()
        self._lock = threading.RLock()  # widget callbacks come on other threads, and nest
        self.header, self.verdict, self.table = widgets.HTML(), widgets.HTML(), widgets.HTML()
        #: the verdict last shown
        self.last_verdict: Any = None

    def _show(self, layout: Any) -> None:
        old, self._bokeh = self._bokeh, _BokehView(layout)
        self._plot_box.children = [self._bokeh]
        if old is not None:
            old.close()

    def close(self) -> None:
        """Stop publishing (and an autotuner) and close the widgets; the session is left as is."""
        self._closed.set()
        if getattr(self, "autotuner", None) is not None:
            self.autotuner.stop()
        publisher = self._publisher
        if publisher is not None and publisher is not threading.current_thread():
            publisher.join(5.0)
        if self._bokeh is not None:
            self._bokeh.close()
        super().close()


class Dashboard(LiveView):
    """A live view of one Session (``session.dashboard()``); ``sliders[stage].value = 8`` moves a
    slider. The runner selector and the start button replace ``session`` with a new one;
    ``close()`` stops the publisher, not the session."""

    def __init__(self, session: Any, *, hz: float = DEFAULT_HZ, rollover: int = DEFAULT_ROLLOVER) -> None:
        check_ints("Dashboard", rollover=(rollover, 1))
        super().__init__("spdl-lab-dashboard", hz)
        self.rollover = rollover
        self.interpreter = describe()
        #: CPU seconds the publisher thread has spent, and how many times it published.
        self.publisher_cpu_s, self.publishes = 0.0, 0
        self._text_at, self._text_state = -math.inf, ""
        self._by_code = False  # a widget's value set by code (``_quietly``), not the user
        #: auto_log: the autotuner's moves and their reasons, newest last
        self.message, self.auto_log = widgets.HTML(), widgets.HTML()
        self.runner = widgets.Dropdown(description="runner", layout=widgets.Layout(width="260px"))
        self.start_button = widgets.Button(description="start", icon="play", layout=widgets.Layout(width="90px"))
        self.stop_button = widgets.Button(description="stop", icon="stop", layout=widgets.Layout(width="90px"))
        self.start_button.on_click(lambda _: self._start())
        self.stop_button.on_click(lambda _: self._stop())
        self.runner.observe(self._on_runner, names="value")
        self.window = widgets.ToggleButtons(
            options=[(f"last {w / 60:g} min", w) for w in WINDOWS_S], value=WINDOWS_S[1],
            description="show", style={"button_width": "90px"})
        self.window.observe(self._on_window, names="value")
        #: "auto": session.autotune() moves the sliders; moving one yourself takes over
        self.auto = widgets.ToggleButton(description="auto", icon="magic", layout=widgets.Layout(width="90px"),
                                         tooltip="let the lab tune the concurrency for the training step")
        self.auto.observe(self._on_auto, names="value")
        self.auto_budget_s = AUTO_BUDGET_S
        self.autotuner: Any = None
        self.auto_log.add_class("spdl-lab-auto-log")
        self._slider_box = widgets.VBox()
        controls = widgets.HBox([self.runner, self.start_button, self.stop_button, self.auto,
                                 self.window])
        self.children = [self.header, controls, self._slider_box, self.verdict, self.auto_log,
                         self._plot_box, self.table, self.message]
        with self._lock:
            self._attach(session)

    def _attach(self, session: Any) -> None:
        """Show ``session``: fresh sliders, plots and window; start publishing."""
        if self.autotuner is not None:  # it tuned the session being replaced
            self.autotuner.stop()
            self._quietly(self.auto, value=False)
        self.session, self._cursor, self._window = session, 0, Window()
        pipeline = session.pipeline
        # Only a lab.Pipeline under a lab runner can restart under another (not runner "spdl").
        switchable = pipeline is not None and session.runner in RUNNERS
        self._applied: dict[str, int] = dict(session.controls())
        self._quietly(self.runner, options=list(RUNNERS) if switchable else [session.runner],
                      value=session.runner, disabled=not switchable)  # options move the value too
        # Autotune drives a local session's loop (a remote one is steered slider by slider).
        self.auto.disabled = not callable(getattr(session, "autotune", None)) or not self._applied
        self.sliders = {name: self._slider(name, n) for name, n in self._applied.items()}
        self._slider_box.children = list(self.sliders.values())
        # A RemoteSession has no Pipeline object here, but knows the names of the run's stages;
        # a DataLoader's (fetch, collate) show up in its frames.
        self._stages = (["source", *(s.name for s in pipeline.stages)] if pipeline is not None
                        else list(getattr(session, "stage_names", ())))
        self._seen: set[tuple[str, str]] = set()  # (series, stage) with a value in some tick
        self.plots: LivePlots | None = None  # drawn by the first publish, again when new lines appear
        self._publish_locked()
        if self._publisher is None and not self._closed.is_set():
            self._publisher = threading.Thread(target=self._run, name="spdl_lab:dashboard", daemon=True)
            self._publisher.start()

    def _slider(self, name: str, value: int) -> widgets.IntSlider:
        slider = widgets.IntSlider(value=value, min=1, max=max(16, 2 * value), description=name,
                                   continuous_update=False, layout=widgets.Layout(width="420px"),
                                   style={"description_width": "80px"})
        slider.add_class("spdl-lab-slider")
        slider.add_class(f"spdl-lab-slider-{name}")
        slider.observe(lambda change: self._on_slider(name, change["new"]), names="value")
        return slider

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            with self._lock:
                self._publish_locked(text=False)
                if not self.session.running and not len(self.session.frames_since(self._cursor)):
                    self._publisher = None  # start and the runner selector start a new one
                    return

    def publish(self) -> None:
        """Push what is new now (the publisher thread does this ``hz`` times a second)."""
        with self._lock:
            self._publish_locked()

    def _publish_locked(self, *, text: bool = True) -> None:
        """Stream the new ticks into the plots; rewrite the text when ``text``, when TEXT_EVERY_S
        has passed, or when the session's state changed."""
        cpu0 = time.thread_time()
        session = self.session
        chunk = session.frames_since(self._cursor)
        self._cursor = chunk.cursor
        self._window.add(chunk)
        self._seen.update(key for key, values in chunk.columns.items() if np.isfinite(values).any())
        lines = self._lines(session)
        # Drawn once the runner names its queues (or after QUEUE_WAIT_S); redrawn when new lines appear.
        early = self.plots is None and not lines["queues"] and self._stages and session.running
        if early and session.elapsed_s < QUEUE_WAIT_S:
            _set(self.message, "waiting for the runner's first sample…")
        elif self.plots is None or lines["why_empty"] != self.plots.why_empty or any(
                set(lines[k]) - set(getattr(self.plots, k)) for k in ("queues", "stages", "cpu")):
            _set(self.message, "")
            self._draw(lines)
        else:
            self.plots.stream(self.plots.stream_chunk(chunk))
        self._sync_sliders(session)
        if self.autotuner is not None and not self.autotuner.running and self.auto.value:
            self._quietly(self.auto, value=False)  # the tuning ended: done, stopped, or taken over
        now = time.monotonic()
        if text or now - self._text_at >= TEXT_EVERY_S or session.state != self._text_state:
            self._text_at, self._text_state = now, session.state
            self._write_text(session)
        self.publisher_cpu_s += time.thread_time() - cpu0
        self.publishes += 1

    def _write_text(self, session: Any) -> None:
        _set(self.header, self._header_html(session))
        _set(self.table, self._table_html(session, self._window.means(TABLE_WINDOW_S)))
        self.last_verdict = verdict = live_verdict(self._window.means(), runner=session.runner,
                                                   controls=self._applied,
                                                   cpu_cores=self.interpreter.cpu_cores)
        _set(self.verdict, f"<b>verdict:</b> {html.escape(verdict.text)}")
        if session.error is not None:
            _error(self.message, f"the session failed: {type(session.error).__name__}: {session.error}")

    def _lines(self, session: Any) -> dict[str, Any]:
        """What the plots draw now: stages, queues, CPU lines, and why a plot has none."""
        seen = self._seen
        stages = list(self._stages)
        stages += [stage for series, stage in sorted(seen) if series == "tasks" and stage not in stages]
        queues = [stage for series, stage in sorted(seen) if series == "queue_depth"]
        # The children line only where the CPU probe looks for children (not: a thread runner).
        cpu = [s for s, _ in CPU_SERIES if s != "children" or ("processes", "children") in seen
               or ("cpu_percent", "children") in seen]
        return {"stages": stages, "queues": queues, "cpu": cpu, "why_empty": _why_empty(session, self._window)}

    def _draw(self, lines: dict[str, Any]) -> None:
        self.plots = LivePlots(rollover=self.rollover, **lines)
        self.plots.set_window(self.window.value)
        self.plots.stream(self.plots.stream_chunk(self.session.frames_since(0)))
        self._show(self.plots.layout)

    def _sync_sliders(self, session: Any) -> None:
        for name, n in session.controls().items():
            if (slider := self.sliders.get(name)) is None or slider.value == n:
                continue
            self._applied[name] = n  # first, so the observer sees nothing to apply
            slider.max = max(slider.max, n)
            slider.value = n

    def _header_html(self, session: Any) -> str:
        bps = self._window.rate(("steps", "step"), TABLE_WINDOW_S)  # steps counted over their wall time
        steps = self._window.latest(("steps", "step"))
        limit = f"/{session.steps}" if session.steps else ""
        parts = [f"runner <b>{html.escape(session.runner)}</b>", f"<b>{session.state}</b>",
                 f"Python {self.interpreter.python}, {self.interpreter.gil}",
                 f"{session.elapsed_s:.0f} s", f"steps {0 if math.isnan(steps) else int(steps)}{limit}",
                 f"{num(bps, '.2f')} steps/s"]
        return "<div style='font-size:13px'>spdl_lab · " + " · ".join(parts) + "</div>"

    def _table_html(self, session: Any, means: dict) -> str:
        worker_rows = {w for series, w in self._seen if series == PER_WORKER["qps"]}
        stages = self._stages
        if session.pipeline is None:  # a DataLoader's: each stage, then its workers' parts
            workers = sorted(worker_rows, key=lambda name: int(name.rpartition("/worker")[2]))
            stages = [row for stage in self._lines(session)["stages"]
                      for row in [stage, *(w for w in workers if w.startswith(f"{stage}/"))]]
        if not stages:
            return ""
        queues = {stage.split("→")[0]: stage for series, stage in means if series == "queue_depth"}
        rows = []
        for stage in stages:
            queue = queues.get(stage)
            depth, cap = (means.get((s, queue), math.nan) for s in ("queue_depth", "queue_capacity"))
            names = PER_WORKER if stage in worker_rows else {}  # one worker's part of a stage
            figures = (num(means.get((names.get(s, s), stage), math.nan), fmt) for s, fmt in _TABLE)
            rows.append([stage, num(self._window.latest(("concurrency", stage)), ".0f"), *figures,
                         f"{num(depth, '.1f')}/{num(cap, '.0f')}" if queue else ""])
        head = ["stage", "concurrency", "items/s", "p50 ms", "p99 ms", "busy", "out queue"]
        return html_table(head, rows)

    def _on_slider(self, stage: str, n: int) -> None:
        with self._lock:
            if self._applied.get(stage) == n:
                return
            try:
                self.session.set_concurrency(stage, n)
                self._applied[stage] = n
            except SpdlLabError as exc:
                _error(self.message, str(exc))

    def _on_auto(self, change: dict[str, Any]) -> None:
        if self._by_code:
            return
        if change["new"]:
            with self._lock:
                try:
                    self.autotuner = self.session.autotune(budget_s=self.auto_budget_s, on_log=self._on_auto_log)
                except SpdlLabError as exc:
                    _error(self.message, str(exc))
                    self._quietly(self.auto, value=False)
        elif self.autotuner is not None:
            self.autotuner.stop()

    def _on_auto_log(self, sentence: str) -> None:
        tuner = self.autotuner
        lines = (tuner.log if tuner is not None else [sentence])[-AUTO_LOG_LINES:]
        _set(self.auto_log, "<b>auto:</b><ul style='margin:0'>" + "".join(
            f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>")

    def _quietly(self, widget: Any, **values: Any) -> None:
        self._by_code = True
        try:
            for name, value in values.items():
                setattr(widget, name, value)
        finally:
            self._by_code = False

    def _on_window(self, change: dict[str, Any]) -> None:
        with self._lock:
            if self.plots is None:
                return
            if change["new"] > change["old"]:  # a longer window: redraw from the session's history
                self._draw(self._lines(self.session))
            else:
                self.plots.set_window(change["new"])
                self.plots.stream({k: [] for k in self.plots.source.data})  # trim now

    def _on_runner(self, change: dict[str, Any]) -> None:
        runner = change["new"]
        with self._lock:
            if self._by_code or runner is None or runner == self.session.runner:
                return
            self._swap(lambda: self.session.restart(runner=runner))

    def _start(self) -> None:
        with self._lock:
            if not self.session.running:
                self._swap(lambda: self.session.restart())

    def _stop(self) -> None:
        self.session.stop()
        self.publish()

    def _swap(self, make: Any) -> None:
        try:
            session = make()
        except SpdlLabError as exc:
            _error(self.message, str(exc))
            return
        _set(self.message, "")
        self._attach(session)


class _BokehView(BokehModel):
    """Closable twice: ipywidgets' ``__del__`` closes again, and jupyter_bokeh raises KeyError."""

    def close(self) -> None:
        with contextlib.suppress(KeyError):
            super().close()


def _why_empty(session: Any, window: Window) -> dict[str, str]:
    """Why the throughput and queue plots would have no line, in one sentence each."""
    if (workers := window.latest(("num_workers", "dataloader"))) == 0:
        return {"stages": "no stage meters: a DataLoader with num_workers=0 runs its Dataset and "
                          "collate_fn in the loop's thread; their time is the data wait (training step plot)",
                "queues": "no queue: a DataLoader with num_workers=0 fetches each batch when the loop asks"}
    if workers == workers:  # a DataLoader with workers, before their first readings
        return {"stages": "no stage meters yet: waiting for the DataLoader's workers to start",
                "queues": "no queue yet: waiting for the DataLoader's workers to start"}
    runner = getattr(session, "runner", "iterable")
    return {"stages": f"no stage meters: the loop iterates a {runner} as it is; run a lab.Pipeline "
                      f"(or a torch DataLoader with workers) to see its stages",
            "queues": f"no queue meters: a {runner} iterated as it is has none the lab can read"}


def html_table(head: list[str], rows: list[list[str]], css_class: str = "") -> str:
    """A widget's table, every cell escaped."""
    def row(cells: list[str], tag: str = "td") -> str:
        inner = "".join(f"<{tag} style='padding:0 8px'>{html.escape(c)}</{tag}>" for c in cells)
        return f"<tr>{inner}</tr>"

    body = "".join(map(row, rows))
    return f"<table class='{css_class}' style='font-size:12px'>{row(head, 'th')}{body}</table>"


def _set(widget: widgets.HTML, value: str) -> None:
    if widget.value != value:  # unchanged values would still cost a comm message
        widget.value = value


def _error(widget: widgets.HTML, text: str) -> None:
    _set(widget, f"<span style='color:#b00'>{html.escape(text)}</span>")
