"""The straggler verdict of a data-parallel job: ranks' latest ``RankWindow``s side by side name the
rank whose loading holds the job back. At each all-reduce every rank waits for the slowest: one that
loads slowly waits for data and lengthens the others' steps; one that computes slowly does not."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from .._table import pct
from .frames import FrameChunk

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
    window_s: float
    steps_per_s: float
    data_wait_ms: float
    step_ms: float
    wait_frac: float
    stages: tuple[StageWindow, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class JobVerdict:
    """The verdict: ``kind`` is "waiting", "straggler", "input-bound", "balanced" or "ended";
    ``straggler`` the straggling rank (only for "straggler"); ``text`` the sentence."""

    kind: str
    text: str
    straggler: int | None = None


def rank_window(chunk: FrameChunk, rank: int, state: str, window_s: float = VERDICT_WINDOW_S) -> RankWindow:
    """Rank ``rank``'s figures over the last ``window_s`` seconds of ``chunk`` (its latest ticks; the
    tick just before the window is the base its counters are taken from)."""
    times = chunk.times
    if len(times) < 2:
        return RankWindow(rank, state, 0, 0.0, math.nan, math.nan, math.nan, math.nan)
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
    return RankWindow(rank, state, steps, span, steps / span if span > 0 else math.nan,
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


def judge(windows: list[RankWindow], world_size: int | None = None) -> JobVerdict:
    """The job's verdict from its ranks' windows (by the named rules above)."""
    if any(w.state in _DIED for w in windows):
        died = [f"rank {w.rank} died ({w.state})" for w in windows if w.state in _DIED]
        others = [f"rank {w.rank} {w.state}" for w in windows if w.state not in _DIED]
        return JobVerdict("ended", "; ".join(died + others))
    known = len(windows)
    if world_size and known < world_size:
        return JobVerdict("waiting", f"waiting for ranks: {known} of {world_size} published so far")
    if known < 2:
        return JobVerdict("waiting", "waiting for a second rank: a verdict compares ranks")
    short = [w for w in windows if w.steps < MIN_STEPS or not math.isfinite(w.wait_frac)]
    if short:
        few = min(short, key=lambda w: w.steps)
        if all(w.state != "running" for w in windows):
            return JobVerdict("ended", f"the job ended ({', '.join(sorted({w.state for w in windows}))}); "
                                       f"too few steps in its last {VERDICT_WINDOW_S:g} s to compare its ranks")
        return JobVerdict("waiting", f"not enough steps yet to compare the ranks: rank {few.rank} has "
                                     f"{few.steps} of the {MIN_STEPS} needed in its last {VERDICT_WINDOW_S:g} s")
    worst = max(windows, key=lambda w: w.wait_frac)
    others = [w for w in windows if w is not worst]
    others_wait = statistics.median(w.wait_frac for w in others)
    others_step = statistics.median(w.step_ms for w in others)
    if worst.wait_frac >= WAITS_FOR_DATA and worst.wait_frac - others_wait >= STRAGGLER_GAP:
        if others_step >= worst.step_ms * (1 + HELD_BACK):
            text = _straggler_text(worst, others, others_step)
            return JobVerdict("straggler", text, straggler=worst.rank)
        return JobVerdict("balanced", f"rank {worst.rank} waits {pct(worst.wait_frac)} of its loop for data, "
                                      f"yet the other ranks do not wait for it (their step {others_step:.1f} ms "
                                      f"against its {worst.step_ms:.1f} ms): it holds no rank back")
    low, high = min(windows, key=lambda w: w.wait_frac), worst
    if low.wait_frac >= WAITS_FOR_DATA:
        return JobVerdict("input-bound", f"balanced, and every rank waits for data ({pct(low.wait_frac)}"
                                         f"-{pct(high.wait_frac)} of its loop): loading holds back the whole "
                                         f"job, not one rank")
    fast, slow = min(w.step_ms for w in windows), max(w.step_ms for w in windows)
    return JobVerdict("balanced", f"balanced: no rank waits long for data (the most: rank {worst.rank}, "
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
    stage = _slowest_stage(slow, others)
    if stage is not None:
        name, mine, theirs, where = stage
        text += f"; rank {slow.rank}'s {name} can make {mine:.0f} items/s against {theirs:.0f} {where}"
    return text


def _slowest_stage(slow: RankWindow, others: list[RankWindow]) -> tuple[str, float, float, str] | None:
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
