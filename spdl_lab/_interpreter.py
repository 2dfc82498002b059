"""Facts about this interpreter that change what data loading can do: GIL, cores, torch, CUDA
(``spdl-lab info``, ``%spdl_info``, the dashboard's header)."""

from __future__ import annotations

import os
import platform
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Interpreter:
    python: str
    executable: str
    free_threaded: bool  # built with Py_GIL_DISABLED
    gil_enabled: bool  # the GIL is on now (a free-threaded build can turn it back on)
    cpu_cores: int
    torch: str | None  # version, None when torch is not installed
    cuda: bool

    @property
    def gil(self) -> str:
        """A short label: 'GIL on', 'GIL off (free-threaded)', 'GIL on (free-threaded build)'."""
        if not self.free_threaded:
            return "GIL on"
        return "GIL off (free-threaded)" if not self.gil_enabled else "GIL on (free-threaded build)"

    def lines(self, version: str, runners: Sequence[str]) -> list[str]:
        build = "free-threaded" if self.free_threaded else "with GIL"
        cuda = f"CUDA {'available' if self.cuda else 'not available'}"
        torch = f"{self.torch}; {cuda}" if self.torch is not None else "not installed"
        return [
            f"python      {self.python} ({self.executable})",
            f"build       {build}; GIL {'on' if self.gil_enabled else 'off'}",
            f"cpu cores   {self.cpu_cores}",
            f"torch       {torch}",
            f"spdl_lab    {version}; runners: {', '.join(runners)}",
        ]


def describe() -> Interpreter:
    # sys._is_gil_enabled is the only way to ask (3.13+); older builds always hold a GIL.
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    try:
        import torch

        version, cuda = torch.__version__, bool(torch.cuda.is_available())
    except ImportError:
        version, cuda = None, False
    return Interpreter(python=platform.python_version(), executable=sys.executable,
                       free_threaded=bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
                       gil_enabled=True if is_enabled is None else bool(is_enabled()),
                       cpu_cores=os.cpu_count() or 1, torch=version, cuda=cuda)
