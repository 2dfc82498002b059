"""Loaders of other libraries, brought to the lab bench. Importing this package needs none of them.

``from_spdl`` converts an SPDL pipeline into a ``lab.Pipeline``; ``SpdlMonitor`` (what ``lab.run``
makes of an SPDL ``PipelineBuilder``) watches one as SPDL runs it; ``torch_dataloader`` converts
or watches a torch DataLoader.
"""

from .spdl import from_spdl
from .spdl_monitor import SpdlMonitor, is_spdl_spec, open_spdl

__all__ = ["SpdlMonitor", "from_spdl", "is_spdl_spec", "open_spdl"]
