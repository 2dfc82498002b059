"""How a script's end reaches its published runs' records: an uncaught exception marks them
"failed", Ctrl-C (KeyboardInterrupt) and SIGTERM "stopped", and SIGTERM, which would end the
process without running ``atexit``, first puts every run's last steps and frames in its record."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["watch_endings"]

_lock = threading.Lock()
_installed = False
_sigterm_taken = False
_publishers: Callable[[], list[Any]] = list


def watch_endings(publishers: Callable[[], list[Any]]) -> None:
    """Once per process: watch how the script ends for the runs ``publishers()`` returns (each
    has ``ended_by``, ``source.state()``, ``flush()`` and ``close()``)."""
    global _installed, _sigterm_taken, _publishers
    with _lock:
        _publishers = publishers
        if not _installed:
            _installed = True
            previous_hook = sys.excepthook

            def hook(kind: Any, value: Any, tb: Any) -> None:
                _mark("stopped" if issubclass(kind, KeyboardInterrupt) else "failed")
                previous_hook(kind, value, tb)

            sys.excepthook = hook
        if not _sigterm_taken and threading.current_thread() is threading.main_thread():
            _sigterm_taken = True
            _take_sigterm()


def _mark(how: str) -> None:
    for publisher in _publishers():
        if publisher.ended_by is None and publisher.source.state() == "running":  # an ended run is not
            publisher.ended_by = how


def _take_sigterm() -> None:
    """Flush on SIGTERM, then let the script's own handler (or the default: exit) act. Only the
    main thread may set a handler; a run published from another one flushes every 2 s."""
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_IGN, None):  # the script ignores it, or it was set outside Python
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        if previous is signal.SIG_DFL:  # the process ends now: the runs end with it
            _mark("stopped")
            for publisher in _publishers():
                with contextlib.suppress(Exception):  # a record that cannot close must not keep it alive
                    publisher.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        for publisher in _publishers():  # the script's handler decides whether it ends
            with contextlib.suppress(Exception):
                publisher.flush()
        previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
