"""Stage functions with known behaviour on a 2-core machine, for the diagnose battery.

A module (not the test file) so that worker processes and the env-var script
can import them by name.
"""

from __future__ import annotations

import hashlib
import threading
import time
import zlib

import numpy as np

import spdl_lab as lab

_DATA = np.random.default_rng(0).integers(0, 255, 2_000_000, dtype=np.uint8).tobytes()
_LOCK = threading.Lock()


def pure_python(x):
    """Holds the GIL: a Python loop (~1.5 ms)."""
    total = 0
    for i in range(30_000):
        total += i * i
    return x


def sleeps(x):
    """Releases the GIL and the core: I/O-like waiting."""
    time.sleep(0.004)
    return x


def compresses(x):
    """Releases the GIL and keeps a core busy: zlib on 1 MB."""
    zlib.compress(_DATA[:1_000_000], 6)
    return x


def hashes(x):
    """Releases the GIL and keeps a core busy: sha256 of 2 MB."""
    hashlib.sha256(_DATA).digest()
    return x


def locked(x):
    """Serialized by a lock around work that releases the GIL."""
    with _LOCK:
        time.sleep(0.002)
    return x


def legacy_rng(x):
    """numpy's legacy global RandomState serializes callers on its lock."""
    np.random.standard_normal(300_000)
    return x


def sleepy_pipeline() -> lab.Pipeline:
    """For the env-var and CLI tests: one stage that scales, quickly measured."""
    return lab.Pipeline(range(10**6)).map(sleeps, concurrency=2, name="fetch").batch(4)
