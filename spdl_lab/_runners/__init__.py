"""The runner registry: names in ``lab.RUNNERS`` to Runner classes."""

import importlib

from ..errors import PipelineSpecError
from ._ray_cluster import ray_processes
from ._shm import Layout, MeterBlock, ShmFile, SlotMeter, new_prefix, sweep_dead_owners
from .base import Runner

# Also for others: the shm meter block meters a torch DataLoader (sweep_dead_owners removes what a
# killed owner left); ray_processes, a Ray instance.
__all__ = ["DEFAULT_NUM_WORKERS", "LOCAL_RUNNERS", "RUNNERS", "Layout", "MeterBlock", "Runner", "ShmFile",
           "SlotMeter", "WORKERS", "new_prefix", "ray_processes", "runner_class", "sweep_dead_owners"]

#: The runners on this host: what ``lab.compare`` and the CLI compare unless told otherwise
#: (``ray`` starts a Ray instance, tens of seconds: it is compared when named).
LOCAL_RUNNERS: tuple[str, ...] = ("thread", "subprocess-threads", "process", "cache")
RUNNERS: tuple[str, ...] = LOCAL_RUNNERS + ("ray",)

#: The process runner's pseudo-stage naming its worker pool in ``set_concurrency``/``concurrency``,
#: and its default pool size. Here, not in ``process``, so that naming them imports no torch.
WORKERS = "workers"
DEFAULT_NUM_WORKERS = 2

# Imported when first asked for: only ``process`` needs torch, and the subprocess-threads
# child (which imports this package) starts much sooner without it.
_REGISTRY: dict[str, tuple[str, str]] = {
    "thread": ("base", "ThreadRunner"),
    "subprocess-threads": ("subprocess_threads", "SubprocessThreadsRunner"),
    "process": ("process", "ProcessRunner"),
    "cache": ("cache", "CacheRunner"),
    "ray": ("ray_runner", "RayRunner"),
}


def runner_class(name: str) -> type[Runner]:
    """The Runner class registered as ``name``; a clear error for anything else."""
    if name not in RUNNERS:
        raise PipelineSpecError(f"unknown runner {name!r}; choose one of "
                                f"{', '.join(map(repr, RUNNERS))}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(f".{module}", __name__), cls)
