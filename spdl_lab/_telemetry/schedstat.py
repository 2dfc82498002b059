"""The calling thread's run-queue wait (field 2 of ``/proc/thread-self/schedstat``, Linux):
subtracted from a thread's lateness, it tells CPU oversubscription apart from GIL wait.
"""

from __future__ import annotations

import os

__all__ = ["SCHEDSTAT_PATH", "open_schedstat", "runqueue_ns", "read_runqueue_ns"]

SCHEDSTAT_PATH = "/proc/thread-self/schedstat"


def read_runqueue_ns(fd: int | None) -> int | None:
    """Run-queue nanoseconds read from an fd the thread opened (a kept fd: far cheaper than
    open+read); None if unreadable."""
    if fd is None:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None


def open_schedstat(path: str = SCHEDSTAT_PATH) -> int | None:
    """An fd on the calling thread's schedstat, or None where it is missing or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    if read_runqueue_ns(fd) is None:
        os.close(fd)
        return None
    return fd


def runqueue_ns(path: str = SCHEDSTAT_PATH) -> int | None:
    """One-off read for the calling thread (opens and closes the file)."""
    fd = open_schedstat(path)
    if fd is None:
        return None
    try:
        return read_runqueue_ns(fd)
    finally:
        os.close(fd)
