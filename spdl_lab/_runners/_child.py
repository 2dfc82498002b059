"""The ``subprocess-threads`` child, ``python -m spdl_lab._runners._child DATA_FD CTRL_FD``: the
thread engine, outputs sent through shared-memory slots, meters published to a shared block."""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from .._engine.engine import Engine
from .._engine.queues import END, TIMEOUT
from ..errors import PipelineError, RunnerError
from ._shipping import output_stage, pickled, unsendable_output
from ._shm import SeqlockBlock, ShmFile
from ._transport import Copier, SlotWriter, encode, write_arrays
from .children import exit_without_finalizing

#: How often the child publishes its meters for the parent's sampler.
METER_HZ = 50.0


def main(data_fd: int, ctrl_fd: int) -> int:
    data = Connection(data_fd, readable=False)
    ctrl = Connection(ctrl_fd, writable=False)
    try:
        init = ctrl.recv()
        run = _ChildRun(data, ctrl, init)
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
        for entry in reversed(init["sys_path"]):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        self.data = data
        self.ctrl = ctrl
        pipeline = cloudpickle.loads(init["pipeline"])
        self.engine = Engine(pipeline, **init["engine_options"])
        self.slots = SlotWriter(init["prefix"], init["slots"])
        cores = os.cpu_count() or 1
        self.copier = Copier(cores - 1) if cores > 1 else None
        self.meters = SeqlockBlock(ShmFile(init["meters"], init["meters_size"], create=False))
        self.stop = threading.Event()
        self._send_lock = threading.Lock()

    def serve(self) -> int:
        threading.Thread(target=self._control, name="spdl_lab:child-control", daemon=True).start()
        publisher = threading.Thread(target=self._publish_meters, name="spdl_lab:child-meters", daemon=True)
        self.engine.start()
        publisher.start()
        self._send(("ready",))
        try:
            self._pump()
        finally:
            self.engine.close(timeout=2.0)
            self._publish_once()
        # Keep the slots mapped until the parent has read them and says stop.
        self.stop.wait()
        return 0

    def _pump(self) -> None:
        while not self.stop.is_set():
            try:
                record = self.engine.get(0.1)
            except PipelineError as err:
                self._send(("error", _describe_error(err)))
                return
            if record is TIMEOUT:
                continue
            if record is END:
                self._send(("end",))
                return
            seq, index, value = record
            try:
                encoded = encode(value)
            except Exception as exc:  # a lock, a generator...: say which stage made it
                stage = output_stage(self.engine.pipeline)
                error = unsendable_output(stage, index, exc, "subprocess-threads", "the main process")
                self._send(("error", _describe_error(error)))
                return
            slot: tuple[int, str, int] = (-1, "", 0)  # no arrays: the pickle bytes alone
            if encoded.arrays:
                try:
                    slot_id, shm = self.slots.acquire(encoded.nbytes, self.stop.is_set)
                except InterruptedError:
                    return
                except RunnerError as err:  # no shared memory left for this output
                    self._send(("runner-error", str(err)))
                    return
                write_arrays(encoded, shm, self.copier)
                slot = (slot_id, shm.name, shm.size)
            self._send(("out", seq, index, encoded.meta, *slot))

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

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self.data.send(message)

    def cleanup(self) -> None:
        if self.copier is not None:
            self.copier.close()
        self.slots.close()
        self.meters.shm.close()


def _describe_error(err: BaseException) -> dict[str, Any]:
    cause = err.__cause__
    text = "".join(traceback.format_exception(cause)) if cause is not None else ""
    cause_bytes = pickled(cause) if cause is not None else None  # None: the traceback text alone
    return {"message": str(err), "stage": getattr(err, "stage", None), "index": getattr(err, "index", None),
            "cause": cause_bytes, "traceback": text}


if __name__ == "__main__":
    # Not sys.exit: an engine thread abandoned in a stage must not free torch tensors during finalization.
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2])))
