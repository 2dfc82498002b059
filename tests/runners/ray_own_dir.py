"""A Ray temporary directory of a test's own (RAY_TMPDIR), and, after, the end of only the
processes that name it: a test never stops a Ray instance it did not start."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator

import psutil


@contextlib.contextmanager
def own_ray_dir(prefix: str) -> Iterator[str]:
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # short: Ray's socket paths live under it
    try:
        yield tmp
    finally:
        ours = [p for p in psutil.process_iter() if mentions(p, tmp)]
        for p in ours:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(ours, timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def mentions(proc: psutil.Process, text: str) -> bool:
    """Whether ``proc`` has ``text`` on its command line or as its RAY_TMPDIR."""
    try:
        return any(text in part for part in proc.cmdline()) or text in proc.environ().get("RAY_TMPDIR", "")
    except psutil.Error:
        return False
