"""Publishing with no code change: ``SPDL_LAB_WATCH=1`` (set by ``spdl-lab watch``) publishes
every ``lab.run`` session, every Loader no session owns, and (through ``hook``) every torch
DataLoader and SPDL pipeline a script iterates, each under a name of its own."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from .._runs import caller_line
from .publish import Publisher, published_by

__all__ = ["ENV", "ENV_NAME", "published_epoch", "publish_once", "start_hook"]

ENV = "SPDL_LAB_WATCH"
ENV_NAME = "SPDL_LAB_WATCH_NAME"

_taken: set[str] = set()
_lock = threading.Lock()


def publish_once(obj: Any) -> Any:
    """Publish ``obj`` unless it already is, and return its Publisher."""
    with _lock:
        publisher = published_by(obj)
        if publisher is None:
            publisher = Publisher(obj, _unique(_base_name()))
    return publisher


def start_hook(event: str, subject: Any) -> None:
    """The start hook (``spdl_lab._runs.StartHook``): with ``SPDL_LAB_WATCH=1``, a session or a
    Loader that no session owns is published when it starts."""
    if event in ("loader", "session") and os.environ.get(ENV, "") == "1":
        publish_once(subject)


def published_epoch(obj: Any, make: Callable[[], Any]) -> Any:
    """``make()``, the epoch's iterator the script asks of ``obj`` (a DataLoader, an SPDL
    pipeline), timed for ``obj``'s published run (a DataLoader's workers start metered)."""
    return publish_once(obj).source.open_epoch(make)


def _base_name() -> str:
    """``SPDL_LAB_WATCH_NAME`` (``spdl-lab watch --name``) or the line that started the run, with
    the rank of a ``torchrun`` job (``$RANK``) appended."""
    name = os.environ.get(ENV_NAME, "") or caller_line()
    rank = os.environ.get("RANK", "")
    return f"{name}-rank{rank}" if rank.isdigit() else name


def _unique(name: str) -> str:
    """``name``, or ``name-2``, ``name-3``... for a second run of that name in this script."""
    candidate, n = name, 1
    while candidate in _taken:
        n += 1
        candidate = f"{name}-{n}"
    _taken.add(candidate)
    return candidate
