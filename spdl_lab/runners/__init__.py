"""The runner registry: names in ``lab.RUNNERS`` to Runner classes."""

from __future__ import annotations

from ..errors import PipelineSpecError, RunnerError
from .base import Runner
from .cache import CacheRunner
from .process import ProcessRunner
from .subprocess_threads import SubprocessThreadsRunner
from .thread import ThreadRunner

__all__ = ["RUNNERS", "Runner", "runner_class"]

RUNNERS: tuple[str, ...] = ("thread", "subprocess-threads", "process", "cache")

_REGISTRY: dict[str, type[Runner]] = {
    "thread": ThreadRunner,
    "subprocess-threads": SubprocessThreadsRunner,
    "process": ProcessRunner,
    "cache": CacheRunner,
}


def runner_class(name: str) -> type[Runner]:
    """The Runner class registered as ``name``; a clear error for anything else."""
    if name not in RUNNERS:
        raise PipelineSpecError(
            f"unknown runner {name!r}; choose one of {', '.join(map(repr, RUNNERS))}"
        )
    try:
        return _REGISTRY[name]
    except KeyError:
        raise RunnerError(
            f"runner {name!r} is not available in this version of spdl_lab; "
            f"available now: {', '.join(map(repr, _REGISTRY))}"
        ) from None
