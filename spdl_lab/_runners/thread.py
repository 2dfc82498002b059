"""``thread``: every stage runs in thread pools inside this process (SPDL's "mt")."""

from __future__ import annotations

from .._engine.engine import Engine
from .base import Runner

__all__ = ["ThreadRunner"]


class ThreadRunner(Engine, Runner):
    """The thread engine itself: it keeps the Runner contract as it is."""

    name = "thread"
