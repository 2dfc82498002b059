"""Diagnose in a clean child interpreter (``_isolated_child``): the kernel's other threads take the GIL
and its heap lengthens the collector's pauses. The pipeline goes by value (cloudpickle); progress and
the Diagnosis's JSON file come back. Ctrl-C, an error or a timeout stops the child."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .._progress import progress_bar
from .._runners.children import ChildTraceback, exit_reason, spawn, stop_process
from ..errors import PipelineSpecError, RunnerError, SpdlLabError, stage_failure
from .result import Diagnosis

__all__ = ["diagnose_in_child"]


def diagnose_in_child(payload: bytes, options: dict[str, Any], progress: bool) -> Diagnosis:
    """Run ``diagnose_here`` in a fresh interpreter on the shipped pipeline; return its Diagnosis."""
    folder = tempfile.TemporaryDirectory(prefix="spdl_lab_diagnose_", ignore_cleanup_errors=True)
    child = spawn(["-m", "spdl_lab._diagnose._isolated_child"])
    proc, data, ctrl = child.proc, child.data, child.ctrl
    bar = None
    try:
        ctrl.send({"pipeline": payload, "options": options, "sys_path": list(sys.path),
                   "cwd": os.getcwd(), "result": str(Path(folder.name) / "diagnosis.json")})
        while True:
            kind, *args = _next(data, proc)
            if kind == "total":
                bar = progress_bar(args[0], progress, args[1])
            elif kind == "describe" and bar is not None:
                bar.set_description(args[0])
            elif kind == "progress" and bar is not None:
                bar.update(args[0])
            elif kind == "done":
                return Diagnosis.from_json(args[0])
            elif kind == "error":
                raise _child_error(*args)
    finally:
        if bar is not None:
            bar.close()
        with contextlib.suppress(OSError):
            ctrl.send(("stop",))
        ctrl.close()
        stop_process(proc, timeout=3.0)
        data.close()
        folder.cleanup()


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
                      f"before it finished; if it ran out of memory, pass a smaller num_items=")


def _child_error(kind: str, message: str, text: str, stage: str | None, index: int | None) -> SpdlLabError:
    if kind == "PipelineError":  # worded by stage_failure in the child
        error: SpdlLabError = stage_failure(stage or "", index, None, message=message)
    elif kind == "PipelineSpecError":
        error = PipelineSpecError(message)
    else:
        error = SpdlLabError(f"diagnose failed in its child interpreter: {kind}: {message}")
    error.__cause__ = ChildTraceback(text)
    return error
