"""``session.autotune()``: the same climb, on a running session's own loop, through its own
``set_concurrency``. It moves only the running runner's knobs (a switch would restart the session);
a knob found at a value it did not set hands control back to the user."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pandas as pd

from .._experiments.contender import MachineClock, Window, gil_fracs
from .._telemetry.probes import GilProbe
from .._training.device import training_waits
from ..errors import PipelineSpecError, SpdlLabError
from . import bench
from .model import RateModel, batch_items
from .result import trials_frame
from .search import GIL_SWITCH, Climb, Step, climb
from .space import Config, Space, Trial


class _Ended(Exception):
    """The tuning ends early: stopped, or the user moved a knob (it hands control back)."""


class AutoTuner:
    """Tunes a running Session's concurrency in a background thread; made by ``session.autotune()``.
    ``log`` grows one sentence per move (each also passed to ``on_log``); ``stop()`` ends it early."""

    def __init__(self, session: Any, *, budget_s: float = 60.0, window_s: float | None = None,
                 on_log: Callable[[str], None] | None = None) -> None:
        if session.loader is None or session.pipeline is None:
            raise PipelineSpecError("autotune needs a session started from a lab.Pipeline; this one runs an "
                                    "iterable whose concurrency it cannot change")
        self.budget_s = bench.check_budget(budget_s, "autotune")
        if not session.running:
            raise SpdlLabError("autotune: the session is not running; start it (or restart()) first")
        self.session = session
        self.window_s = window_s if window_s is not None else bench.window_for_budget(self.budget_s)
        self.on_log = on_log
        self.log: list[str] = []
        self.steps: list[Step] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._ours: dict[str, int] = dict(session.controls())
        self._items = batch_items(session.pipeline)
        self._machine = MachineClock(next((p for p in getattr(session, "_probes", []) if isinstance(p, GilProbe)),
                                          None))
        self._thread = threading.Thread(target=self._main, name="spdl_lab:autotune", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        """End the tuning now; the session keeps the best setting kept so far."""
        self._stop.set()
        self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the tuning to end; True if it has."""
        return self._done.wait(timeout)

    @property
    def best(self) -> dict[str, int]:
        kept = [s for s in self.steps if s.kept]
        return dict(kept[-1].trial.config.knobs) if kept else dict(self._ours)

    @property
    def trials(self) -> pd.DataFrame:
        """One row per measured configuration, as ``Tuning.trials``."""
        return trials_frame(list(self.steps), self.session.pipeline)

    def _say(self, sentence: str) -> None:
        self.log.append(sentence)
        if self.on_log is not None:
            with contextlib.suppress(Exception):  # a display's failure must not end the tuning
                self.on_log(sentence)

    def _main(self) -> None:
        session = self.session
        space = Space(session.pipeline, [session.runner], self._machine.cores)
        search = Climb(space, RateModel(session.pipeline, space.cores))
        first = Config.of(session.runner, session.controls())
        deadline = time.perf_counter() + self.budget_s
        self._say(f"autotune: {self.budget_s:g} s on the running {session.runner} session; "
                  f"move a slider to take over")
        ending = "converged: no move is predicted to gain, and none is left to explore"
        try:
            for step in climb(search, first, lambda c: self._measure(c, deadline)):
                self.steps.append(step)
                self._say(step.sentence)
                longest = max(s.trial.elapsed_s for s in self.steps)
                if time.perf_counter() + longest > deadline:
                    ending = "budget spent"
                    break
        except _Ended as exc:
            ending = str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported, and the session goes on
            self.error = exc
            ending = f"failed: {type(exc).__name__}: {exc}"
        finally:
            try:
                if self.steps and not ending.startswith("you took over") and self.session.running:
                    self._set(self.best)
                    runs = Config.of(session.runner, self.best).describe()
                    ending += f"; the session runs {runs}{self._gil_advice()}"
                self._say(ending)
            finally:
                self._done.set()

    def _gil_advice(self) -> str:
        kept = [s for s in self.steps if s.kept]
        wait = kept[-1].trial.train_gil_wait_frac if kept and self.session.runner == "thread" else math.nan
        if not (math.isfinite(wait) and wait >= GIL_SWITCH):
            return ""
        return (f". The training thread still waits for the GIL {wait:.0%} of its step: try the "
                f"subprocess-threads runner (the runner selector), or lab.tune across runners")

    def _check(self) -> None:
        if self._stop.is_set():
            raise _Ended("stopped")
        if not self.session.running:
            raise SpdlLabError("the session ended while it was being tuned")
        now = self.session.controls()
        for name, n in now.items():
            if self._ours.get(name) != n:
                raise _Ended(f"you took over: {name} was moved to {n}; autotune handed control back")

    def _set(self, knobs: dict[str, int]) -> None:
        for name, n in knobs.items():
            if self.session.controls().get(name) != n:
                self._ours[name] = n
                self.session.set_concurrency(name, n)

    def _measure(self, config: Config, deadline: float) -> Trial:
        started = time.perf_counter()
        self._check()
        # Made under the setting before: queued (the readings show it) and held unseen (reorder windows).
        unseen = bench.unseen_batches(self.session.pipeline, self.session.controls(), self._items)
        self._set(dict(config.knobs))
        loader = self.session.loader
        self._steps(bench.queued_batches(loader.reading(), self._items) + unseen + 2, deadline)
        before = loader.reading()
        windows = bench.windows_until_sure(lambda: self._window(deadline), deadline)
        return bench.trial_of(config, windows, before, loader.reading(), self._items, started)

    def _steps(self, n: int, deadline: float) -> list:
        """Wait for ``n`` more training steps of the session (checking for stop and takeover)."""
        clock = self.session.clock
        records = clock.records()
        last = records[-1].index if records else -1
        limit = max(deadline, time.perf_counter()) + 30.0
        while True:
            self._check()
            new = [r for r in clock.records() if r.index > last]
            if len(new) >= n:
                return new[:n]
            if time.perf_counter() > limit:
                raise SpdlLabError(f"autotune: the session made {len(new)} of {n} steps in 30 s past the budget")
            self._stop.wait(0.02)

    def _window(self, deadline: float) -> Window:
        recent = self.session.clock.records()[-20:]
        loop = sum(r.data_wait_s + r.step_s for r in recent)
        rate = len(recent) / loop if loop > 0 else 4.0 / self.window_s
        device = self.session.device
        t_a, ours_a, _, gil_a = self._machine.read()
        dev_a = device.totals() if device is not None else None
        records = self._steps(max(2, round(rate * self.window_s)), deadline)
        t_b, ours_b, _, gil_b = self._machine.read()
        dev_b = device.totals() if device is not None else None
        ours = (ours_b - ours_a) / max(t_b - t_a, 1e-9) * 100.0
        gil, queued = gil_fracs(gil_a, gil_b)
        train_gil, train_queued = training_waits(dev_a, dev_b)
        return Window(runner=self.session.runner, round=0, started_s=0.0, records=tuple(records),
                      cpu_percent=min(max(0.0, ours), 100.0 * self._machine.cores), others_percent=math.nan,
                      gil_wait_frac=gil, runqueue_wait_frac=queued, train_gil_wait_frac=train_gil,
                      train_runqueue_wait_frac=train_queued)
