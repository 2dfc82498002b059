"""One point's windows and how it ends: the rule both executors of the sweep share.

A point (a stage at one concurrency, in threads or in processes) takes one
window per round. It ends

* settled ("ok"): it has ``min_windows`` and its fastest windows agree (``_slices.quiet``);
* at ``max_windows``, or when the budget is spent (``settings.budget_cut``): still "unstable";
* failed: "timeout" or "error" (``PointFailed``, raised by its executor).

Its QPS is its second-best window (``_slices.point_qps``) whatever the executor, so
a thread point and a process point compare like with like. Every point is worth
``max_windows`` windows on the progress bar however it ends, so its total never moves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._slices import point_qps, quiet
from .settings import SweepSettings, budget_cut

__all__ = ["PointFailed", "PointWindows", "StageFeed", "WindowReading"]


@dataclass(frozen=True)
class StageFeed:
    """A stage to sweep: its function and the inputs it loops over."""

    name: str
    fn: Callable[[Any], Any]
    inputs: Sequence[Any]


class PointFailed(Exception):
    """An executor cannot go on with a point: its status ("timeout" or "error") and why."""

    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status = status


@dataclass
class WindowReading:
    """What an executor read over one window (CPU shares are of all the cores, 0..1)."""

    qps: float
    cpu: float
    done: int  # calls that returned
    failures: int  # calls that raised
    hist: list[int]  # task times (``telemetry.histogram``)
    gil: float = math.nan  # the GIL probe's wait share (threads only)
    runq: float = math.nan
    machine: float = math.nan  # the whole machine's busy share
    others: float = math.nan  # other processes' share of the cores


class PointWindows:
    """The window QPS of one point, its status, and its share of the progress bar."""

    def __init__(self, settings: SweepSettings, report: Callable[[int], None] | None = None) -> None:
        self.settings = settings
        self.qps: list[float] = []
        self.status = "unstable"
        self.done = False
        self._report = report or (lambda n: None)
        self._counted = 0

    def wants_window(self, window_s: float, deadline: float) -> bool:
        """Whether to take another window of ``window_s``; past the budget the point ends."""
        if self.done:
            return False
        if budget_cut(len(self.qps), window_s, deadline, self.settings.min_windows):
            self.end("unstable")
            return False
        return True

    def add(self, qps: float) -> None:
        """One more window's QPS; the point ends once settled or at ``max_windows``."""
        self.qps.append(qps)
        self._count(1)
        settings = self.settings
        if quiet(self.qps, settings.stable_within, settings.min_windows):
            self.end("ok")
        elif len(self.qps) >= settings.max_windows:
            self.end("unstable")

    def end(self, status: str) -> None:
        """End the point ("ok", "unstable", "timeout", "error"); the bar gets its remaining windows."""
        self.status, self.done = status, True
        self._count(self.settings.max_windows - self._counted)

    @property
    def value(self) -> float:
        """The point's QPS: its second-best window (0.0 for a timeout with none, NaN otherwise)."""
        if self.qps:
            return point_qps(self.qps)
        return 0.0 if self.status == "timeout" else math.nan

    @property
    def spread(self) -> float:
        """(max - min) / QPS over the windows; NaN with fewer than two."""
        qps = self.value
        return (max(self.qps) - min(self.qps)) / qps if len(self.qps) >= 2 and qps > 0 else math.nan

    def _count(self, n: int) -> None:
        if n > 0:
            self._counted += n
            self._report(n)
