"""Timing the training side: StepClock around the loop, SimulatedDevice for a GPU. CUDA timing is
used when torch sees a GPU; nothing here needs one."""

from .clock import StepClock, cuda_available
from .device import DeviceStep, SimulatedDevice

__all__ = ["DeviceStep", "SimulatedDevice", "StepClock", "cuda_available"]
