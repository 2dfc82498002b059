"""Telemetry: meters on the hot path, the sampler, frames and snapshots."""

from .frames import FRAME_COLUMNS
from .meters import StageMeter, WorkerMeter
from .sampler import Sampler
from .snapshot import QueueStats, Snapshot, StageStats

__all__ = ["FRAME_COLUMNS", "QueueStats", "Sampler", "Snapshot", "StageMeter", "StageStats", "WorkerMeter"]
