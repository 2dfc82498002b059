"""What a test must give back: threads, child processes, /dev/shm entries, file descriptors.

``Snapshot.take()`` records all four; ``left_behind(before, now)`` names what is
new, and ``wait_for_baseline(before)`` gives it ``GRACE_S`` to go away.
``Hygiene`` does that around one test. Threads that the library abandons on
purpose (a stage stuck in user code cannot be stopped) pass only if the test
declared them with ``allow_abandoned`` and the library reported them in a
``RuntimeWarning``.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from spdl_lab.runners._shm import shm_dir

__all__ = ["Hygiene", "Snapshot", "GRACE_S", "left_behind", "wait_for_baseline"]

#: How long a test's threads, children, segments and descriptors get to go away.
GRACE_S = 10.0
_POLL_S = 0.02
_PID_IN_NAME = re.compile(r"_(\d+)_")


@dataclass(frozen=True)
class Snapshot:
    """The resources this process holds at one instant."""

    threads: frozenset[threading.Thread]
    children: frozenset[int]
    shm: frozenset[str]
    fds: Counter[str] = field(compare=False)
    num_fds: int = 0

    @classmethod
    def take(cls) -> Snapshot:
        me = psutil.Process()
        return cls(
            threads=frozenset(t for t in threading.enumerate() if t.is_alive()),
            children=frozenset(_children(me)),
            shm=frozenset(os.listdir(shm_dir())),
            fds=_fd_targets(),
            num_fds=me.num_fds(),
        )


class Hygiene:
    """One test's before/after check. Made by the autouse ``hygiene`` fixture."""

    def __init__(self) -> None:
        self._before: Snapshot | None = None
        self._abandoned: list[str] = []
        self._recorder: warnings.catch_warnings | None = None
        self._log: list[warnings.WarningMessage] = []

    # -- what a test may declare -------------------------------------------------
    def allow_abandoned(self, prefix: str) -> None:
        """This test expects the library to abandon threads named ``prefix...`` and say so.

        The check then requires a ``RuntimeWarning`` naming them, and lets any of
        them still alive after the grace period pass only if it was named.
        """
        self._abandoned.append(prefix)

    def reports(self) -> list[str]:
        """Texts of the RuntimeWarnings recorded so far in this test."""
        return [str(w.message) for w in self._log if issubclass(w.category, RuntimeWarning)]

    # -- around the test ---------------------------------------------------------
    def begin(self) -> None:
        _start_process_lifetime_helpers()
        self._recorder = warnings.catch_warnings(record=True)
        self._log = self._recorder.__enter__()
        warnings.simplefilter("always")
        self._before = Snapshot.take()

    def finish(self) -> None:
        assert self._before is not None and self._recorder is not None
        try:
            problems = self._wait_for_baseline(self._before)
            problems += self._check_reports()
        finally:
            self._recorder.__exit__(None, None, None)
            self._reemit_unclaimed()
        if problems:
            raise AssertionError("test left resources behind:\n  " + "\n  ".join(problems))

    def _wait_for_baseline(self, before: Snapshot) -> list[str]:
        problems = wait_for_baseline(before, allowed_thread=self._reported_abandoned)
        if problems:
            _clean_up_after_failure(before)
        return problems

    def _check_reports(self) -> list[str]:
        problems = []
        for prefix in self._abandoned:
            if not any(prefix in text for text in self.reports()):
                problems.append(
                    f"the test expected threads {prefix!r}... to be abandoned, but no RuntimeWarning "
                    f"named them; recorded: {self.reports()}"
                )
        return problems

    def _reported_abandoned(self, name: str) -> bool:
        return any(name.startswith(p) for p in self._abandoned) and any(
            name in text for text in self.reports()
        )

    def _reemit_unclaimed(self) -> None:
        """Warnings the check did not consume go on to pytest's own summary."""
        for w in self._log:
            text = str(w.message)
            if issubclass(w.category, RuntimeWarning) and any(p in text for p in self._abandoned):
                continue
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def left_behind(
    before: Snapshot, now: Snapshot, *, allowed_thread: Callable[[str], bool] = lambda name: False
) -> list[str]:
    """What ``now`` holds that ``before`` did not, one line per kind; empty if nothing."""
    problems = []
    threads = sorted(t.name for t in now.threads - before.threads if not allowed_thread(t.name))
    if threads:
        problems.append(f"threads: {threads}")
    children = sorted(now.children - before.children)
    if children:
        problems.append(f"child processes: {[_describe_process(pid) for pid in children]}")
    shm = sorted(n for n in now.shm - before.shm if _is_ours(n, now.children | before.children))
    if shm:
        problems.append(f"/dev/shm entries: {shm}")
    fds = now.fds - before.fds
    if fds or now.num_fds > before.num_fds:
        problems.append(
            f"file descriptors: {before.num_fds} before, {now.num_fds} now; new: {sorted(fds.elements())}"
        )
    return problems


def wait_for_baseline(
    before: Snapshot, *, allowed_thread: Callable[[str], bool] = lambda name: False
) -> list[str]:
    """``left_behind`` once everything had up to ``GRACE_S`` to go away."""
    problems = left_behind(before, Snapshot.take(), allowed_thread=allowed_thread)
    if not problems:
        return problems
    # Garbage the test dropped (a Loader in a reference cycle) is collected
    # once, as a long-running program's collector would; then only time helps.
    gc.collect()
    deadline = time.monotonic() + GRACE_S
    while problems and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        problems = left_behind(before, Snapshot.take(), allowed_thread=allowed_thread)
    return problems


def _is_ours(name: str, children: frozenset[int]) -> bool:
    # Other processes (a benchmark running beside the tests) make and remove
    # entries too; count only those naming this process or one of its children.
    match = _PID_IN_NAME.search(name)
    return match is not None and int(match.group(1)) in (children | {os.getpid()})


def _clean_up_after_failure(before: Snapshot) -> None:
    """Kill leftover children and unlink our leftover segments, so one leak
    fails one test instead of every test after it."""
    for pid in _children(psutil.Process()) - before.children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    prefix = f"spdl_lab_{os.getpid()}_"
    for name in os.listdir(shm_dir()):
        if name.startswith(prefix) and name not in before.shm:
            try:
                os.unlink(os.path.join(shm_dir(), name))
            except FileNotFoundError:
                pass


def _start_process_lifetime_helpers() -> None:
    # multiprocessing's resource tracker starts with the first spawned worker
    # and lives as long as this process; start it before the first snapshot so
    # that it is part of every baseline rather than a "leak" of one test.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def _children(process: psutil.Process) -> set[int]:
    try:
        return {p.pid for p in process.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _describe_process(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"pid {pid} ({p.status()}): {' '.join(p.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {pid} (gone)"


def _fd_targets() -> Counter[str]:
    targets: Counter[str] = Counter()
    directory = "/proc/self/fd"
    for fd in os.listdir(directory):
        try:
            targets[os.readlink(os.path.join(directory, fd))] += 1
        except OSError:
            pass  # the descriptor of the listing itself, closed already
    return targets
