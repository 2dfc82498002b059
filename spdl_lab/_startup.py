"""Ctrl-C in the ``spdl-lab`` command's own process (nowhere else): a KeyboardInterrupt inside an
import prints importlib's traceback and can leave a module lock held (the exit hangs). Until
``main()`` runs, Ctrl-C exits 130 with one line; from then on, one that lands inside an import is
raised once the import is done. Standard library only: this runs first."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

__all__ = ["EXIT_INTERRUPTED", "import_safe_interrupts", "is_the_command", "quit_on_interrupt"]

EXIT_INTERRUPTED = 130
#: How soon a Ctrl-C held back by an import is tried again.
RETRY_S = 0.05


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


def _in_an_import(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _raise_unless_importing(signum: int, frame: FrameType | None) -> None:
    if not _in_an_import(frame):
        raise KeyboardInterrupt
    main = threading.main_thread().ident
    retry = threading.Timer(RETRY_S, signal.pthread_kill, (main, signal.SIGINT))
    retry.daemon = True
    retry.start()


def import_safe_interrupts() -> None:
    """From the command's ``main()`` on: Ctrl-C raises KeyboardInterrupt, but not inside an import."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) in (
            _quit, signal.default_int_handler):
        signal.signal(signal.SIGINT, _raise_unless_importing)
