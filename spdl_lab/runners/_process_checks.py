"""The process runner's options, checked when the Loader is made, and its failures (a stage,
a dead worker, torch itself) as spdl_lab errors that name what failed and what to do.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from typing import Any

from ..errors import PipelineError, PipelineSpecError, RunnerError, describe, stage_failure
from ..pipeline import MAX_CONCURRENCY
from ._process_worker import Failure
from ._shipping import unsendable_output
from .children import MainFreeSpawnContext, ended

__all__ = ["check_num_workers", "check_prefetch", "check_timeout", "context", "dead_worker_error",
           "passed_through", "pipeline_error", "torch_error"]

_SET_BY_RUNNER = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler",
                  "collate_fn", "worker_init_fn", "drop_last", "generator")
_PASSED_THROUGH = ("pin_memory_device", "in_order")


def check_num_workers(n: object, stage: str) -> int:
    return _checked(n, int, 0, MAX_CONCURRENCY, f"process runner, {stage!r}: num_workers must be an int in "
                                                f"0..{MAX_CONCURRENCY} (0 runs in this process)")


def check_timeout(timeout: object) -> float:
    return float(_checked(timeout, (int, float), 0, math.inf, "process runner: timeout must be seconds >= 0"))


def check_prefetch(prefetch_factor: object) -> int | None:
    if prefetch_factor is None:
        return None
    return _checked(prefetch_factor, int, 1, math.inf, "process runner: prefetch_factor must be an int >= 1 or None")


def _checked(value: Any, kinds: type | tuple[type, ...], low: float, high: float, message: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        raise PipelineSpecError(f"{message}, got {value!r}")
    return value


def context(context: object) -> Any:
    """A multiprocessing context; never fork, since this process runs threads."""
    if context == "spawn":
        return MainFreeSpawnContext()  # the pipeline travels by value: workers need no __main__
    if isinstance(context, str):
        try:
            context = multiprocessing.get_context(context)
        except ValueError as exc:
            raise PipelineSpecError(
                f"process runner: unknown multiprocessing_context {context!r}; use 'spawn' or 'forkserver'"
            ) from exc
    method = getattr(context, "get_start_method", lambda: None)()
    if method not in ("spawn", "forkserver"):
        raise PipelineSpecError(f"process runner: multiprocessing_context must be 'spawn' or 'forkserver', "
                                f"got {method or context!r}: forking a process that runs threads (the "
                                f"pump, the sampler) can deadlock the child.")
    return context


def passed_through(options: dict[str, Any]) -> dict[str, Any]:
    for name in options:
        if name in _SET_BY_RUNNER:
            raise PipelineSpecError(f"process runner: the DataLoader option {name!r} is set from the "
                                    f"pipeline (batch stage, per-batch maps, sharding); do not pass it")
        if name not in _PASSED_THROUGH:
            known = ("num_workers", "prefetch_factor", "persistent_workers",
                     "multiprocessing_context", "pin_memory", "timeout", *_PASSED_THROUGH)
            raise PipelineSpecError(
                f"process runner: unknown option {name!r}; options: {', '.join(known)}"
            )
    return dict(options)


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
