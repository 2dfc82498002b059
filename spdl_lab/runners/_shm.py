"""Shared-memory files in /dev/shm, named under one prefix per run.

The parent picks the prefix, so it can remove every segment a run made, even
those of a child that was killed before saying what it created. Plain files
and mmap are used instead of ``multiprocessing.shared_memory``, whose resource
tracker unlinks and warns on its own schedule.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import struct
import tempfile
import time

from ..errors import RunnerError

__all__ = ["ShmFile", "SeqlockBlock", "new_prefix", "remove_all", "shm_dir"]


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_prefix() -> str:
    return f"spdl_lab_{os.getpid()}_{secrets.token_hex(4)}_"


def remove_all(prefix: str) -> list[str]:
    """Unlink every segment under ``prefix``; return their names."""
    removed = []
    directory = shm_dir()
    for name in os.listdir(directory):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


class ShmFile:
    """A named shared-memory segment, mapped read-write (creator) or read-only."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        self.name = name
        self.size = size
        self.path = os.path.join(shm_dir(), name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                _reserve(fd, size, self.path)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            if create:
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            # A view still exports the buffer; it is dropped with its owner.
            pass

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _reserve(fd: int, size: int, path: str) -> None:
    # posix_fallocate makes a full /dev/shm fail here with ENOSPC instead of
    # killing the writer with SIGBUS when it first touches a missing page.
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            free = os.statvfs(os.path.dirname(path))
            raise RunnerError(
                f"not enough shared memory for a {size / 2**20:.1f} MiB transfer buffer in "
                f"{os.path.dirname(path)} ({free.f_bavail * free.f_frsize / 2**20:.1f} MiB free); "
                f"make batches smaller, or give the machine more /dev/shm "
                f"(docker: --shm-size)"
            ) from exc
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        os.ftruncate(fd, size)


_HEADER = struct.Struct("<QQ")  # sequence number, payload length


class SeqlockBlock:
    """One writer publishes byte strings; readers copy the latest whole one.

    The writer makes the sequence odd while it writes and even when done; a
    reader retries if it saw an odd number or the number changed under it.
    """

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
