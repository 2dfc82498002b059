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

from spdl_lab._runners._shm import shm_dir

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
    def take(cls, shared_ray: bool = False) -> Snapshot:
        """``shared_ray``: leave out the processes of the shared Ray instance (they are its own)."""
        me = psutil.Process()
        children, fds, num_fds = _children(me), _fd_targets(), me.num_fds()
        if shared_ray:
            # The instance's processes, this driver's connections to them (one per worker it
            # has talked to) and Ray's own log files are the instance's, not the run's.
            children -= {p.pid for p in _ray_instance_processes()}
            fds = Counter({t: n for t, n in fds.items() if not _ray_instance_fd(t)})
            num_fds = sum(fds.values())
        return cls(
            threads=frozenset(t for t in threading.enumerate() if t.is_alive()),
            children=frozenset(children),
            shm=frozenset(os.listdir(shm_dir())),
            fds=fds,
            num_fds=num_fds,
        )


class Hygiene:
    """One test's before/after check. Made by the autouse ``hygiene`` fixture."""

    def __init__(self, shared_ray: bool = False) -> None:
        self._shared_ray = shared_ray
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
        self._before = Snapshot.take(self._shared_ray)

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
        problems = wait_for_baseline(before, allowed_thread=self._reported_abandoned, shared_ray=self._shared_ray)
        if problems:
            _clean_up_after_failure(before, self._shared_ray)
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
    before: Snapshot, *, allowed_thread: Callable[[str], bool] = lambda name: False, shared_ray: bool = False
) -> list[str]:
    """``left_behind`` once everything had up to ``GRACE_S`` to go away.

    ``shared_ray``: the run's own Ray actors (its actor pools) must be gone too, and the meter
    board runs share while the instance lasts must be one.
    """

    def check() -> list[str]:
        problems = left_behind(before, Snapshot.take(shared_ray), allowed_thread=allowed_thread)
        if shared_ray:
            actors = [" ".join(p.cmdline())[:80] for p in _ray_instance_processes() if _is_run_actor(p)]
            if actors:
                problems.append(f"Ray actors of the run: {actors}")
            boards = [p.pid for p in _ray_instance_processes() if _is_actor(p, (_BOARD,))]
            if len(boards) > 1:
                problems.append(f"{len(boards)} meter boards (one per session): pids {boards}")
        return problems

    problems = check()
    if not problems:
        return problems
    # Garbage the test dropped (a Loader in a reference cycle) is collected
    # once, as a long-running program's collector would; then only time helps.
    gc.collect()
    deadline = time.monotonic() + GRACE_S
    while problems and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        problems = check()
    return problems


#: Process titles of the actors a ray runner makes for one run (a Ray worker takes its actor's
#: class name as its title while the actor lives; ``ray::IDLE`` once it is gone).
_RUN_ACTORS = ("_ActorStages",)
#: The meter board the runs on one Ray session share (it goes with the instance or the driver).
_BOARD = "ray::MeterBoard"


def _ray_instance_processes() -> list[psutil.Process]:
    from spdl_lab._runners._ray_cluster import ray_processes

    return ray_processes()


def _ray_instance_fd(target: str) -> bool:
    import ray

    temp = ray.is_initialized() and ray._private.worker.global_worker.node.get_temp_dir_path()
    return target.startswith("socket:") or bool(temp and target.startswith(temp))


def _is_run_actor(process: psutil.Process) -> bool:
    return _is_actor(process, _RUN_ACTORS)


def _is_actor(process: psutil.Process, titles: tuple[str, ...]) -> bool:
    try:
        return any(name in " ".join(process.cmdline()) for name in titles)
    except psutil.Error:
        return False


def _is_ours(name: str, children: frozenset[int]) -> bool:
    # Other processes (a benchmark running beside the tests) make and remove
    # entries too; count only those naming this process or one of its children.
    match = _PID_IN_NAME.search(name)
    return match is not None and int(match.group(1)) in (children | {os.getpid()})


def _clean_up_after_failure(before: Snapshot, shared_ray: bool = False) -> None:
    """Kill leftover children and unlink our leftover segments, so one leak
    fails one test instead of every test after it (the shared Ray instance is
    left alone, but for actors of the run)."""
    children = _children(psutil.Process()) - before.children
    if shared_ray:
        children -= {p.pid for p in _ray_instance_processes() if not _is_run_actor(p)}
    for pid in children:
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
