"""The process runner's options, checked up front, and its pipeline made shippable.

Bad options fail when the Loader is made, naming the option and what it takes;
the pipeline itself is shipped by ``_shipping.ship``.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from ..errors import PipelineSpecError
from ..pipeline import MAX_CONCURRENCY
from .children import MainFreeSpawnContext

__all__ = ["check_num_workers", "check_timeout", "check_prefetch", "context", "passed_through"]

_SET_BY_RUNNER = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler",
                  "collate_fn", "worker_init_fn", "drop_last", "generator")
_PASSED_THROUGH = ("pin_memory_device", "in_order")


def check_num_workers(n: object, stage: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_CONCURRENCY:
        raise PipelineSpecError(f"process runner, {stage!r}: num_workers must be an int in "
                                f"0..{MAX_CONCURRENCY} (0 runs in this process), got {n!r}")
    return n


def check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise PipelineSpecError(f"process runner: timeout must be seconds >= 0, got {timeout!r}")
    return float(timeout)


def check_prefetch(prefetch_factor: object) -> int | None:
    if prefetch_factor is None:
        return None
    if isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int) or prefetch_factor < 1:
        raise PipelineSpecError(
            f"process runner: prefetch_factor must be an int >= 1 or None, got {prefetch_factor!r}"
        )
    return prefetch_factor


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
