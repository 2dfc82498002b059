"""Ctrl-C in the ``spdl-lab`` command's own process: until ``main()`` it exits 130 with one line;
then it waits out an import or a lock's short stretch (a KeyboardInterrupt there can leave a module
lock held: the exit hangs), and is sent again when lost. Standard library only: this runs first."""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from types import FrameType
from typing import Any

from .errors import in_chain

EXIT_INTERRUPTED = 130
#: How soon a Ctrl-C held back by an import is tried again.
RETRY_S = 0.05
#: How often, and how many times in a row, a Ctrl-C is found lost before it is sent again.
CHECK_S, LOST_CHECKS = 0.1, 10
_PENDING = threading.Event()  # a Ctrl-C was raised and the command has not caught it yet
_TAKEN = threading.Event()  # the command caught one: it ends
_LOCK_JUGGLERS = (os.path.join("logging", "__init__.py"), "_weakrefset.py", f"{os.sep}weakref.py",
                  os.path.join("spdl_lab", "_forksafe.py"))
_HOOK: dict[str, Any] = {"previous": sys.unraisablehook}


def is_the_command() -> bool:
    """Whether this process is ``spdl-lab`` (the console script, or ``python -m spdl_lab`` while its
    package loads: Python names ``sys.argv[0]`` "-m" then)."""
    if os.path.basename(sys.argv[0]) == "spdl-lab":
        return True
    argv = list(getattr(sys, "orig_argv", []))
    return sys.argv[:1] == ["-m"] and any(a == "-m" and b in ("spdl_lab", "spdl_lab.cli")
                                          for a, b in zip(argv, argv[1:]))


def _quit(signum: int, frame: FrameType | None) -> None:
    command = f"spdl-lab {next((a for a in sys.argv[1:] if not a.startswith('-')), '')}".strip()
    os.write(2, f"{command}: interrupted\n".encode())
    os._exit(EXIT_INTERRUPTED)


def quit_on_interrupt() -> None:
    """In the command's process, while it starts: Ctrl-C exits 130 with one line, now. Kept as it
    is where SIGINT is ignored (a shell's background job) or handled by someone else."""
    if (threading.current_thread() is threading.main_thread() and is_the_command()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _quit)


def _unsafe(frame: FrameType | None) -> bool:
    """Inside an import, or in a short stretch that juggles a lock (logging's module lock around a
    fork, a weak set's callback): an exception there is lost, or leaves the lock held."""
    if frame is not None and frame.f_code.co_filename.endswith(_LOCK_JUGGLERS):
        return True
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _drop_lost_interrupts(unraisable: Any) -> None:
    """A KeyboardInterrupt Python could only report ("Exception ignored in ...") is not printed:
    ``_check_delivered`` sends it again. Anything else goes to the hook there was."""
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
        _HOOK["previous"](unraisable)


def _raise_unless_importing(signum: int, frame: FrameType | None) -> None:
    if not _unsafe(frame):
        warnings.simplefilter("ignore")  # the clean-up that follows speaks only in the one line
        if not _PENDING.is_set():
            _PENDING.set()
            _check_delivered(0)
        raise KeyboardInterrupt
    later(RETRY_S, _resend)


def later(after_s: float, function: Any, *args: Any, name: str = "spdl_lab:timer"
          ) -> threading.Timer:
    """A started daemon ``threading.Timer``."""
    timer = threading.Timer(after_s, function, args)
    timer.daemon, timer.name = True, name
    timer.start()
    return timer


def _resend() -> None:
    if not _TAKEN.is_set():
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _check_delivered(missed: int) -> None:
    """Until ``interrupt_taken()``, the main thread must be handling the KeyboardInterrupt: one
    lost (reported in a ``__del__``, swallowed by a library) LOST_CHECKS times running is resent."""
    if not _PENDING.is_set() or _TAKEN.is_set():
        return
    handling = sys._current_exceptions().get(threading.main_thread().ident)
    if isinstance(handling, tuple):  # (type, value, traceback) before 3.12
        handling = handling[1]
    # A Ctrl-C on its way out: in the chain (a library may wrap it), or a generator closed as it unwinds.
    missed = 0 if in_chain(handling, (KeyboardInterrupt, GeneratorExit)) else missed + 1
    if missed >= LOST_CHECKS:
        _PENDING.clear()
        _resend()
    else:
        later(CHECK_S, _check_delivered, missed)


def interrupt_taken() -> None:
    """The command caught the Ctrl-C (it ends, or hands it on): nothing is sent again."""
    _TAKEN.set()
    _PENDING.clear()


def import_safe_interrupts() -> None:
    """From the command's ``main()`` on: Ctrl-C raises KeyboardInterrupt, but not inside an import."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) in (
            _quit, signal.default_int_handler):
        _TAKEN.clear()
        if sys.unraisablehook is not _drop_lost_interrupts:
            _HOOK["previous"], sys.unraisablehook = sys.unraisablehook, _drop_lost_interrupts
        signal.signal(signal.SIGINT, _raise_unless_importing)
