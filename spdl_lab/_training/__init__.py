"""Timing the training side: StepClock around the loop, SimulatedDevice for a GPU.

CUDA timing is used when torch sees a GPU; nothing here needs one.
"""

from __future__ import annotations

from .clock import DEFAULT_HISTORY, StepClock, StepRecord, StepSummary
from .device import DeviceStep, DeviceTotals, SimulatedDevice

__all__ = ["DEFAULT_HISTORY", "DeviceStep", "DeviceTotals", "SimulatedDevice", "StepClock", "StepRecord",
           "StepSummary"]
