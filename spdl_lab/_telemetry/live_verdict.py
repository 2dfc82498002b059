"""Verdicts from the last seconds of frames: the live one on where the time goes, and a
data-parallel job's straggler: at each all-reduce every rank waits for the slowest; one that loads
slowly waits for data and lengthens the others' steps, one that computes slowly does not."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .._table import pct
from .frames import FrameChunk, Key

#: Data wait above this share of step time: the step is starved of data.
STARVED_DATA_WAIT = 0.15
#: Data wait below this share: loading keeps up, the step sets the pace.
FED_DATA_WAIT = 0.05
#: Training-thread GIL wait above this share of step time is called out (thread: move loading out).
GIL_BOUND_TRAIN = 0.15
#: The same for its wait for a CPU (run queue): the loader crowds the cores the step needs.
CPU_WAIT_TRAIN = 0.15
#: A stage busy this share of the time is the bottleneck: more concurrency is the way out.
BUSY_SATURATED = 0.85
#: Process-tree CPU above this share of the cores: they are full, more concurrency cannot help.
CPU_FULL = 0.90
#: The verdict looks at this many seconds of the most recent frames.
WINDOW_S = 5.0


@dataclass(frozen=True)
class Verdict:
    """``kind``: live "warming-up" | "data-starved" | "gil-bound" | "cpu-contended" | "balanced" |
    "step-bound", or a job's "waiting" | "straggler" | "input-bound" | "balanced" | "ended";
    ``text`` the sentence; ``straggler`` the straggling rank (a job's "straggler" only)."""

    kind: str
    text: str
    straggler: int | None = None

    def __str__(self) -> str:
        return self.text


def live_verdict(means: Mapping[Key, float], *, runner: str,
                 controls: Mapping[str, int] | None = None, cpu_cores: int = 1) -> Verdict:
    """The verdict from ``means[(series, stage)]`` over the recent window. The GIL wait is the
    training thread's (a SimulatedDevice's), not the probe's, which reads high whenever the
    training thread holds the GIL: it cannot blame the loader."""
    controls = dict(controls or {})
    if not means.get(("steps_in_window", "step"), 0) > 0:
        return Verdict("warming-up", "warming up: no training step finished in the last seconds")
    wait = _get(means, "data_wait_frac", "step")
    gil = _get(means, "gil_wait_frac", "train")
    queued = _get(means, "runqueue_wait_frac", "train")
    cpu = _get(means, "cpu_percent", "total") / 100.0 / max(1, cpu_cores)
    slowest = _slowest_stage(means)
    share = f"{pct(wait)} of step time"
    keeps_up = f"while loading keeps up (data wait {pct(wait)})"
    kind, head = next((kind, head) for found, kind, head in (  # the first that holds
        (wait >= STARVED_DATA_WAIT, "data-starved", f"data-starved: {share} waiting for data"),
        (gil >= GIL_BOUND_TRAIN, "gil-bound",
         f"training thread GIL-bound ({pct(gil)} GIL wait) {keeps_up}"),
        (queued >= CPU_WAIT_TRAIN, "cpu-contended",
         f"training thread waits for a CPU ({pct(queued)} run-queue wait) {keeps_up}"),
        (wait < FED_DATA_WAIT, "step-bound", f"step-bound: data wait {share}; loading keeps up"),
        (True, "balanced", f"balanced: data wait {share}")) if found)
    parts = [head]
    if slowest is not None:
        parts.append(f"slowest stage: {slowest[0]} at {pct(slowest[1])} busy")
    if gil >= GIL_BOUND_TRAIN and kind == "data-starved":
        parts.append(f"GIL wait {pct(gil)} on the training thread")
    text = "; ".join(parts)
    advice = _advice(kind, runner, gil, cpu, slowest, controls)
    return Verdict(kind, f"{text} — {advice}" if advice else text)


def _advice(kind: str, runner: str, gil: float, cpu: float, slowest: tuple[str, float] | None,
            controls: Mapping[str, int]) -> str:
    if kind == "cpu-contended":
        return "fewer loader workers or threads: they crowd the cores the step needs"
    if kind in ("data-starved", "gil-bound") and gil >= GIL_BOUND_TRAIN:
        return ("try subprocess-threads" if runner == "thread"
                else "something else in the training process holds the GIL")
    if kind != "data-starved" or slowest is None:
        return ""
    name, busy = slowest
    if cpu >= CPU_FULL:
        return f"the CPU cores are full ({pct(cpu)}): make {name} cheaper or move work off this machine"
    if busy >= BUSY_SATURATED:
        knob = name if name in controls else next(iter(controls), None)
        if knob is not None:
            return f"raise {knob}'s concurrency (now {controls[knob]})"
    return ""


def _slowest_stage(means: Mapping[Key, float]) -> tuple[str, float] | None:
    busy = [(stage, value) for (series, stage), value in means.items()
            if series == "busy_frac" and stage != "source" and not math.isnan(value)]
    return max(busy, key=lambda item: item[1]) if busy else None


def _get(means: Mapping[Key, float], series: str, stage: str) -> float:
    value = means.get((series, stage), math.nan)
    return 0.0 if value is None or math.isnan(value) else float(value)


class Window:
    """The last ``seconds`` of a live reader's chunks: one series x ticks array of at most
    ``max_ticks`` ticks, so each call is a few numpy calls in fixed memory."""

    def __init__(self, seconds: float = WINDOW_S, max_ticks: int = 512) -> None:
        self.seconds = seconds
        self._max_ticks = max_ticks
        self._times = np.empty(0)
        self._keys: dict[Key, int] = {}
        self._data = np.empty((0, 0))

    def add(self, chunk: FrameChunk) -> None:
        if not (n := len(chunk)):
            return
        for key in chunk.columns:
            self._keys.setdefault(key, len(self._keys))
        held = len(self._times)
        data = np.full((len(self._keys), held + n), np.nan)  # a series first seen now: NaN before
        data[:len(self._data), :held] = self._data
        for key, values in chunk.columns.items():
            data[self._keys[key], held:] = values
        times = np.concatenate([self._times, chunk.times])
        start = max(len(times) - self._max_ticks,
                    int(np.searchsorted(times, times[-1] - self.seconds, side="left")))
        self._times, self._data = times[start:], data[:, start:]

    def means(self, seconds: float | None = None) -> dict[Key, float]:
        """NaN-ignoring mean of every series over the last ``seconds``, plus
        ``("steps_in_window", "step")``: steps finished in that span."""
        if not len(self._times):
            return {}
        span = self.seconds if seconds is None else seconds
        keep = self._times >= self._times[-1] - span
        block = self._data[:, keep]
        finite = np.isfinite(block)
        counts = finite.sum(axis=1)
        sums = np.where(finite, block, 0.0).sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            values = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        out = {key: float(values[i]) for key, i in self._keys.items()}
        steps_row = self._keys.get(("steps", "step"))
        steps = block[steps_row][finite[steps_row]] if steps_row is not None else np.empty(0)
        out[("steps_in_window", "step")] = float(steps[-1] - steps[0]) if len(steps) >= 2 else 0.0
        return out

    def rate(self, key: Key, seconds: float | None = None) -> float:
        """A counter's rise per second between its first and last reading in the last ``seconds``
        (a mean of per-tick rates would weigh a short tick like a long one)."""
        if (row := self._keys.get(key)) is None or not len(self._times):
            return math.nan
        span = self.seconds if seconds is None else seconds
        keep = (self._times >= self._times[-1] - span) & np.isfinite(self._data[row])
        times, values = self._times[keep], self._data[row][keep]
        if len(times) < 2 or times[-1] <= times[0]:
            return math.nan
        return max(0.0, float(values[-1] - values[0]) / float(times[-1] - times[0]))

    def latest(self, key: Key) -> float:
        """The newest non-NaN value of a series, NaN when it has none."""
        if (row := self._keys.get(key)) is None:
            return math.nan
        values = self._data[row]
        finite = np.flatnonzero(np.isfinite(values))
        return float(values[finite[-1]]) if len(finite) else math.nan


#: The latest seconds of each rank's ticks that a verdict reads.
VERDICT_WINDOW_S = 10.0
#: Steps each rank needs in the window before the ranks are compared.
MIN_STEPS = 10
#: A rank's first steps wait for its loader to start (worker processes, their first batches):
#: that is start-up, not the rank's pace, and no window holds them.
WARMUP_STEPS = 3
#: A rank waits for data when at least this share of its loop (data wait + step) is data wait.
WAITS_FOR_DATA = 0.25
#: A straggler also waits at least this much more of its loop than the median of the other ranks...
STRAGGLER_GAP = 0.15
#: ...and holds them back: their step (which holds their wait in the all-reduce) is at least this
#: much longer than its own.
HELD_BACK = 0.20
#: A straggler's stage is named when it could make under this share of what the same stage makes elsewhere.
SLOWER_STAGE = 0.9
#: States in which a rank stopped without finishing its loop.
_DIED = ("killed", "failed")
_STEP = "step"


@dataclass(frozen=True)
class StageWindow:
    """A loader stage of one rank over the window: what it made (items/s), and what it could make
    at its concurrency were its workers never idle (items/s over the share of time they were busy)."""

    name: str
    items_per_s: float
    capacity_per_s: float
    concurrency: int


@dataclass(frozen=True)
class RankWindow:
    """One rank's figures over its latest window: steps, their rate, the mean data wait and step
    (ms), the data wait's share of the loop, and its loader's stages in pipeline order."""

    rank: int
    state: str
    steps: int
    steps_per_s: float
    data_wait_ms: float
    step_ms: float
    wait_frac: float
    stages: tuple[StageWindow, ...] = field(default_factory=tuple)


def rank_window(chunk: FrameChunk, rank: int, state: str, window_s: float = VERDICT_WINDOW_S) -> RankWindow:
    """Rank ``rank``'s figures over the last ``window_s`` seconds of ``chunk`` (its latest ticks; the
    tick just before the window is the base its counters are taken from)."""
    times = chunk.times
    if len(times) < 2:
        return RankWindow(rank, state, 0, math.nan, math.nan, math.nan, math.nan)
    first = max(0, int(np.searchsorted(times, times[-1] - window_s, side="left")) - 1)
    counter = chunk.columns.get(("steps", _STEP))
    if counter is not None:  # from the tick where the warm-up steps are done
        warm = np.flatnonzero(counter >= WARMUP_STEPS)
        first = max(first, int(warm[0]) if warm.size else len(times) - 1)
    span = float(times[-1] - times[first])

    def column(series: str, stage: str) -> np.ndarray:
        values = chunk.columns.get((series, stage))
        return values[first:] if values is not None else np.full(len(times) - first, math.nan)

    done = np.maximum(np.diff(_filled(column("steps", _STEP))), 0)  # a counter only grows
    wait_ms, step_ms = column("data_wait_ms", _STEP)[1:], column("step_ms", _STEP)[1:]
    timed = (done > 0) & (wait_ms >= 0) & (step_ms >= 0)  # NaN compares False: no figure that tick
    steps = int(done.sum())
    wait = float((done[timed] * wait_ms[timed]).sum())
    step = float((done[timed] * step_ms[timed]).sum())
    counted = float(done[timed].sum())
    # The loader's stages in the order the run first reported them (no queue, no worker's part).
    dt = np.diff(times[first:])
    stages = tuple(_stage_window(column, name, dt) for series, name in chunk.columns
                   if series == "qps" and "/worker" not in name and name != _STEP)
    return RankWindow(rank, state, steps, steps / span if span > 0 else math.nan,
                      wait / counted if counted else math.nan, step / counted if counted else math.nan,
                      wait / (wait + step) if wait + step > 0 else math.nan, stages)


def _filled(values: np.ndarray) -> np.ndarray:
    """A cumulative counter with its missing ticks carried forward (0 before its first value)."""
    known = np.isfinite(values)
    last_known = np.maximum.accumulate(np.where(known, np.arange(len(values)), 0))
    return np.where(known[last_known], values[last_known], 0.0)


def _stage_window(column, name: str, dt: np.ndarray) -> StageWindow:
    qps, busy = column("qps", name)[1:], column("busy_frac", name)[1:]
    ok = np.isfinite(qps) & np.isfinite(busy)
    made = float((qps[ok] * dt[ok]).sum())
    busy_s = float((busy[ok] * dt[ok]).sum())
    seconds = float(dt[ok].sum())
    concurrency = column("concurrency", name)
    workers = int(concurrency[np.isfinite(concurrency)][-1]) if np.isfinite(concurrency).any() else 0
    return StageWindow(name, made / seconds if seconds > 0 else math.nan,
                       made / busy_s if busy_s > 0 else math.nan, workers)


def judge(windows: list[RankWindow], world_size: int | None = None) -> Verdict:
    """The job's verdict from its ranks' windows (by the named rules above)."""
    if died := [f"rank {w.rank} died ({w.state})" for w in windows if w.state in _DIED]:
        others = [f"rank {w.rank} {w.state}" for w in windows if w.state not in _DIED]
        return Verdict("ended", "; ".join(died + others))
    known = len(windows)
    if world_size and known < world_size:
        return Verdict("waiting", f"waiting for ranks: {known} of {world_size} published so far")
    if known < 2:
        return Verdict("waiting", "waiting for a second rank: a verdict compares ranks")
    if short := [w for w in windows if w.steps < MIN_STEPS or not math.isfinite(w.wait_frac)]:
        few = min(short, key=lambda w: w.steps)
        if all(w.state != "running" for w in windows):
            return Verdict("ended", f"the job ended ({', '.join(sorted({w.state for w in windows}))}); "
                                       f"too few steps in its last {VERDICT_WINDOW_S:g} s to compare its ranks")
        return Verdict("waiting", f"not enough steps yet to compare the ranks: rank {few.rank} has "
                                     f"{few.steps} of the {MIN_STEPS} needed in its last {VERDICT_WINDOW_S:g} s")
    worst = max(windows, key=lambda w: w.wait_frac)
    others = [w for w in windows if w is not worst]
    others_wait = statistics.median(w.wait_frac for w in others)
    others_step = statistics.median(w.step_ms for w in others)
    if worst.wait_frac >= WAITS_FOR_DATA and worst.wait_frac - others_wait >= STRAGGLER_GAP:
        if others_step >= worst.step_ms * (1 + HELD_BACK):
            text = _straggler_text(worst, others, others_step)
            return Verdict("straggler", text, straggler=worst.rank)
        return Verdict("balanced", f"rank {worst.rank} waits {pct(worst.wait_frac)} of its loop for data, "
                                      f"yet the other ranks do not wait for it (their step {others_step:.1f} ms "
                                      f"against its {worst.step_ms:.1f} ms): it holds no rank back")
    low, high = min(windows, key=lambda w: w.wait_frac), worst
    if low.wait_frac >= WAITS_FOR_DATA:
        return Verdict("input-bound", f"balanced, and every rank waits for data ({pct(low.wait_frac)}"
                                         f"-{pct(high.wait_frac)} of its loop): loading holds back the whole "
                                         f"job, not one rank")
    fast, slow = min(w.step_ms for w in windows), max(w.step_ms for w in windows)
    return Verdict("balanced", f"balanced: no rank waits long for data (the most: rank {worst.rank}, "
                                  f"{pct(worst.wait_frac)} of its loop); steps take {fast:.0f}-{slow:.0f} ms on "
                                  f"every rank, so the job's pace is set by its steps (compute and the "
                                  f"all-reduce), not by loading")


def _straggler_text(slow: RankWindow, others: list[RankWindow], others_step: float) -> str:
    one = len(others) == 1
    change = f"{others_step / slow.step_ms - 1:+.0%}" if slow.step_ms > 0 else "longer"
    text = (f"rank {slow.rank} waits {pct(slow.wait_frac)} of its loop for data; "
            f"{f'rank {others[0].rank} waits' if one else 'the other ranks wait'} for rank {slow.rank} in the "
            f"all-reduce ({'its' if one else 'their'} step {change}: "
            f"{others_step:.1f} ms against {slow.step_ms:.1f} ms)")
    if (stage := _slowest_rank_stage(slow, others)) is not None:
        name, mine, theirs, where = stage
        text += f"; rank {slow.rank}'s {name} can make {mine:.0f} items/s against {theirs:.0f} {where}"
    return text


def _slowest_rank_stage(slow: RankWindow,
                        others: list[RankWindow]) -> tuple[str, float, float, str] | None:
    """The straggler's stage that is furthest below the same stage on the other ranks (by what it
    could make at its concurrency): its name, its capacity, the others' and where theirs is."""
    best = None
    for stage in slow.stages:
        theirs = [s.capacity_per_s for w in others for s in w.stages
                  if s.name == stage.name and math.isfinite(s.capacity_per_s)]
        if not theirs or not math.isfinite(stage.capacity_per_s):
            continue
        peer = statistics.median(theirs)
        ratio = stage.capacity_per_s / peer if peer > 0 else math.inf
        if ratio < SLOWER_STAGE and (best is None or ratio < best[0]):
            where = f"on rank {others[0].rank}" if len(others) == 1 else "on the others (median)"
            best = (ratio, stage.name, stage.capacity_per_s, peer, where)
    return None if best is None else best[1:]
