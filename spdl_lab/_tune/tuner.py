"""``lab.tune``: climb on the model, keeping a move only beyond the noise; then the best and the
start side by side in alternating rounds, which the advice reads. ``session.autotune()``
(``AutoTuner``): the same climb on a running session's loop, through its ``set_concurrency``."""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd
import psutil

from .._experiments.compare import MachineClock, Window
from .._integrations.torch_dataloader import from_dataloader, is_dataloader
from .._pipeline import Pipeline, validate_concurrency
from .._progress import progress_bar
from .._runners import DEFAULT_NUM_WORKERS
from .._training import SimulatedDevice, cuda_available
from ..errors import PipelineSpecError, SpdlLabError
from . import bench
from .bench import MAX_WINDOWS, MIN_WINDOWS, Bench, check_budget, window_for_budget
from .result import Tuning, trials_frame
from .search import GIL_SWITCH, Climb, Step, advise, busy_reason, climb, others_percent
from .space import TUNABLE_RUNNERS, Config, RateModel, Space, Trial, batch_items, dataloader_options

CONFIRM_ROUNDS = 3  # of the final side-by-side measurement of the best against the start
CONFIRM_SHARE = 0.2  # of the budget kept for it
TIGHT_WINDOWS = 40  # budgets under this many windows measure trials in fewer windows
#: The least time a window may take before the tuning fails as hung: a runner's start-up (workers
#: importing torch on a loaded machine) can take seconds.
WINDOW_TIMEOUT_S = 60.0


def tune(pipeline: Pipeline | Any, step: Callable[[Any], Any] | SimulatedDevice, *,
         runners: Sequence[str] = TUNABLE_RUNNERS, budget_s: float = 60.0,
         start: str | Mapping[str, Any] | None = None, runner_options: Mapping[str, Mapping[str, Any]] | None = None,
         diagnosis: Any = None, window_s: float | None = None, progress: bool = True, probes: bool = True) -> Tuning:
    """Find the configuration with the most training batches/s for ``step`` within ``budget_s``
    seconds: each map stage's concurrency, the process runner's ``num_workers``, and the runner.
    ``pipeline`` may be a torch DataLoader: it starts as itself (the process runner), its own
    ``prefetch_factor``, ``persistent_workers`` and (with CUDA) ``pin_memory`` are knobs too, and
    it runs epoch after epoch as a training loop does. ``start`` is a runner or
    ``{"runner": ..., "concurrency": {...}}``; ``diagnosis`` seeds the model.

    ``tuning.best`` is a move only when it ran faster than the start beyond the noise, side by
    side, on a machine whose other processes left the cores alone; otherwise it is the start
    (``tuning.advice`` says "keep what you have" and the ratio measured). Example::

        tuning = lab.tune(p, step=train_step, budget_s=60)
        tuning.advice, tuning.warnings, tuning.speedup   # the speedup is measured side by side
        loader = tuning.loader()
    """
    from_dl = not isinstance(pipeline, Pipeline) and is_dataloader(pipeline)
    source, pipeline = pipeline, from_dataloader(pipeline) if from_dl else pipeline
    runners = _check(pipeline, step, runners, budget_s, window_s)
    options = {r: dict((runner_options or {}).get(r, {})) for r in runners}
    epoch_batches = None
    if from_dl:  # it starts as itself: the process runner with its own keyword arguments
        options["process"] = {**_dataloader_start(source), **options.get("process", {})}
        with contextlib.suppress(TypeError):  # no length over an IterableDataset
            epoch_batches = len(source) or None
    if "process" in options:
        _check_dataloader_kwargs(options["process"])
    t0 = time.perf_counter()
    end = t0 + float(budget_s)  # with the runners closed: measuring ends bench.close_cost() before
    window_s = window_s if window_s is not None else window_for_budget(budget_s)
    space = Space(pipeline, runners, psutil.cpu_count() or 1, options,
                  process_options=dataloader_options(cuda_available()) if from_dl else {})
    search = Climb(space, RateModel(pipeline, space.cores, _verdicts(diagnosis)))
    first = _start(space, start, runners, from_dl)
    # Else a budget under TIGHT_WINDOWS windows pays for the start and the confirmation only.
    tight = budget_s < TIGHT_WINDOWS * window_s
    bench = Bench(pipeline, step, window_s=window_s, probes=probes, t0=t0, epoch_batches=epoch_batches,
                  min_windows=2 if tight else MIN_WINDOWS, max_windows=4 if tight else MAX_WINDOWS)
    bar = progress_bar(max(1, round(budget_s)), progress, "s")
    # The confirmation: two rounds (one if tight) of drain, warm-up, window for both; 20-40% of it.
    reserve = min(0.4 * budget_s, max(CONFIRM_SHARE * budget_s, (4.5 if tight else 9.0) * window_s))
    log: list[str] = []
    before = others_percent()  # the machine before measuring: what other processes take
    if (busy := busy_reason([before], space.cores, "before it measured")) is not None:
        log.append(f"{busy}: the rates below move with their load")
    steps: list[Step] = []
    stopped = "converged: no move is predicted to gain, and none is left to explore"
    try:
        def affordable(config: Config) -> bool:
            # Room for this trial (its runner's start-up included) and the confirmation after it.
            if end - bench.close_cost(config) - time.perf_counter() >= reserve + bench.trial_cost(config):
                return True
            nonlocal stopped
            stopped = "budget spent (no move left that fits in it)"
            return False

        def measure(config: Config) -> Trial:
            deadline = end - bench.close_cost(config) - reserve
            return bench.measure(config, max(WINDOW_TIMEOUT_S, deadline - time.perf_counter()), deadline)

        for step_ in climb(search, first, measure, affordable):
            steps.append(step_)
            log.append(step_.sentence)
            best = next(s.trial for s in reversed(steps) if s.kept)
            _tick(bar, t0, budget_s, f"best {best.batches_per_s:.3g} batches/s")
        log.append(f"stopped: {stopped}")
        start_trial = steps[0].trial
        during: list[float] = []
        speedup = _confirm(bench, start_trial, best, end - bench.close_cost(), log, during)
        change = max((s.trial for s in steps[1:] if s.trial.batches_per_s > 0),
                     key=lambda t: t.batches_per_s, default=None)
        advice = advise(start_trial, best, change, speedup, cores=space.cores, before=before, during=during)
        log.append(advice.sentence)
        change_speedup = speedup
        if not advice.move:
            best, speedup = start_trial, (1.0, 1.0, 1.0)
        _tick(bar, t0, budget_s, "done")
    finally:
        bar.close()
        bench.close()
    return Tuning.build(pipeline=pipeline, source_is_dataloader=from_dl, start=first, best=best, steps=steps,
                        log=log, speedup=speedup, budget_s=float(budget_s),
                        elapsed_s=time.perf_counter() - t0, cores=space.cores, advice=advice, change=change,
                        change_speedup=change_speedup, others_before=before)


def _confirm(bench: Bench, start: Trial, best: Trial, deadline: float,
             log: list[str], others: list[float]) -> tuple[float, float, float]:
    """Median, lowest and highest ratio of best to start over alternating rounds; other processes'
    CPU over each round's windows goes to ``others``."""
    if best.config == start.config:
        log.append("the starting configuration stayed the best: speedup 1.00x")
        return 1.0, 1.0, 1.0
    ratios = []
    began = time.perf_counter()
    for round_ in range(CONFIRM_ROUNDS):
        # One round at least; more (a range, not a point) while the next fits in the budget.
        now = time.perf_counter()
        if ratios and now + (now - began) / len(ratios) > deadline:
            break
        order = (start, best) if round_ % 2 == 0 else (best, start)
        windows = {t.config: bench.rate_once(t.config, max(WINDOW_TIMEOUT_S, deadline - time.perf_counter()))
                   for t in order}
        others += [w.others_percent for w in windows.values()]
        if (was := windows[start.config].batches_per_s) > 0:
            ratios.append(windows[best.config].batches_per_s / was)
    if not ratios:
        return best.batches_per_s / start.batches_per_s, math.nan, math.nan
    mid = statistics.median(ratios)
    rounds = "1 round" if len(ratios) == 1 else f"{len(ratios)} alternating rounds"
    log.append(f"side by side, {rounds}: the best ran {mid:.2f}x the start "
               f"(rounds {min(ratios):.2f}x to {max(ratios):.2f}x)")
    return mid, min(ratios), max(ratios)


def _tick(bar: Any, t0: float, budget_s: float, text: str) -> None:
    bar.set_description(text)
    if (done := min(round(budget_s), round(time.perf_counter() - t0))) > bar.n:
        bar.update(done - bar.n)


def _dataloader_start(dl: Any) -> dict[str, Any]:
    """The DataLoader's own keyword arguments the tuner starts from (``num_workers`` at least 1)."""
    own: dict[str, Any] = {"num_workers": max(1, dl.num_workers), "prefetch_factor": dl.prefetch_factor or 2,
                           "persistent_workers": bool(dl.persistent_workers) and dl.num_workers > 0}
    if cuda_available():
        own["pin_memory"] = bool(dl.pin_memory)
    return own


def _check_dataloader_kwargs(options: Mapping[str, Any]) -> None:
    """Refuse worker options without worker processes, as torch's DataLoader does (the process
    runner would drop them silently)."""
    given = {k: options[k] for k in ("prefetch_factor", "persistent_workers") if options.get(k)}
    if options.get("num_workers", DEFAULT_NUM_WORKERS) == 0 and given:
        named = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise PipelineSpecError(f"tune: torch's DataLoader refuses num_workers=0 with {named}: they set up "
                                f"worker processes, and 0 loads in the main process. Pass num_workers >= 1, "
                                f"or leave them out")


def _check(pipeline: Pipeline, step: Any, runners: Any, budget_s: Any, window_s: Any) -> list[str]:
    if not isinstance(pipeline, Pipeline):
        raise PipelineSpecError(f"tune takes a lab.Pipeline or a torch DataLoader, got {type(pipeline).__name__}")
    if not callable(step):
        raise PipelineSpecError(f"tune: step must be a callable taking a batch (or a lab.SimulatedDevice), "
                                f"got {type(step).__name__}")
    runners = [runners] if isinstance(runners, str) else list(runners)
    for r in runners:
        if r == "cache":
            raise PipelineSpecError("tune: 'cache' replays batches (the headspace); it is not a way to load. "
                                    f"Tune among {list(TUNABLE_RUNNERS)}; lab.headspace() measures the cache")
        if r not in TUNABLE_RUNNERS:
            raise PipelineSpecError(f"tune: unknown runner {r!r}; choose from {list(TUNABLE_RUNNERS)}")
    if not runners or len(set(runners)) != len(runners):
        raise PipelineSpecError(f"tune: runners must name each runner once, at least one; got {runners}")
    check_budget(budget_s, "tune")
    if window_s is not None and (isinstance(window_s, bool) or not isinstance(window_s, (int, float))
                                 or not 0 < window_s <= budget_s):
        raise PipelineSpecError(f"tune: window_s must be seconds in (0, budget_s], got {window_s!r}")
    if not any(s.kind == "map" for s in pipeline.stages):
        raise PipelineSpecError("tune: the pipeline has no map stage, so there is no concurrency to tune")
    return runners


def _start(space: Space, start: Any, runners: list[str], from_dl: bool) -> Config:
    if start is None:
        runner = "process" if from_dl and "process" in runners else runners[0]
        return space.start(runner)
    if isinstance(start, str):
        start = {"runner": start}
    if not isinstance(start, Mapping) or start.get("runner") not in runners:
        raise PipelineSpecError(f"tune: start must be one of runners {runners} or "
                                f"{{'runner': ..., 'concurrency': {{...}}}}, got {start!r}")
    runner, concurrency = start["runner"], dict(start.get("concurrency") or {})
    knobs = [k for k, _ in space.start(runner).knobs]
    if unknown := set(concurrency) - set(knobs):
        raise PipelineSpecError(f"tune: start names unknown stage(s) {sorted(unknown)}; the knobs of "
                                f"{runner} are {knobs}")
    for name, n in concurrency.items():
        validate_concurrency(n, stage=name)
    return space.start(runner, concurrency)


def _verdicts(diagnosis: Any) -> dict[str, str]:
    stages = getattr(diagnosis, "stages", None) if diagnosis is not None else {}
    if not isinstance(stages, Mapping):
        raise SpdlLabError(f"tune: diagnosis must be a lab.Diagnosis, got {type(diagnosis).__name__}")
    return {name: s.verdict for name, s in stages.items() if getattr(s, "verdict", None)}


class _Ended(Exception):
    """The tuning ends early: stopped, or the user moved a knob (it hands control back)."""


class AutoTuner:
    """Tunes a running Session's concurrency in a background thread; made by ``session.autotune()``.
    Only the running runner's knobs move (a switch would restart the session); a knob found at a
    value it did not set hands control back. ``log`` grows one sentence per move (also passed to
    ``on_log``); ``stop()`` ends it early."""

    def __init__(self, session: Any, *, budget_s: float = 60.0, window_s: float | None = None,
                 on_log: Callable[[str], None] | None = None) -> None:
        if session.loader is None or session.pipeline is None:
            raise PipelineSpecError("autotune needs a session started from a lab.Pipeline; this one runs an "
                                    "iterable whose concurrency it cannot change")
        self.budget_s = check_budget(budget_s, "autotune")
        if not session.running:
            raise SpdlLabError("autotune: the session is not running; start it (or restart()) first")
        self.session = session
        self.window_s = window_s if window_s is not None else window_for_budget(self.budget_s)
        self.on_log = on_log
        self.log: list[str] = []
        self.steps: list[Step] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._ours: dict[str, int] = dict(session.controls())
        self._items = batch_items(session.pipeline)
        self._machine = MachineClock(session.gil_probe)
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
                if time.perf_counter() + max(s.trial.elapsed_s for s in self.steps) > deadline:
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
        for name, n in self.session.controls().items():
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
        a = self._machine.read(self.session.device)
        records = self._steps(max(2, round(rate * self.window_s)), deadline)
        ours, _, *waits = self._machine.between(a, self._machine.read(self.session.device))
        # Other processes' CPU is not measured here (NaN).
        return Window(self.session.runner, 0, 0.0, tuple(records), ours, math.nan, *waits)
