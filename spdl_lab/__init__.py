"""spdl_lab: a lab bench for data loading in PyTorch training.

Bring a pipeline and a training step; run them under several parallelism
models, watch what happens live, and find out where the time goes.
"""

from __future__ import annotations

from . import workloads
from .errors import PipelineError, PipelineSpecError, RunnerError, SpdlLabError
from .experiments import Comparison, Session, compare, headspace, run
from .loader import Loader
from .pipeline import Pipeline, Stage
from .runners import RUNNERS
from .telemetry.snapshot import QueueStats, Snapshot, StageStats
from .training import SimulatedDevice, StepClock

__version__ = "0.1.0"

__all__ = [
    "Comparison",
    "Loader",
    "Pipeline",
    "PipelineError",
    "PipelineSpecError",
    "QueueStats",
    "RUNNERS",
    "RunnerError",
    "Session",
    "SimulatedDevice",
    "Snapshot",
    "SpdlLabError",
    "Stage",
    "StageStats",
    "StepClock",
    "compare",
    "headspace",
    "run",
    "workloads",
]
