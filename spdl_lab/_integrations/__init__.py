"""Loaders of other libraries (SPDL, torch DataLoader), converted or watched as they run.
Importing this package needs none of them."""

from .spdl import from_spdl
from .spdl_monitor import SpdlMonitor, is_spdl_spec, open_spdl
from .torch_dataloader import PER_WORKER, from_dataloader

__all__ = ["PER_WORKER", "SpdlMonitor", "from_dataloader", "from_spdl", "is_spdl_spec", "open_spdl"]
