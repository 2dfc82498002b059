"""``subprocess-threads``: the thread engine inside one child process (SPDL's "mtp"), run as
``python -m spdl_lab._runners.subprocess_threads DATA_FD CTRL_FD``; outputs come back through
shared-memory slots, and the parent reads the child's meters from a shared block."""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from .._engine.engine import Engine, EngineReading
from .._engine.queues import END, TIMEOUT
from .._pipeline import Pipeline
from ..errors import PipelineError, RunnerError
from . import _transport as transport
from ._shm import SeqlockBlock, ShmFile, new_prefix, remove_all
from .base import Runner
from .children import Child, ChildGone, exit_reason, exit_without_finalizing, receive, spawn

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
        self._payload = transport.ship(pipeline, "subprocess-threads", "the child process")
        self._slots = slots
        self._start_timeout = start_timeout
        self._blank = Engine(pipeline, buffer_size=buffer_size).read()
        self._concurrency = {s.name: s.concurrency for s in pipeline.stages if s.kind == "map"}
        self._prefix = new_prefix()
        self._child: Child | None = None
        self._meters: SeqlockBlock | None = None
        self._maps: dict[int, ShmFile] = {}  # the child's slots, mapped here
        self._leases = transport.Leases(slots)
        self._closed = False
        self._ended = False

    def start(self) -> None:
        meters = ShmFile(f"{self._prefix}meters", _METERS_SIZE, create=True,
                         purpose="the subprocess-threads runner's meters")
        self._meters = SeqlockBlock(meters)
        self._child = spawn(["-m", "spdl_lab._runners.subprocess_threads"])
        engine = {"buffer_size": self.buffer_size, "max_failures": self.max_failures,
                  "metered": self.metered}
        self._send({"pipeline": self._payload, "engine_options": engine, "sys_path": list(sys.path),
                    "prefix": self._prefix, "slots": self._slots, "meters": meters.name})
        if self._recv(self._start_timeout) is TIMEOUT:  # else "ready", the child's first message
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
                return seq, index, transport.decode(meta, None)
            slot = self._maps.get(slot_id)
            try:
                if slot is None or slot.name != slot_name:  # the child made a bigger one
                    if slot is not None:
                        slot.close()
                    slot = self._maps[slot_id] = ShmFile(slot_name, slot_size, create=False)
            except FileNotFoundError:
                if self._closed:  # close() from another thread removed the slot
                    return END
                raise
            lease = self._leases.lend(slot_id, slot)
            value = transport.decode(meta, slot, lease)  # views back when garbage, else copies
            if lease is None:  # so that the child always has a slot to fill
                self._send(("release", slot_id))
            return seq, index, value
        self._ended = True  # every other message ends the run
        if kind == "end":
            return END
        if kind == "error":
            raise message[1].error()
        # "runner-error": the child's machinery failed, e.g. no shared memory left
        raise RunnerError(f"subprocess-threads: {message[1]}")

    def _recv(self, timeout: float) -> Any:
        """The next message, TIMEOUT, END once closed, or RunnerError if the child died."""
        assert self._child is not None
        deadline = time.monotonic() + timeout
        # close() from another thread stops the child and its channel: the run is over.
        while not self._closed:
            for slot_id in self._leases.returned():
                self._send(("release", slot_id))
            try:
                message = receive(self._child, min(deadline, time.monotonic() + 0.1))
            except ChildGone as gone:
                if self._closed:
                    return END
                self._ended = True
                how = exit_reason(self._child.proc, 5.0)  # a crashed child is exiting: on a loaded host, slowly
                hint = (" The child's traceback follows." if gone.__cause__
                        else " If it ran out of memory, make batches or concurrency smaller.")
                raise RunnerError(f"subprocess-threads: the child process (pid {self._child.proc.pid}) "
                                  f"{how}.{hint}") from gone.__cause__
            if message is not None:
                return message
            if time.monotonic() >= deadline:
                return TIMEOUT
        return END

    def set_concurrency(self, stage: str, n: int) -> None:
        self._concurrency[stage] = n  # read() shows it at once, before the child's next meters
        self._send(("concurrency", stage, n))

    def concurrency(self, stage: str) -> int:
        return self._concurrency[stage]

    def _send(self, message: Any) -> None:
        if self._child is None or self._closed:
            return
        with contextlib.suppress(OSError):  # the child is gone; the next get() reports why
            self._child.ctrl.send(message)

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
        self._closed = True
        if self._child is not None:
            self._child.close(timeout)
        for slot in self._maps.values():  # mapped here
            slot.close()
        self._maps.clear()
        if self._meters is not None:
            self._blank = self.read()  # the final figures, kept for stats() after close
            self._meters.shm.close()
            self._meters = None
        remove_all(self._prefix)


# -- the child ---------------------------------------------------------------------------
#: How often the child publishes its meters for the parent's sampler.
METER_HZ = 50.0


def main(data_fd: int, ctrl_fd: int) -> int:
    data = Connection(data_fd, readable=False)
    ctrl = Connection(ctrl_fd, writable=False)
    try:
        run = _ChildRun(data, ctrl, ctrl.recv())
    except BaseException:
        with contextlib.suppress(Exception):  # the parent may be gone
            data.send(("crash", traceback.format_exc()))
        return 1
    try:
        return run.serve()
    finally:
        run.cleanup()


class _ChildRun:
    def __init__(self, data: Connection, ctrl: Connection, init: dict[str, Any]) -> None:
        sys.path[:0] = [entry for entry in init["sys_path"] if entry not in sys.path]
        self.data = data
        self.ctrl = ctrl
        self.engine = Engine(cloudpickle.loads(init["pipeline"]), **init["engine_options"])
        self.slots = transport.SlotWriter(init["prefix"], init["slots"])
        cores = os.cpu_count() or 1
        self.copier = transport.Copier(cores - 1) if cores > 1 else None
        self.meters = SeqlockBlock(ShmFile(init["meters"], _METERS_SIZE, create=False))
        self.stop = threading.Event()

    def serve(self) -> int:
        threading.Thread(target=self._control, name="spdl_lab:child-control", daemon=True).start()
        self.engine.start()
        threading.Thread(target=self._publish_meters, name="spdl_lab:child-meters", daemon=True).start()
        self.data.send(("ready",))
        try:
            if (last := self._pump()) is not None:  # the run's end, an error, or None on a stop
                self.data.send(last)
        finally:
            self.engine.close(timeout=2.0)
            self._publish_once()
        # Keep the slots mapped until the parent has read them and says stop.
        self.stop.wait()
        return 0

    def _pump(self) -> tuple | None:
        while not self.stop.is_set():
            try:
                record = self.engine.get(0.1)
            except PipelineError as err:
                return "error", transport.RemoteFailure.of(err)
            if record is TIMEOUT:
                continue
            if record is END:
                return ("end",)
            seq, index, value = record
            try:
                encoded = transport.encode(value)
            except Exception as exc:  # a lock, a generator...: say which stage made it
                return "error", transport.unsendable_output(self.engine.pipeline, index, exc,
                                                            "subprocess-threads", "the main process")
            slot: tuple[int, str, int] = (-1, "", 0)  # no arrays: the pickle bytes alone
            if encoded.arrays:
                try:
                    slot_id, shm = self.slots.acquire(encoded.nbytes, self.stop.is_set)
                except InterruptedError:
                    return None
                except RunnerError as err:  # no shared memory left for this output
                    return "runner-error", str(err)
                transport.write_arrays(encoded, shm, self.copier)
                slot = (slot_id, shm.name, shm.size)
            self.data.send(("out", seq, index, encoded.meta, *slot))
        return None

    def _control(self) -> None:
        while True:
            try:
                message = self.ctrl.recv()
            except (EOFError, OSError):
                break  # the parent is gone: stop
            kind = message[0]
            if kind == "release":
                self.slots.release(message[1])
            elif kind == "concurrency":
                self.engine.set_concurrency(message[1], message[2])
            elif kind == "stop":
                break
        self.stop.set()
        self.engine.close(timeout=2.0)

    def _publish_meters(self) -> None:
        while not self.stop.wait(1.0 / METER_HZ):
            self._publish_once()

    def _publish_once(self) -> None:
        with contextlib.suppress(Exception):  # meters are best effort; the run goes on
            self.meters.publish(pickle.dumps(self.engine.read(), protocol=pickle.HIGHEST_PROTOCOL))

    def cleanup(self) -> None:
        if self.copier is not None:
            self.copier.close()
        self.slots.close()
        self.meters.shm.close()


if __name__ == "__main__":
    # Not sys.exit: an engine thread abandoned in a stage must not free torch tensors during finalization.
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2])))
