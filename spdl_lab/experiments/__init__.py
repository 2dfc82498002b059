"""Experiments built on runners and telemetry: run, compare, headspace, diagnose."""

from ._thread_sweep import SweepSettings
from .compare import Comparison, compare
from .diagnose import diagnose
from .diagnosis import Diagnosis
from .headspace import headspace
from .session import Session, run

__all__ = ["Comparison", "Diagnosis", "Session", "SweepSettings", "compare", "diagnose", "headspace", "run"]
