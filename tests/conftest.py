"""Shared fixtures: a leak checker for threads, used by every engine test."""

from __future__ import annotations

import threading
import time

import pytest


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def no_thread_leak():
    """Fail if the test leaves threads behind (after a short grace period)."""
    before = set(threading.enumerate())
    yield
    ok = _wait_until(lambda: set(threading.enumerate()) <= before, timeout=5.0)
    left = [t.name for t in set(threading.enumerate()) - before]
    assert ok, f"threads left behind: {left}"


@pytest.fixture
def wait_until():
    return _wait_until


@pytest.fixture
def no_child_leak():
    """Fail if the test leaves child processes or spdl_lab shared-memory segments."""
    import os
    from multiprocessing import resource_tracker

    import psutil

    from spdl_lab.runners._shm import shm_dir

    def ours() -> set[str]:
        return {n for n in os.listdir(shm_dir()) if n.startswith(f"spdl_lab_{os.getpid()}_")}

    # multiprocessing's resource tracker is started once, on first use, and
    # lives as long as this process: a singleton of the standard library, not a leak.
    resource_tracker.ensure_running()
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    shm_before = ours()
    yield
    ok = _wait_until(
        lambda: {p.pid for p in me.children(recursive=True)} <= children_before, timeout=10.0
    )
    left = [p.pid for p in me.children(recursive=True) if p.pid not in children_before]
    assert ok, f"child processes left behind: {left}"
    assert ours() <= shm_before, f"shared memory left behind: {sorted(ours() - shm_before)}"
