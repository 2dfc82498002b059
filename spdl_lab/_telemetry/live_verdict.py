"""The live verdict: one line, from the last seconds of frames, on where the time goes
("data-starved: 63% of step time waiting for data; slowest stage: decode at 100% busy — ...")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .._table import pct
from .frames import FrameChunk

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

Key = tuple[str, str]


@dataclass(frozen=True)
class Verdict:
    #: "warming-up" | "data-starved" | "gil-bound" | "cpu-contended" | "balanced" | "step-bound"
    kind: str
    text: str

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

    if wait >= STARVED_DATA_WAIT:
        kind, head = "data-starved", f"data-starved: {pct(wait)} of step time waiting for data"
    elif gil >= GIL_BOUND_TRAIN:
        kind, head = "gil-bound", (f"training thread GIL-bound ({pct(gil)} GIL wait) while loading "
                                   f"keeps up (data wait {pct(wait)})")
    elif queued >= CPU_WAIT_TRAIN:
        kind, head = "cpu-contended", (f"training thread waits for a CPU ({pct(queued)} run-queue "
                                       f"wait) while loading keeps up (data wait {pct(wait)})")
    elif wait < FED_DATA_WAIT:
        kind, head = "step-bound", (f"step-bound: data wait {pct(wait)} of step time; "
                                    f"loading keeps up")
    else:
        kind, head = "balanced", f"balanced: data wait {pct(wait)} of step time"
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
    if kind not in ("data-starved", "gil-bound"):
        return ""
    if gil >= GIL_BOUND_TRAIN:
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
        n = len(chunk)
        if not n:
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
        row = self._keys.get(key)
        if row is None or not len(self._times):
            return math.nan
        span = self.seconds if seconds is None else seconds
        keep = (self._times >= self._times[-1] - span) & np.isfinite(self._data[row])
        times, values = self._times[keep], self._data[row][keep]
        if len(times) < 2 or times[-1] <= times[0]:
            return math.nan
        return max(0.0, float(values[-1] - values[0]) / float(times[-1] - times[0]))

    def latest(self, key: Key) -> float:
        """The newest non-NaN value of a series, NaN when it has none."""
        row = self._keys.get(key)
        if row is None:
            return math.nan
        values = self._data[row]
        finite = np.flatnonzero(np.isfinite(values))
        return float(values[finite[-1]]) if len(finite) else math.nan
