"""Diagnose in a clean child interpreter, so nothing else in the notebook can touch the numbers.

A kernel's other threads take the GIL (an earlier run read every stage of a
pipeline "gil-bound" beside a lab session), and its heap lengthens the
collector's pauses. A child started afresh (not forked: a fork copies the
kernel's locks and heap) has neither. The pipeline travels by value
(cloudpickle), progress comes back as messages to the notebook's bar, and the
Diagnosis as its validated JSON file. Ctrl-C, an error or a timeout stops the child.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..errors import RunnerError, SpdlLabError
from ..progress import progress_bar
from ..runners.children import ChildTraceback, exit_reason, spawn, stop_process

__all__ = ["diagnose_in_child"]

def diagnose_in_child(payload: bytes, options: dict[str, Any], progress: bool) -> Any:
    """Run ``diagnose_here`` in a fresh interpreter on the shipped pipeline; return its Diagnosis."""
    from .result import Diagnosis

    folder = Path(tempfile.mkdtemp(prefix="spdl_lab_diagnose_"))
    child = spawn(["-m", "spdl_lab.diagnose._isolated"])
    proc, data, ctrl = child.proc, child.data, child.ctrl
    bar = None
    try:
        ctrl.send({"pipeline": payload, "options": options, "sys_path": list(sys.path),
                   "cwd": os.getcwd(), "result": str(folder / "diagnosis.json")})
        while True:
            message = _next(data, proc)
            kind = message[0]
            if kind == "total":
                bar = progress_bar(message[1], progress, message[2])
            elif kind == "progress" and bar is not None:
                bar.set_description(message[2], refresh=False)
                bar.update(message[1])
            elif kind == "done":
                return Diagnosis.from_json(message[1])
            elif kind == "error":
                raise _child_error(*message[1:])
    finally:
        if bar is not None:
            bar.close()
        _stop(proc, ctrl)
        data.close()
        shutil.rmtree(folder, ignore_errors=True)


def _next(data: Connection, proc: subprocess.Popen) -> tuple:
    """The child's next message; RunnerError if it dies without one."""
    while True:  # no deadline of its own: the sweep's budget and point timeouts bound the child
        try:
            if data.poll(0.1):
                return data.recv()
        except (EOFError, OSError):
            break
        if proc.poll() is not None and not data.poll(0):
            break
    raise RunnerError(f"diagnose: the child interpreter measuring the stages {exit_reason(proc, 5.0)} "
                      f"before it finished; "
                      f"if it ran out of memory, pass a smaller num_items=")


def _stop(proc: subprocess.Popen, ctrl: Connection) -> None:
    try:
        ctrl.send(("stop",))
    except OSError:
        pass
    ctrl.close()
    stop_process(proc, timeout=3.0)


def _child_error(kind: str, message: str, text: str, stage: str | None, index: int | None) -> SpdlLabError:
    from ..errors import PipelineSpecError, stage_failure

    if kind == "PipelineError":  # worded by stage_failure in the child
        error: SpdlLabError = stage_failure(stage or "", index, None, message=message)
    elif kind == "PipelineSpecError":
        error = PipelineSpecError(message)
    else:
        error = SpdlLabError(f"diagnose failed in its child interpreter: {kind}: {message}")
    error.__cause__ = ChildTraceback(text)
    return error


# -- the child -----------------------------------------------------------------------------

class _RemoteBar:
    """What ``diagnose_here`` uses of a progress bar, sent to the parent's bar."""

    def __init__(self, data: Connection, total: int, unit: str) -> None:
        self._data = data
        self.total = total
        self.n = 0
        self._description = ""
        data.send(("total", total, unit))

    def set_description(self, text: str) -> None:
        self._description = text
        self._data.send(("progress", 0, text))

    def update(self, n: int = 1) -> None:
        if n:
            self.n += n
            self._data.send(("progress", n, self._description))

    def close(self) -> None:
        pass


def _serve(data: Connection, ctrl: Connection) -> int:
    init = ctrl.recv()
    for entry in reversed(init["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        os.chdir(init["cwd"])
    except OSError:
        pass
    import cloudpickle

    from .measure import diagnose_here

    try:
        pipeline = cloudpickle.loads(init["pipeline"])
        diagnosis = diagnose_here(pipeline, **init["options"],
                                  bar_factory=lambda total, unit: _RemoteBar(data, total, unit))
        data.send(("done", str(diagnosis.to_json(init["result"]))))
    except BaseException as exc:  # shipped to the parent, which raises it
        data.send(("error", type(exc).__name__, str(exc), traceback.format_exc(),
                   getattr(exc, "stage", None), getattr(exc, "index", None)))
        return 1
    return 0


def main(data_fd: int, ctrl_fd: int) -> int:
    data = Connection(data_fd, readable=False)
    ctrl = Connection(ctrl_fd, writable=False)
    return _serve(data, ctrl)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
