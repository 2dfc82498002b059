"""Shared-memory files in /dev/shm, named under one prefix per run, so the parent can remove every
segment a run made. Plain files and mmap: ``multiprocessing.shared_memory``'s resource tracker
unlinks and warns on its own schedule.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import struct
import tempfile
import time

from .. import _forksafe
from ..errors import RunnerError

__all__ = ["ShmFile", "SeqlockBlock", "free_bytes", "new_prefix", "remove_all", "shm_dir", "sweep_dead_owners"]

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
    """Unlink every segment whose maker is gone (SIGKILLed, it could not unlink its own): its pid
    no longer runs. Returns the names removed. A pid in use again keeps its old segment until then."""
    directory, removed = shm_dir(), []
    for name in os.listdir(directory):
        match = _OURS.match(name)
        if match and not _pid_runs(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def free_bytes(directory: str) -> int:
    """Bytes this process may still allocate in ``directory``."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def remove_all(prefix: str) -> None:
    """Unlink every segment under ``prefix``."""
    directory = shm_dir()
    for name in os.listdir(directory):
        if name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


class ShmFile:
    """A named shared-memory segment; ``purpose`` names it in the error when there is no room."""

    def __init__(self, name: str, size: int, *, create: bool, purpose: str = "a shared-memory segment") -> None:
        self.name = name
        self.size = size
        self.path = os.path.join(shm_dir(), name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
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
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


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
