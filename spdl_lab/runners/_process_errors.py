"""Worker failures, dead workers and torch's own errors, as spdl_lab errors.

Messages say what failed (stage, item, pid, signal) and what to do; tracebacks
into torch are dropped so that a stored error cannot keep workers alive.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from ..errors import PipelineError, RunnerError
from ._process_worker import Failure
from ._shipping import unsendable_output

__all__ = ["pipeline_error", "dead_worker_error", "torch_error", "exit_status", "drop_tracebacks", "describe"]


def pipeline_error(failure: Failure, max_failures: int) -> PipelineError:
    if failure.unsendable:
        return unsendable_output(
            failure.stage, failure.index, failure.error, "process", f"the main process from worker pid {failure.pid}"
        )
    where = "the source" if failure.stage == "source" else f"stage {failure.stage!r}"
    item = f" on item {failure.index}" if failure.index is not None else ""
    if failure.stage == "source":
        advice = "Fix the source; a source that raised cannot be resumed."
    elif max_failures:
        advice = (
            f"That worker had already dropped {failure.dropped} failing item(s) "
            f"(max_failures={max_failures} applies per worker process); raise max_failures to drop more."
        )
    else:
        advice = "Pass max_failures=N to drop and count up to N failing items per worker instead."
    worker = f" (in DataLoader worker pid {failure.pid})" if failure.pid != os.getpid() else ""
    error = PipelineError(
        f"{where} failed{item}: {describe(failure.error)}{worker}. The pipeline stopped. {advice}",
        stage=failure.stage,
        index=failure.index,
    )
    cause = failure.error
    if worker and hasattr(cause, "add_note"):  # the traceback did not cross the process boundary
        cause.add_note(f"Raised in DataLoader worker pid {failure.pid}:\n{failure.worker_traceback}")
    error.__cause__ = cause
    return error


def dead_worker_error(pid: int, killed: bool, code: int) -> RunnerError:
    if killed:
        how = f"was killed by signal {_signal_name(code)}"
        advice = "SIGKILL is often the out-of-memory killer (see dmesg): use fewer workers or smaller batches."
    else:
        how = f"exited with status {code}"
        advice = (
            "See its traceback above. A worker that exits while starting under 'spawn' usually "
            "means the main script lacks an `if __name__ == '__main__':` guard."
        )
    return RunnerError(
        f"process runner: DataLoader worker pid {pid} {how} while the pipeline ran; "
        f"the run stopped. {advice}"
    )


def torch_error(exc: RuntimeError, it: Any) -> RunnerError:
    """torch's own RuntimeError as a RunnerError; a dead worker's signal read from its Process."""
    if "exited unexpectedly" in str(exc):
        # torch has reaped the worker already; its Process object keeps the exit code.
        for worker in getattr(it, "_workers", ()):
            code = worker.exitcode
            if code is not None and code != 0 and str(worker.pid) in str(exc):
                return dead_worker_error(worker.pid, code < 0, abs(code))
    error = RunnerError(f"process runner: the DataLoader failed: {describe(exc)}")
    error.__cause__ = exc
    return error


def exit_status(pid: int) -> tuple[bool, int] | None:
    """(killed by a signal, signal or status) if child ``pid`` has exited, else None.

    WNOWAIT leaves the child to be reaped by torch, whose Process object needs it.
    """
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (torch will report it) or not our child
        return None
    if info is None:
        return None
    return info.si_code in (os.CLD_KILLED, os.CLD_DUMPED), info.si_status


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} ({number})"
    except ValueError:
        return str(number)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def drop_tracebacks(exc: BaseException | None) -> None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        if exc.__context__ is not None and exc.__context__ is not exc.__cause__:
            drop_tracebacks(exc.__context__)
        exc = exc.__cause__
