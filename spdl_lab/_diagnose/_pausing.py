"""Quiet the kernel before ``lab.diagnose`` measures: a session training beside the diagnosis
would make every stage read "cpu-bound", so the kernel's running sessions wait meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from .._experiments.session import live_sessions
from .._telemetry.cpu_rates import cpu_seconds

__all__ = ["IDLE_CORES", "sessions_paused"]

#: CPU (in cores) of this process and its children below which the paused sessions count as idle.
IDLE_CORES = 0.1
_TICK_S = 0.2


@contextmanager
def sessions_paused(timeout_s: float = 5.0) -> Iterator[int]:
    """Pause this interpreter's running sessions, wait (at most ``timeout_s``) until
    their loaders idle, and resume them on exit. Yields how many were paused."""
    paused = [s for s in live_sessions() if s.state == "running"]
    try:
        deadline = time.monotonic() + timeout_s
        for session in paused:
            session.pause(max(0.0, deadline - time.monotonic()))
        if paused:  # wait until this process and its children idle
            me = psutil.Process()
            last = _cpu(me)
            while time.monotonic() < deadline:
                time.sleep(_TICK_S)
                now = _cpu(me)
                if now - last < IDLE_CORES * _TICK_S:
                    break
                last = now
        yield len(paused)
    finally:
        for session in paused:
            session.resume()


def _cpu(me: psutil.Process) -> float:
    return sum(cpu_seconds(p) or 0.0 for p in [me, *me.children(recursive=True)])
