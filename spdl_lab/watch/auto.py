"""Publishing with no code change: ``SPDL_LAB_WATCH=1`` (set by ``spdl-lab watch``).

With it in the environment, every ``lab.run`` session and every ``lab.Loader``
that a script iterates (and that no session owns) is published on first use, and
so is every torch DataLoader and built SPDL pipeline the script iterates, even in a
script that never imports spdl_lab (``hook``, installed at interpreter start). Each is
named ``SPDL_LAB_WATCH_NAME`` (``spdl-lab watch --name``) or after the line that
started it, with the rank of a ``torchrun`` job (``$RANK``) appended. A second
run of the same name in one script gets ``-2``, ``-3``...
"""

from __future__ import annotations

import inspect
import itertools
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["ENV", "ENV_NAME", "caller_line", "enabled", "published_epoch", "publish_once", "start_hook"]

ENV = "SPDL_LAB_WATCH"
ENV_NAME = "SPDL_LAB_WATCH_NAME"

_taken: set[str] = set()
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


def publish_once(obj: Any) -> Any:
    """Publish ``obj`` unless it already is, and return its Publisher; named as the module
    docstring says, after the line of the user's code that started it."""
    from .publish import Publisher, published_by

    with _lock:
        publisher = published_by(obj)
        if publisher is None:
            publisher = Publisher(obj, _unique(_base_name()))
    return publisher


def start_hook(event: str, subject: Any) -> None:
    """The start hook (``spdl_lab.runs.StartHook``): with ``SPDL_LAB_WATCH=1``, a session or a
    Loader that no session owns is published when it starts."""
    if event in ("loader", "session") and enabled():
        publish_once(subject)


def published_epoch(obj: Any, items: Any) -> Any:
    """``items``, an iterator of ``obj`` (a DataLoader, an SPDL pipeline) that the script
    just made, timed for ``obj``'s published run (published now if it is not yet)."""
    return publish_once(obj).source.epoch(items)


def caller_line(*_: Any) -> str:
    """``SCRIPT-LINE`` of the innermost frame outside spdl_lab: the user's line that started it."""
    frame = inspect.currentframe()
    # spdl_lab's own frames, the watch hook (module ``spdl_lab_watch_hook``) among them
    while frame is not None and frame.f_globals.get("__name__", "").startswith("spdl_lab"):
        frame = frame.f_back
    return f"{Path(frame.f_code.co_filename).stem}-{frame.f_lineno}" if frame is not None else "run"


def _base_name() -> str:
    name = os.environ.get(ENV_NAME, "") or caller_line()
    rank = os.environ.get("RANK", "")
    return f"{name}-rank{rank}" if rank.isdigit() else name


def _unique(name: str) -> str:
    for candidate in itertools.chain([name], (f"{name}-{i}" for i in itertools.count(2))):
        if candidate not in _taken:
            _taken.add(candidate)
            return candidate
    raise AssertionError("unreachable")
