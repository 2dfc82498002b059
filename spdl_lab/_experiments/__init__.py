"""Experiments built on runners and telemetry: run (a background Session), compare, headspace."""

from .compare import Comparison, compare, headspace
from .session import Session, run

__all__ = ["Comparison", "Session", "compare", "headspace", "run"]
