"""Child processes this package starts, in one place: spawned with two pipes, stopped with
escalation, and how each ended, said in words.

Used by the subprocess-threads runner, the diagnose child interpreter and the
diagnose sweep's workers. A child gets two pipes: ``data`` (child -> parent)
and ``ctrl`` (parent -> child); their file descriptors are its last two
arguments. Each starts in its own session, so Ctrl-C reaches only the
parent, which then stops its children. A child ships its traceback as text;
the parent chains it as ``ChildTraceback`` under the error it raises.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

__all__ = ["Child", "ChildTraceback", "exit_reason", "spawn", "stop_process"]


class ChildTraceback(Exception):
    """A child's traceback, chained under the error raised in the parent."""


@dataclass
class Child:
    """A started child: its process, the pipe it writes (``data``) and the one it reads (``ctrl``)."""

    proc: subprocess.Popen
    data: Connection
    ctrl: Connection

    def close_pipes(self) -> None:
        for conn in (self.ctrl, self.data):
            conn.close()


def spawn(args: list[str]) -> Child:
    """Start ``python ARGS... DATA_FD CTRL_FD`` (``args`` after the interpreter, e.g.
    ``["-m", "spdl_lab.runners._child"]``) with its two pipes."""
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


def exit_reason(proc: subprocess.Popen, wait_s: float = 2.0) -> str:
    """How the child ended: "exited with status 3", "was killed by signal SIGKILL", or
    "closed its pipe" (still running after ``wait_s``)."""
    try:
        code = proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return "closed its pipe"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """Let the child exit on its own, then terminate it, then kill it; returns once it is reaped."""
    steps = ((None, max(0.5, timeout * 0.6)), (proc.terminate, max(0.5, timeout * 0.2)), (proc.kill, 5.0))
    for escalate, wait_s in steps:
        if escalate is not None:
            escalate()
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            pass
