"""The runner registry: names in ``lab.RUNNERS`` to Runner classes."""

from __future__ import annotations

import importlib

from ..errors import PipelineSpecError, RunnerError
from .base import Runner

__all__ = ["ALL_RUNNERS", "PREVIEW_RUNNERS", "RUNNERS", "Runner", "runner_class"]

RUNNERS: tuple[str, ...] = ("thread", "subprocess-threads", "process", "cache")
#: Runners that work but are not yet in RUNNERS (so not in compare's default or the fault
#: battery's parametrization): ``ray`` joins RUNNERS once its reliability tests do (issue 20).
#: Named, they are taken wherever a runner is (Loader, lab.run, compare, the CLI, the dashboard).
PREVIEW_RUNNERS: tuple[str, ...] = ("ray",)
ALL_RUNNERS: tuple[str, ...] = RUNNERS + PREVIEW_RUNNERS

# Imported when first asked for: only ``process`` needs torch, and the
# subprocess-threads child (which imports this package) starts in a fraction
# of the time without it.
_REGISTRY: dict[str, tuple[str, str]] = {
    "thread": ("thread", "ThreadRunner"),
    "subprocess-threads": ("subprocess_threads", "SubprocessThreadsRunner"),
    "process": ("process", "ProcessRunner"),
    "cache": ("cache", "CacheRunner"),
    "ray": ("ray_runner", "RayRunner"),
}


def runner_class(name: str) -> type[Runner]:
    """The Runner class registered as ``name``; a clear error for anything else."""
    if name not in ALL_RUNNERS:
        raise PipelineSpecError(
            f"unknown runner {name!r}; choose one of {', '.join(map(repr, ALL_RUNNERS))}"
        )
    try:
        module, cls = _REGISTRY[name]
    except KeyError:
        raise RunnerError(
            f"runner {name!r} is not available in this version of spdl_lab; "
            f"available now: {', '.join(map(repr, _REGISTRY))}"
        ) from None
    return getattr(importlib.import_module(f".{module}", __name__), cls)
