"""Loaders of other libraries, brought to the lab bench. Importing this package needs none of them.

* ``spdl`` / ``spdl_monitor`` (SPDL, ``spdl_core``): ``from_spdl`` turns an SPDL
  pipeline into a ``lab.Pipeline`` for every runner and experiment;
  ``SpdlMonitor`` (what ``lab.run`` makes of an SPDL ``PipelineBuilder``)
  watches one as SPDL itself runs it.
* ``torch_dataloader``: a torch DataLoader, converted or watched as it is.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["SpdlMonitor", "from_spdl", "is_spdl_spec", "open_spdl"]


def from_spdl(builder_or_config: Any) -> Any:
    """A ``lab.Pipeline`` that does what an SPDL pipeline does (see ``integrations.spdl``)."""
    from .spdl import from_spdl as convert

    return convert(builder_or_config)


def is_spdl_spec(obj: Any) -> bool:
    """True for an SPDL ``PipelineBuilder``, ``PipelineConfig`` or ``SpdlMonitor``.

    Imports nothing: an object can only be SPDL's if SPDL was imported already.
    """
    if "spdl.pipeline" not in sys.modules or sys.modules["spdl.pipeline"] is None:
        return False
    from spdl.pipeline import PipelineBuilder
    from spdl.pipeline.defs import PipelineConfig

    from .spdl_monitor import SpdlMonitor

    return isinstance(obj, (PipelineBuilder, PipelineConfig, SpdlMonitor))


def open_spdl(source: Any, runner: str | None, sample_hz: float, options: dict[str, Any]) -> Any:
    """``lab.run``'s way into an SPDL pipeline (see ``spdl_monitor.open_spdl``)."""
    from .spdl_monitor import open_spdl as open_

    return open_(source, runner, sample_hz, options)


def __getattr__(name: str) -> Any:
    if name == "SpdlMonitor":
        from .spdl_monitor import SpdlMonitor

        return SpdlMonitor
    raise AttributeError(f"module 'spdl_lab.integrations' has no attribute {name!r}")
