"""How a watched script ends, for the runs it publishes: an uncaught exception ends them
"failed", Ctrl-C and SIGTERM "stopped"; SIGTERM, which skips ``atexit``, closes them first; and a
signal that comes while the main thread opens or closes a run waits until that is done."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .. import _forksafe

#: How long a SIGTERM that comes while an earlier one's flush runs waits for it before it ends the
#: process as it stands (a job's group kill and torchrun's own SIGTERM come 10 ms apart).
SIGTERM_FLUSH_S = 10.0


class Run(Protocol):
    def end_as(self, how: str) -> None: ...
    def close(self) -> None: ...
    def flush(self) -> None: ...


_runs: Callable[[], list[Run]] = list
_lock = _forksafe.Lock()
_watched = False
_sigterm_taken = False
#: While the main thread opens or closes a run (``signals_held``): how deep, and the signals waiting.
_hold: list[Any] = [0, set()]


def watch(runs: Callable[[], list[Run]]) -> None:
    """Once per process, watch how the script ends for the ``runs()`` of the moment."""
    global _runs, _watched, _sigterm_taken
    with _lock:
        _runs = runs
        if not _watched:
            _watched = True
            previous_hook = sys.excepthook

            def hook(kind: Any, value: Any, tb: Any) -> None:
                _end_all("stopped" if issubclass(kind, KeyboardInterrupt) else "failed")
                previous_hook(kind, value, tb)

            sys.excepthook = hook
        if not _sigterm_taken and threading.current_thread() is threading.main_thread():
            _sigterm_taken = True
            _take_sigterm()


def _end_all(how: str) -> None:
    for run in _runs():
        run.end_as(how)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """A SIGTERM or a Ctrl-C that comes while the main thread opens or closes a run waits until it
    is done: the SIGTERM's handler, or the KeyboardInterrupt, in between would leave the run half
    made or half closed, and the process end with its record open (a DataLoader built each epoch
    hands its run on at every epoch). A script's own SIGINT handler is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = _hold[0] == 0
    interrupt = signal.getsignal(signal.SIGINT) if outer else None
    if interrupt is signal.default_int_handler:
        signal.signal(signal.SIGINT, lambda signum, frame: _hold[1].add(signum))
    _hold[0] += 1
    try:
        yield
    finally:
        _hold[0] -= 1
        if interrupt is signal.default_int_handler:
            signal.signal(signal.SIGINT, interrupt)
        if outer:
            pending, _hold[1] = _hold[1], set()
            if signal.SIGTERM in pending:
                os.kill(os.getpid(), signal.SIGTERM)  # its handler runs now, with every run whole
            if signal.SIGINT in pending:
                raise KeyboardInterrupt  # where the Ctrl-C would have, a moment later


def _take_sigterm() -> None:
    """Flush on SIGTERM (which skips ``atexit``), then let the script's handler or the default act.
    Only the main thread may set it; a run published from another one flushes every 2 s."""
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_IGN, None):  # the script ignores it, or it was set outside Python
        return

    flushing_since: list[float] = []  # set while a SIGTERM's flush runs in the main thread

    def on_sigterm(signum: int, frame: Any) -> None:
        ends = previous is signal.SIG_DFL  # else the script's handler decides whether it ends
        if flushing_since:  # another SIGTERM, run inside the first one's flush at a bytecode's end
            if not ends:
                previous(signum, frame)  # the script's handler sees every signal, as without the lab
            elif time.monotonic() - flushing_since[0] >= SIGTERM_FLUSH_S:  # the flush is stuck
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # end as without the lab
                os.kill(os.getpid(), signal.SIGTERM)
            return  # else the first one's flush ends the process: now would cut records short
        if _hold[0]:  # the main thread opens or closes a run: this comes once that is whole
            _hold[1].add(signum)
            return
        flushing_since.append(time.monotonic())
        try:
            if ends:  # the process ends now: the runs end with it
                _end_all("stopped")
            for run in _runs():
                with contextlib.suppress(Exception):  # a record that cannot close must not keep it alive
                    (run.close if ends else run.flush)()
            if not ends:
                previous(signum, frame)
                return
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            flushing_since.clear()

    signal.signal(signal.SIGTERM, on_sigterm)
