"""Publishing with no code change: ``SPDL_LAB_WATCH=1`` (set by ``spdl-lab watch``).

With it in the environment, every ``lab.run`` session and every ``lab.Loader``
that a script iterates (and that no session owns) is published on first use,
named ``SPDL_LAB_WATCH_NAME`` (``spdl-lab watch --name``) or after the line that
started it, with the rank of a ``torchrun`` job (``$RANK``) appended. A second
run of the same name in one script gets ``-2``, ``-3``...
"""

from __future__ import annotations

import inspect
import itertools
import os
import threading
import weakref
from pathlib import Path
from typing import Any

__all__ = ["ENV", "ENV_NAME", "caller_line", "enabled", "publish_once"]

ENV = "SPDL_LAB_WATCH"
ENV_NAME = "SPDL_LAB_WATCH_NAME"

_published: weakref.WeakSet[Any] = weakref.WeakSet()
_taken: set[str] = set()
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


def publish_once(obj: Any, depth: int = 2) -> None:
    """Publish ``obj`` unless it already is; named as the module docstring says, the line
    ``depth`` frames above this call's caller."""
    from .publish import Publisher

    with _lock:
        if obj in _published:
            return
        _published.add(obj)
        name = _unique(_base_name(depth))
    Publisher(obj, name)


def caller_line(depth: int) -> str:
    """``SCRIPT-LINE`` of the code that called the function calling this (``depth`` frames further up)."""
    frame = inspect.currentframe()
    for _ in range(depth + 2):
        frame = frame.f_back if frame is not None else None
    return f"{Path(frame.f_code.co_filename).stem}-{frame.f_lineno}" if frame is not None else "run"


def _base_name(depth: int) -> str:
    name = os.environ.get(ENV_NAME, "") or caller_line(depth)
    rank = os.environ.get("RANK", "")
    return f"{name}-rank{rank}" if rank.isdigit() else name


def _unique(name: str) -> str:
    for candidate in itertools.chain([name], (f"{name}-{i}" for i in itertools.count(2))):
        if candidate not in _taken:
            _taken.add(candidate)
            return candidate
    raise AssertionError("unreachable")
