"""Every child the runners and diagnose start: a fresh interpreter (never a fork of this threaded
process) that does not run the user's script again, stopped with escalation; its end in words."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Any, NoReturn

import psutil


class ChildTraceback(Exception):
    """A child's traceback, chained under the error raised in the parent."""


@dataclass
class Child:
    """A started child: its process, the pipe it writes (``data``) and the one it reads (``ctrl``)."""

    proc: subprocess.Popen
    data: Connection
    ctrl: Connection

    def close(self, timeout: float) -> None:
        """Ask it to stop; let it exit on its own, then terminate it, then kill it; once it is reaped,
        close both pipes."""
        with contextlib.suppress(OSError):  # it is gone already
            self.ctrl.send(("stop",))
        proc = self.proc
        steps = ((None, max(0.5, timeout * 0.6)), (proc.terminate, max(0.5, timeout * 0.2)), (proc.kill, 5.0))
        for escalate, wait_s in steps:
            if escalate is not None:
                escalate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)
                break
        self.ctrl.close()
        self.data.close()


def spawn(args: list[str]) -> Child:
    """``python ARGS... DATA_FD CTRL_FD`` in its own session: Ctrl-C reaches only the parent."""
    data_r, data_w = os.pipe()
    ctrl_r, ctrl_w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, *args, str(data_w), str(ctrl_r)],
                                pass_fds=(data_w, ctrl_r), start_new_session=True)
    except BaseException:
        for fd in (data_r, ctrl_w):
            os.close(fd)
        raise
    finally:
        os.close(data_w)
        os.close(ctrl_r)
    return Child(proc, Connection(data_r, writable=False), Connection(ctrl_w, readable=False))


class ChildGone(Exception):
    """A spawned child exited or closed its pipe; ``__cause__`` is its traceback if it sent one."""


def receive(child: Child, deadline: float) -> Any:
    """The child's next message, or None at ``deadline`` (``time.monotonic()``). ChildGone once it
    sent ``("crash", traceback)``, or exited or closed its pipe with nothing left to read."""
    while True:
        try:
            if child.data.poll(max(0.0, min(0.1, deadline - time.monotonic()))):
                message = child.data.recv()  # unpickled only because it comes from a child we started
                if message[0] == "crash":
                    raise ChildGone from ChildTraceback(message[1])
                return message
            exited = child.proc.poll() is not None and not child.data.poll(0)
        except (EOFError, OSError):
            raise ChildGone from None
        if exited:
            raise ChildGone
        if time.monotonic() >= deadline:
            return None


def exit_without_finalizing(code: int) -> NoReturn:
    """End a child of ours with ``code`` by ``os._exit``, its standard streams flushed first.
    Finalizing would let a daemon thread free a torch tensor, releasing the GIL: a thread asking for
    it back then is ended by ``pthread_exit``, unwinding torch's C++ frames: ``std::terminate``."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream has nothing to flush
            stream.flush()
    os._exit(code)


def ended(killed: bool, code: int) -> str:
    """"was killed by signal SIGKILL" or "exited with status 3"."""
    if not killed:
        return f"exited with status {code}"
    with contextlib.suppress(ValueError):  # a signal without a name
        return f"was killed by signal {signal.Signals(code).name}"
    return f"was killed by signal {code}"


def exit_reason(proc: subprocess.Popen, wait_s: float = 2.0) -> str:
    """How a spawned child ended (``ended``), or "closed its pipe" if still running after ``wait_s``."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        code = proc.wait(timeout=wait_s)
        return ended(code < 0, abs(code))
    return "closed its pipe"


# -- DataLoader workers: started and reaped by torch's Process objects --------------------
def exit_status(pid: int) -> tuple[bool, int] | None:
    """(killed by a signal, signal or status) once child ``pid`` exited, else None; unreaped."""
    info = _peek(pid)
    return (info.si_code != os.CLD_EXITED, info.si_status) if info else None


def _peek(pid: int) -> Any:
    """Child ``pid``'s waitid record once it exited (unreaped); None while it runs; else False."""
    with contextlib.suppress(ChildProcessError):
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return False


def kill(pids: list[int], wait_s: float = 1.0) -> None:
    """SIGKILL those of ``pids`` that are our running children and wait for them to exit, unreaped:
    their Process objects reap them (a later terminate() could else hit a reused pid)."""
    me, killed = os.getpid(), []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            child = psutil.Process(pid)
            if child.ppid() == me and _peek(pid) is None:
                child.kill()
                killed.append(pid)
    deadline = time.monotonic() + wait_s
    while any(_peek(pid) is None for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.01)


# ``spawn`` re-runs the parent's ``__main__`` in a worker; ours need nothing from it (the pipeline
# travels by value), so a launch sees one named "__main__": nothing to import (see spawn.py).
_swapping = threading.Lock()


class _MainByName(types.ModuleType):
    """``__main__`` as multiprocessing should see it while launching: named, not a path."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("__main__")
        self.__dict__["_real_main"] = real
        self.__spec__ = ModuleSpec("__main__", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_real_main"], name)


class MainFreeProcess(SpawnProcess):
    def start(self) -> None:
        with _swapping:
            real = sys.modules.get("__main__")
            # Run with -m (a spec with a name), spawn imports ``__main__`` by name itself.
            if real is not None and getattr(getattr(real, "__spec__", None), "name", None) is None:
                sys.modules["__main__"] = _MainByName(real)
            try:
                super().start()
            finally:
                if real is not None:
                    sys.modules["__main__"] = real


class MainFreeSpawnContext(SpawnContext):
    """``multiprocessing.get_context("spawn")``, but workers do not re-run ``__main__``."""

    Process = MainFreeProcess
