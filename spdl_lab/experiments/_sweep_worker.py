"""The worker processes of ``measure_processes``: both ends of their pipes.

A worker is ``python -m spdl_lab.experiments._sweep_worker DATA_FD CTRL_FD`` (a fresh
interpreter: never a fork, never multiprocessing's spawn, which would re-import the
user's script). Its main thread calls the stage function in a loop; a control thread
obeys the parent's ``WorkerPool``: run, pause, read (counts), stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import psutil

from ..errors import RunnerError
from ..runners.subprocess_threads import ChildTraceback, _stop_process

__all__ = ["Reading", "WorkerDied", "WorkerPool"]

#: After a stop (or the parent vanishing), how long a call still inside the
#: function may take before the worker exits anyway.
STOP_GRACE_S = 1.0


# -- the child's side ---------------------------------------------------------

def main(data_fd: int, ctrl_fd: int) -> int:
    data = Connection(data_fd, readable=False)
    ctrl = Connection(ctrl_fd, writable=False)
    try:
        # The parent is the process that started us; its bytes are trusted.
        init = ctrl.recv()
        for entry in reversed(init["sys_path"]):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        import cloudpickle

        worker = _Worker(cloudpickle.loads(init["fn"]), cloudpickle.loads(init["inputs"]))
        data.send(("ready",))
    except BaseException:
        _send_quietly(data, ("crash", traceback.format_exc()))
        return 1
    threading.Thread(target=worker.obey, args=(ctrl, data), name="spdl_lab:sweep-control", daemon=True).start()
    worker.loop()
    return 0


class _Worker:
    """Counts finished calls; the control thread reads the counts without stopping the loop.

    Paused, the main thread blocks on an Event (no spinning), so idle workers
    cost nothing while fewer of them are measured.
    """

    def __init__(self, fn: Callable[[Any], Any], inputs: Sequence[Any]) -> None:
        self.fn = fn
        self.inputs = inputs
        self.running = threading.Event()
        self.stopping = False
        self.finished = threading.Event()
        self.lock = threading.Lock()
        self.done = 0  # calls that returned (cumulative)
        self.failures = 0  # calls that raised (cumulative)
        self.times_ns: list[int] = []  # durations of returned calls since the last read
        self.first_error: str | None = None  # traceback of the first failure, sent once

    def loop(self) -> None:
        fn, inputs, n, i = self.fn, self.inputs, len(self.inputs), 0
        try:
            while True:
                if not self.running.is_set():
                    self.running.wait()
                if self.stopping:
                    return
                x = inputs[i % n]
                i += 1
                t0 = time.perf_counter_ns()
                try:
                    fn(x)
                except Exception:
                    with self.lock:
                        self.failures += 1
                        if self.failures == 1:
                            self.first_error = traceback.format_exc()
                    continue
                elapsed = time.perf_counter_ns() - t0
                with self.lock:
                    self.done += 1
                    self.times_ns.append(elapsed)
        finally:
            self.finished.set()

    def obey(self, ctrl: Connection, data: Connection) -> None:
        while True:
            try:
                message = ctrl.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            kind = message[0]
            if kind == "run":
                self.running.set()
            elif kind == "pause":
                self.running.clear()
            elif kind == "read":
                with self.lock:
                    reply = ("counts", self.done, self.failures, self.times_ns, self.first_error)
                    self.times_ns, self.first_error = [], None
                if not _send_quietly(data, reply):
                    break
            elif kind == "stop":
                break
        self.stopping = True
        self.running.set()
        # A call stuck in the function cannot be interrupted: never outlive the parent for it.
        if not self.finished.wait(STOP_GRACE_S):
            os._exit(0)


# -- the parent's side --------------------------------------------------------

@dataclass
class Reading:
    """Totals over the active workers at one moment (counts cumulative, times since the last read)."""

    at: float
    done: int
    failures: int
    cpu_s: float
    times_ns: list[int] = field(default_factory=list)


class WorkerDied(Exception):
    """A worker process exited or closed its pipe; the message says how."""


class WorkerPool:
    """Worker processes, each with a control pipe (parent -> child) and a data pipe (child -> parent)."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.procs: list[subprocess.Popen] = []
        self.ctrls: list[Connection] = []
        self.datas: list[Connection] = []
        self.ps: list[psutil.Process] = []
        self.first_error: str | None = None

    def start(self, n: int, init: dict[str, Any], timeout_s: float) -> None:
        for _ in range(n):  # all start before any is waited on: imports overlap
            data_r, data_w = os.pipe()
            ctrl_r, ctrl_w = os.pipe()
            try:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "spdl_lab.experiments._sweep_worker", str(data_w), str(ctrl_r)],
                    pass_fds=(data_w, ctrl_r), start_new_session=True))  # Ctrl-C reaches only the parent
            except BaseException:
                for fd in (data_r, ctrl_w):
                    os.close(fd)
                raise
            finally:
                os.close(data_w)
                os.close(ctrl_r)
            self.datas.append(Connection(data_r, writable=False))
            self.ctrls.append(Connection(ctrl_w, readable=False))
            self.ps.append(psutil.Process(self.procs[-1].pid))
        self.send(n, init)
        deadline = time.monotonic() + timeout_s
        try:
            for i in range(n):
                if self._recv(i, deadline) is None:
                    raise RunnerError(f"lab.diagnose: stage {self.stage!r}: a worker process did not start "
                                      f"within {timeout_s:g} s; pass start_timeout_s= to wait longer")
        except WorkerDied as died:
            raise RunnerError(f"lab.diagnose: stage {self.stage!r}: a worker process could not start: "
                              f"{died}") from died.__cause__

    def send(self, c: int, message: Any) -> None:
        for ctrl in self.ctrls[:c]:
            try:
                ctrl.send(message)
            except OSError:
                pass  # that worker is gone; the next read says how

    def read(self, c: int, timeout_s: float) -> Reading | None:
        """Counts from the first c workers, or None if one has not answered within timeout_s."""
        at = time.perf_counter()
        self.send(c, ("read",))
        deadline = time.monotonic() + timeout_s
        reading = Reading(at, 0, 0, 0.0)
        for i in range(c):
            reply = self._recv(i, deadline)
            if reply is None:
                return None
            _, done, failures, times_ns, first_error = reply
            reading.done += done
            reading.failures += failures
            reading.times_ns += times_ns
            self.first_error = self.first_error or first_error
        try:
            reading.cpu_s = sum(t.user + t.system for t in (p.cpu_times() for p in self.ps[:c]))
        except psutil.Error:
            raise WorkerDied("a worker process vanished") from None
        return reading

    def _recv(self, i: int, deadline: float) -> Any:
        data, proc = self.datas[i], self.procs[i]
        while True:
            try:
                if data.poll(max(0.0, min(0.1, deadline - time.monotonic()))):
                    # Unpickled only because it comes from a child we started ourselves.
                    message = data.recv()
                    if message[0] == "crash":
                        raise WorkerDied(_exit_reason(proc)) from ChildTraceback(message[1])
                    return message
            except (EOFError, OSError):
                raise WorkerDied(_exit_reason(proc)) from None
            if proc.poll() is not None:
                raise WorkerDied(_exit_reason(proc))
            if time.monotonic() >= deadline:
                return None

    def close(self, kill: bool) -> None:
        if not kill:
            self.send(len(self.procs), ("stop",))
        for proc in self.procs:
            if kill:
                proc.kill()
            _stop_process(proc, timeout=2.0)  # after a kill it only reaps
        for conn in self.ctrls + self.datas:
            conn.close()


def _exit_reason(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        return f"worker process (pid {proc.pid}) closed its pipe"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"worker process (pid {proc.pid}) was killed by signal {name}"
    return f"worker process (pid {proc.pid}) exited with status {code}"


def _send_quietly(conn: Connection, message: tuple) -> bool:
    try:
        conn.send(message)
        return True
    except Exception:
        return False


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
