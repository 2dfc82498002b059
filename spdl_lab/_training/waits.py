"""Where the training thread waited while it launched work: for the GIL, or for a core.

From a ``SimulatedDevice``'s launch loop: wall less CPU less run-queue time is the wait for the GIL.
"""

from __future__ import annotations

import math
from typing import Any

from .._telemetry.frames import Row
from .device import SimulatedDevice

__all__ = ["TrainingThreadWaits", "training_waits"]


def training_waits(before: Any, now: Any) -> tuple[float, float]:
    """GIL and run-queue wait of the training thread while launching, per wall second of its steps."""
    if before is None or now is None:
        return math.nan, math.nan
    wall = now.wall_s - before.wall_s
    if wall <= 0:
        return math.nan, math.nan
    stall = (now.launch_wall_s - before.launch_wall_s) - (now.launch_cpu_s - before.launch_cpu_s)
    queued = now.launch_runqueue_s - before.launch_runqueue_s
    return min(1.0, max(0.0, stall - queued) / wall), min(1.0, max(0.0, queued / wall))


class TrainingThreadWaits:
    """Sampler source: ``training_waits`` over each tick, as stage ``"train"`` rows (beside the probe's ``"gil"``)."""

    def __init__(self, device: SimulatedDevice) -> None:
        self._device = device
        self._before = device.totals()

    def __call__(self, dt_s: float) -> list[Row]:
        now = self._device.totals()
        before, self._before = self._before, now
        gil, queued = training_waits(before, now)
        if math.isnan(gil):
            return []
        return [("gil_wait_frac", "train", gil), ("runqueue_wait_frac", "train", queued)]
