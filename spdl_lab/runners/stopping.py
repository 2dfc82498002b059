"""Stopping a child process this process started: ask, then terminate, then kill."""

from __future__ import annotations

import subprocess

__all__ = ["stop_process"]


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """Let the child exit on its own, then terminate it, then kill it; returns once it is reaped."""
    steps = ((None, max(0.5, timeout * 0.6)), (proc.terminate, max(0.5, timeout * 0.2)), (proc.kill, 5.0))
    for escalate, wait_s in steps:
        if escalate is not None:
            escalate()
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            pass
