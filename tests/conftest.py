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
