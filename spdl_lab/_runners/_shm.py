"""Shared-memory files in /dev/shm, named per run so the parent can remove all a run made (plain
files: ``multiprocessing.shared_memory``'s tracker unlinks on its own schedule); meter blocks."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import psutil

from .. import _forksafe
from .._telemetry.histogram import NUM_BUCKETS, bucket_of
from .._telemetry.meters import StageReading
from ..errors import RunnerError

#: Every segment's name: ``spdl_lab_<pid of the process that made it>_<random>_<what>``.
_OURS = re.compile(r"spdl_lab_(\d+)_[0-9a-f]+_")
_swept_in: int | None = None  # the pid of the process that swept (a forked child sweeps again)
_sweep_lock = _forksafe.Lock()


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_prefix() -> str:
    """A new run's prefix; the first one a process asks for first removes what dead owners left."""
    global _swept_in
    with _sweep_lock:
        if _swept_in != os.getpid():
            _swept_in = os.getpid()
            sweep_dead_owners()
    return f"spdl_lab_{os.getpid()}_{secrets.token_hex(4)}_"


def sweep_dead_owners() -> list[str]:
    """Unlink (and name) every segment whose maker's pid no longer runs: SIGKILLed, it could not."""
    return _unlink(lambda name: (m := _OURS.match(name)) is not None
                   and not psutil.pid_exists(int(m[1])))


def remove_all(prefix: str) -> None:
    _unlink(lambda name: name.startswith(prefix))


def _unlink(match: Callable[[str], bool]) -> list[str]:
    directory, removed = shm_dir(), []
    for name in os.listdir(directory):
        if match(name):
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed


def free_bytes(directory: str) -> int:
    return shutil.disk_usage(directory).free


class ShmFile:
    """A named shared-memory segment; ``purpose`` names it in the error when there is no room."""

    def __init__(self, name: str, size: int, *, create: bool, purpose: str = "a shared-memory segment") -> None:
        self.name = name
        self.size = size
        self.path = os.path.join(shm_dir(), name)
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                _reserve(fd, size, self.path, purpose)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            if create:
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still exports it: it goes with its owner
            self.map.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _reserve(fd: int, size: int, path: str, purpose: str) -> None:
    # Checked first: a request that cannot fit fails at once instead of filling /dev/shm.
    directory = os.path.dirname(path)
    if size > free_bytes(directory):
        raise RunnerError(_no_room(purpose, size, directory))
    # posix_fallocate: a full /dev/shm fails here (ENOSPC), not with SIGBUS at a missing page.
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise RunnerError(_no_room(purpose, size, directory)) from exc
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        os.ftruncate(fd, size)


def _no_room(purpose: str, size: int, directory: str) -> str:
    return (f"not enough shared memory for {purpose} ({_human(size)}) in {directory} "
            f"({_human(free_bytes(directory))} free); make batches smaller, free space in {directory}, "
            f"or give the machine more shared memory (docker run --shm-size=...)")


def _human(nbytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


_HEADER = struct.Struct("<QQ")  # sequence number, payload length


class SeqlockBlock:
    """One writer publishes byte strings; readers copy the latest whole one (the sequence is odd
    while the writer writes: a reader retries if it saw it odd, or changed under it)."""

    def __init__(self, shm: ShmFile) -> None:
        self.shm = shm
        self.capacity = shm.size - _HEADER.size
        self._seq = 0

    def publish(self, payload: bytes) -> None:
        if len(payload) > self.capacity:
            raise ValueError(f"meter payload of {len(payload)} bytes exceeds {self.capacity}")
        m = self.shm.map
        self._seq += 1
        _HEADER.pack_into(m, 0, self._seq, 0)
        m[_HEADER.size : _HEADER.size + len(payload)] = payload
        self._seq += 1
        _HEADER.pack_into(m, 0, self._seq, len(payload))

    def latest(self, attempts: int = 100) -> bytes | None:
        m = self.shm.map
        for _ in range(attempts):
            seq1, length = _HEADER.unpack_from(m, 0)
            if seq1 == 0:
                return None
            if seq1 % 2 == 0:
                payload = m[_HEADER.size : _HEADER.size + length]
                seq2, _ = _HEADER.unpack_from(m, 0)
                if seq1 == seq2:
                    return payload
            time.sleep(0)
        return None


# -- the process runner's meters: each DataLoader worker writes its own slot (a pid; per stage, int64
# counters and a task-time histogram); the parent sums them. Row 0 is the source, stage i row i + 1.
SOURCE_ROW = 0
TASKS, FAILURES, BUSY_NS, STARTED_NS, HIST = 0, 1, 2, 3, 4
ROW_LEN = HIST + NUM_BUCKETS


@dataclass(frozen=True)
class Layout:
    """Shape of a block: ``slots`` workers by ``rows`` stages (source included)."""

    slots: int
    rows: int

    @property
    def nbytes(self) -> int:
        return 8 * (self.slots + self.slots * self.rows * ROW_LEN)


class MeterBlock:
    """A mapped block of meters. The parent ``create``s and ``release``s it; workers ``attach``."""

    def __init__(self, shm: ShmFile, layout: Layout) -> None:
        self._shm = shm
        self.name = shm.name
        self.layout = layout
        # Views keep the mapping exported: no unmapping under a thread still writing (a segfault).
        self.pids: np.ndarray = np.frombuffer(shm.map, np.int64, count=layout.slots)
        self.counters: np.ndarray = np.frombuffer(
            shm.map, np.int64, count=layout.slots * layout.rows * ROW_LEN, offset=8 * layout.slots
        ).reshape(layout.slots, layout.rows, ROW_LEN)

    @classmethod
    def create(cls, layout: Layout, kind: str = "meters",
               purpose: str = "the process runner's meters") -> MeterBlock:
        return cls(ShmFile(f"{new_prefix()}{kind}", layout.nbytes, create=True, purpose=purpose), layout)

    @classmethod
    def attach(cls, name: str, layout: Layout) -> MeterBlock:
        return cls(ShmFile(name, layout.nbytes, create=False), layout)

    def resized(self, slots: int) -> MeterBlock:
        """A new block of ``slots`` slots with this one's counts; only while no worker writes this."""
        bigger = MeterBlock.create(Layout(slots, self.layout.rows))
        bigger.counters[: self.layout.slots] = self.counters
        self.release()
        return bigger

    def slot(self, index: int, *, metered: bool) -> SlotMeter:
        return SlotMeter(self.counters[index], metered)

    def clear_workers(self) -> None:
        """Forget the pids and in-flight tasks of workers that have all exited."""
        self.pids[:] = 0
        self.counters[:, :, STARTED_NS] = 0

    def read(self, names: list[str], kinds: list[str], concurrency: int,
             slot: int | None = None) -> list[StageReading]:
        """One reading per row, summed over the slots (or ``slot`` alone), running tasks in."""
        now = time.monotonic_ns()
        # one copy, so every figure is of the same instant
        snap = np.array(self.counters if slot is None else self.counters[slot : slot + 1])
        started = snap[:, :, STARTED_NS]
        running = np.where(started > 0, np.maximum(now - started, 0), 0).sum(axis=0)
        in_flight = (started > 0).sum(axis=0)
        sums = snap.sum(axis=0)
        busy = sums[:, BUSY_NS]
        return [StageReading(name, kind, int(sums[row, TASKS]), int(sums[row, FAILURES]),
                             int(in_flight[row]), int(busy[row] + running[row]), concurrency,
                             sums[row, HIST:].tolist(), busy_done_ns=int(busy[row]))
                for row, (name, kind) in enumerate(zip(names, kinds))]

    def release(self) -> None:
        """Unmap and unlink the file (the parent's side). Safe to call twice."""
        # The numpy views go first: a mapping with views cannot close.
        self.pids = self.counters = np.zeros((0, 0, 0), np.int64)
        self._shm.close()
        self._shm.unlink()


class SlotMeter:
    """One worker's rows of the block: it alone writes them, so no lock is needed. With
    ``metered=False`` only tasks and failures are counted: no clock reads."""

    __slots__ = ("_rows", "_metered")

    def __init__(self, rows: np.ndarray, metered: bool) -> None:
        self._rows = rows
        self._metered = metered

    def begin(self, row: int) -> int:
        if not self._metered:
            return 0
        t0 = time.monotonic_ns()
        self._rows[row, STARTED_NS] = t0
        return t0

    def done(self, row: int, t0: int, items: int = 1) -> None:
        """The task begun at ``t0`` is done; it made ``items`` items (each counted, at the mean time)."""
        r = self._rows[row]
        r[TASKS] += items
        if self._metered:
            d = time.monotonic_ns() - t0
            r[BUSY_NS] += d
            if items > 0:
                r[HIST + bucket_of(d // items)] += items
            r[STARTED_NS] = 0

    def failed(self, row: int) -> None:
        r = self._rows[row]
        r[FAILURES] += 1
        r[STARTED_NS] = 0

    def idle(self, row: int) -> None:
        """The task begun on ``row`` did not happen (the source was exhausted)."""
        self._rows[row, STARTED_NS] = 0

    def failures(self) -> int:
        return int(self._rows[:, FAILURES].sum())
