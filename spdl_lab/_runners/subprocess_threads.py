"""``subprocess-threads``: the thread engine inside one child process (SPDL's "mtp"); outputs come
back through shared memory, and the parent reads the child's meters from a shared block."""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from .._engine.engine import Engine, EngineReading
from .._engine.queues import END, TIMEOUT
from .._pipeline import Pipeline
from ..errors import PipelineError, RunnerError, stage_failure
from ._shipping import ship
from ._shm import SeqlockBlock, ShmFile, new_prefix, remove_all
from ._transport import Leases, decode
from .base import Runner
from .children import ChildTraceback, exit_reason, spawn, stop_process

__all__ = ["SubprocessThreadsRunner"]

#: Shared-memory slots in flight (each grows to the largest output); more let the child run ahead.
SLOTS = 4
_METERS_SIZE = 4 << 20
#: How long start() waits for the child to import and build its engine.
START_TIMEOUT_S = 60.0


class SubprocessThreadsRunner(Runner):
    name = "subprocess-threads"

    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool,
                 slots: int = SLOTS, start_timeout: float = START_TIMEOUT_S) -> None:
        super().__init__(pipeline, buffer_size=buffer_size, max_failures=max_failures, metered=metered)
        self._payload = ship(pipeline, "subprocess-threads", "the child process")
        self._slots = slots
        self._start_timeout = start_timeout
        self._blank = Engine(pipeline, buffer_size=buffer_size).read()
        self._concurrency = {s.name: s.concurrency for s in pipeline.stages if s.kind == "map"}
        self._prefix = new_prefix()
        self._proc: subprocess.Popen | None = None
        self._data: Connection | None = None
        self._ctrl: Connection | None = None
        self._meters: SeqlockBlock | None = None
        self._maps: dict[int, ShmFile] = {}  # the child's slots, mapped here
        self._leases = Leases(slots)
        self._closed = False
        self._ended = False

    def start(self) -> None:
        meters = ShmFile(f"{self._prefix}meters", _METERS_SIZE, create=True,
                         purpose="the subprocess-threads runner's meters")
        self._meters = SeqlockBlock(meters)
        child = spawn(["-m", "spdl_lab._runners._child"])
        self._proc, self._data, self._ctrl = child.proc, child.data, child.ctrl
        self._send({
            "pipeline": self._payload,
            "engine_options": {"buffer_size": self.buffer_size, "max_failures": self.max_failures,
                               "metered": self.metered},
            "sys_path": list(sys.path),
            "prefix": self._prefix,
            "slots": self._slots,
            "meters": meters.name,
            "meters_size": meters.size,
        })
        message = self._recv(self._start_timeout, starting=True)
        if message is TIMEOUT:
            raise RunnerError(f"subprocess-threads: the child process did not start within "
                              f"{self._start_timeout:g} s; pass start_timeout= to wait longer")

    def get(self, timeout: float) -> Any:
        if self._ended or self._closed:
            return END
        message = self._recv(timeout)
        if message is TIMEOUT or message is END:
            return message
        kind = message[0]
        if kind == "out":
            _, seq, index, meta, slot_id, slot_name, slot_size = message
            if slot_id < 0:
                return seq, index, decode(meta, None)
            try:
                slot = self._slot(slot_id, slot_name, slot_size)
            except FileNotFoundError:
                if self._closed:  # close() from another thread removed the slot
                    return END
                raise
            if self._leases.can_lend():
                value = decode(meta, slot, self._leases.lend(slot_id, slot))  # views; back when garbage
            else:
                value = decode(meta, slot)  # copies, so the child always has a slot to fill
                self._send(("release", slot_id))
            return seq, index, value
        self._ended = True  # every other message ends the run
        if kind == "end":
            return END
        if kind == "error":
            raise _pipeline_error(message[1])
        if kind == "runner-error":  # the child's machinery failed, e.g. no shared memory left
            raise RunnerError(f"subprocess-threads: {message[1]}")
        raise RunnerError(f"subprocess-threads: unexpected message from the child: {kind!r}")

    def _slot(self, slot_id: int, name: str, size: int) -> ShmFile:
        shm = self._maps.get(slot_id)
        if shm is None or shm.name != name:  # the child replaced it with a bigger one
            if shm is not None:
                shm.close()
            shm = self._maps[slot_id] = ShmFile(name, size, create=False)
        return shm

    def _recv(self, timeout: float, starting: bool = False) -> Any:
        """The next message, TIMEOUT, END once closed, or RunnerError if the child died."""
        assert self._data is not None and self._proc is not None
        deadline = time.monotonic() + timeout
        while True:
            # close() from another thread stops the child and its channel: the run is over.
            if self._closed:
                return END
            try:
                for slot_id in self._leases.returned():
                    self._send(("release", slot_id))
                if self._data.poll(max(0.0, min(0.1, deadline - time.monotonic()))):
                    message = self._data.recv()
                    if message[0] == "crash":
                        raise self._died(message[1])
                    if message[0] == "ready" and not starting:
                        continue
                    return message
                exited = self._proc.poll() is not None and not self._data.poll(0)
            except (EOFError, OSError):
                if self._closed:
                    return END
                raise self._died(None) from None
            if exited and not self._closed:
                raise self._died(None)
            if time.monotonic() >= deadline:
                return TIMEOUT

    def _died(self, child_traceback: str | None) -> RunnerError:
        assert self._proc is not None
        how = exit_reason(self._proc, 5.0)  # a crashed child is exiting: on a loaded host, slowly
        self._ended = True
        hint = (" The child's traceback follows." if child_traceback
                else " If it ran out of memory, make batches or concurrency smaller.")
        error = RunnerError(f"subprocess-threads: the child process (pid {self._proc.pid}) {how}.{hint}")
        if child_traceback:
            error.__cause__ = ChildTraceback(child_traceback)
        return error

    def set_concurrency(self, stage: str, n: int) -> None:
        self._concurrency[stage] = n  # read() shows it at once, before the child's next meters
        self._send(("concurrency", stage, n))

    def concurrency(self, stage: str) -> int:
        return self._concurrency[stage]

    def _send(self, message: Any) -> None:
        if self._ctrl is None or self._closed:
            return
        with contextlib.suppress(OSError):  # the child is gone; the next get() reports why
            self._ctrl.send(message)

    def read(self) -> EngineReading:
        reading = self._blank
        payload = self._meters.latest() if self._meters is not None else None
        if payload is not None:
            reading = pickle.loads(payload)  # our own child wrote these bytes into a segment only we share
        for stage in reading.stages:
            stage.concurrency = self._concurrency.get(stage.name, stage.concurrency)
        return reading

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._send(("stop",))
        self._closed = True
        proc = self._proc
        if proc is not None:
            stop_process(proc, timeout)
        for conn in (self._data, self._ctrl):
            if conn is not None:
                conn.close()
        for shm in self._maps.values():
            shm.close()
        self._maps.clear()
        if self._meters is not None:
            self._blank = self.read()  # the final figures, kept for stats() after close
            self._meters.shm.close()
            self._meters = None
        remove_all(self._prefix)


def _pipeline_error(info: dict[str, Any]) -> PipelineError:
    """The child's stage failure (worded there by ``stage_failure``), its cause rebuilt here."""
    try:
        cause = None if info["cause"] is None else pickle.loads(info["cause"])  # from our child
    except Exception:
        cause = None
    remote = ChildTraceback(info["traceback"]) if info["traceback"] else None
    if cause is None:
        cause = remote
    elif remote is not None:
        cause.__cause__ = remote
    return stage_failure(info["stage"], info["index"], cause, message=info["message"])

