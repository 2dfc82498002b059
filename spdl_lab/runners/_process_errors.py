"""Worker failures, dead workers and torch's own errors, as spdl_lab errors.

Messages say what failed (stage, item, pid, signal) and what to do; tracebacks
into torch are dropped (``process``) so that a stored error cannot keep workers alive.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import PipelineError, RunnerError, describe, stage_failure
from ._process_worker import Failure
from ._shipping import unsendable_output
from .children import ended

__all__ = ["pipeline_error", "dead_worker_error", "torch_error"]


def pipeline_error(failure: Failure, max_failures: int) -> PipelineError:
    if failure.unsendable:
        return unsendable_output(
            failure.stage, failure.index, failure.error, "process", f"the main process from worker pid {failure.pid}"
        )
    in_worker = failure.pid != os.getpid()
    cause = failure.error
    if in_worker and hasattr(cause, "add_note"):  # the traceback did not cross the process boundary
        cause.add_note(f"Raised in DataLoader worker pid {failure.pid}:\n{failure.worker_traceback}")
    return stage_failure(failure.stage, failure.index, cause, dropped=failure.dropped, max_failures=max_failures,
                         per_worker=True, where=f"in DataLoader worker pid {failure.pid}" if in_worker else "")


def dead_worker_error(pid: int, killed: bool, code: int) -> RunnerError:
    if killed:
        advice = "SIGKILL is often the out-of-memory killer (see dmesg): use fewer workers or smaller batches."
    else:
        advice = ("See its traceback above. A worker that exits while starting under 'spawn' usually "
                  "means the main script lacks an `if __name__ == '__main__':` guard.")
    return RunnerError(f"process runner: DataLoader worker pid {pid} {ended(killed, code)} while the pipeline "
                       f"ran; the run stopped. {advice}")


def torch_error(exc: BaseException, it: Any = None) -> RunnerError:
    """torch's own error as a RunnerError; a dead worker's signal read from its Process."""
    if "exited unexpectedly" in str(exc):
        # torch has reaped the worker already; its Process object keeps the exit code.
        for worker in getattr(it, "_workers", ()):
            code = worker.exitcode
            if code is not None and code != 0 and str(worker.pid) in str(exc):
                return dead_worker_error(worker.pid, code < 0, abs(code))
    error = RunnerError(f"process runner: the DataLoader failed: {describe(exc)}")
    error.__cause__ = exc
    return error
