"""A worker process of ``lab.diagnose``'s sweep, run as ``python -I _sweep_child.py DATA_FD CTRL_FD``:
it imports only the standard library and cloudpickle, so it starts fast. The main thread calls
the stage function in a loop; a control thread obeys the parent: run, pause, read, stop."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

STOP_GRACE_S = 1.0  # after a stop (or the parent vanishing), for a call still in the function


def main(data_fd: int, ctrl_fd: int) -> int:
    data = Connection(data_fd, readable=False)
    ctrl = Connection(ctrl_fd, writable=False)
    try:
        # The parent is the process that started us; its bytes are trusted.
        init = ctrl.recv()
        sys.path[:0] = [entry for entry in init["sys_path"] if entry not in sys.path]
        import cloudpickle

        worker = _Worker(cloudpickle.loads(init["fn"]), cloudpickle.loads(init["inputs"]))
        data.send(("ready",))
    except BaseException:
        with contextlib.suppress(Exception):  # the parent may be gone
            data.send(("crash", traceback.format_exc()))
        return 1
    threading.Thread(target=worker.obey, args=(ctrl, data), name="spdl_lab:sweep-control", daemon=True).start()
    worker.loop()
    return 0


class _Worker:
    """Calls the function in a loop and counts; ``counts`` reads them without stopping the loop.
    Paused, it blocks on an Event: idle workers cost nothing while fewer are measured."""

    def __init__(self, fn: Callable[[Any], Any], inputs: Sequence[Any], start: int = 0) -> None:
        self.fn = fn
        self.inputs = inputs
        self.start = start  # the first input it takes
        self.running = threading.Event()
        self.stopping = False
        self.finished = threading.Event()
        self.lock = threading.Lock()
        self.busy = False  # inside the function (or about to enter it)
        self.done = 0  # calls that returned (cumulative)
        self.failures = 0  # calls that raised (cumulative)
        self.times_ns: list[int] = []  # durations of returned calls since the last read
        self.ends_ns: list[int] = []  # their completion times (perf_counter_ns: one clock machine-wide)
        self.first_error: str | None = None  # traceback of the first failure, sent once

    def loop(self) -> None:
        fn, inputs, n, i = self.fn, self.inputs, len(self.inputs), self.start
        try:
            while True:
                self.busy = True  # before the check, so a pause never misses a call starting
                if not self.running.is_set():
                    self.busy = False
                    self.running.wait()
                    continue
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
                else:
                    end = time.perf_counter_ns()
                    with self.lock:
                        self.done += 1
                        self.times_ns.append(end - t0)
                        self.ends_ns.append(end)
                self.busy = False
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
                try:
                    data.send(self.counts())
                except Exception:
                    break  # the parent is gone
            elif kind == "stop":
                break
        self.stop()
        # A call stuck in the function cannot be interrupted: never outlive the parent for it.
        if not self.finished.wait(STOP_GRACE_S):
            os._exit(0)

    def counts(self) -> tuple:
        """("counts", done, failures, times_ns, ends_ns, first_error, busy); lists and error since the last."""
        with self.lock:
            reply = ("counts", self.done, self.failures, self.times_ns, self.ends_ns, self.first_error, self.busy)
            self.times_ns, self.ends_ns, self.first_error = [], [], None
        return reply

    def stop(self) -> None:
        self.stopping = True
        self.running.set()


def exit_without_finalizing(code: int) -> None:
    """``_runners.children.exit_without_finalizing`` (see why there), for a stdlib-only child."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream has nothing to flush
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2])))
