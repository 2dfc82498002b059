"""Telemetry: meters on the hot path, probes, the sampler, frames and snapshots."""

from .frames import FRAME_COLUMNS
from .meters import StageMeter, WorkerMeter
from .probes import CpuProbe, GilProbe
from .sampler import Sampler
from .snapshot import QueueStats, Snapshot, StageStats

__all__ = ["FRAME_COLUMNS", "CpuProbe", "GilProbe", "QueueStats", "Sampler", "Snapshot", "StageMeter",
           "StageStats", "WorkerMeter"]
