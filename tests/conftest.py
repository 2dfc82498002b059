"""Shared fixtures: a leak checker for threads, used by every engine test."""

from __future__ import annotations

import os
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
    from multiprocessing import resource_tracker

    import psutil

    from spdl_lab._runners._shm import shm_dir

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


def _uses_ray(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "ray_instance" in getattr(item, "fixturenames", ()) or params.get("runner") == "ray"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared Ray instance together, each group in its order: first under
    xdist, last otherwise.

    Under xdist (``-n 2 --dist worksteal``) the first worker is handed the head of the
    collection and others steal from the tail, so they share one worker and one instance
    (10-30 s to start) instead of starting one on each. Run in one process (the measurement
    set), the instance starts after every other test, so none is measured beside its processes.
    """
    first = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    items.sort(key=lambda item: _uses_ray(item) != first)


@pytest.fixture(scope="session")
def ray_instance():
    """One local Ray instance for every ``runner="ray"`` test in this session (per xdist worker).

    Starting one costs 10-30 s here, so the tests share it: the fixture opens it as a lab
    runner would, every Loader with ``runner="ray"`` joins it, and the teardown checks that
    closing the last user leaves no Ray process and no temporary directory behind.
    """
    ray = pytest.importorskip("ray")
    from spdl_lab._runners._ray_cluster import _LOCAL, RayConnection, ray_processes

    connection = RayConnection(None, None)
    connection.open()
    temp = _LOCAL["temp_dir"]
    assert temp and os.path.isdir(temp) and ray.is_initialized(), \
        "the lab's local instance, in a temporary directory of its own"
    yield connection
    connection.close()
    gone = _wait_until(lambda: not ray_processes() and not ray.is_initialized(), timeout=5.0)
    assert gone, [" ".join(p.cmdline())[:120] for p in ray_processes()]
    assert not os.path.exists(temp), "its temporary directory is removed"
