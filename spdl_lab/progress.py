"""The progress bar experiments share: a widget in a notebook, text on a terminal, nothing elsewhere.

A text bar redraws itself with carriage returns: in a log file or a pipe that is
litter, so where stderr is not a terminal (and no notebook is showing widgets)
the bar is off, whatever ``enabled`` says.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar", "bar_kind"]


def bar_kind(enabled: bool = True) -> str | None:
    """``"notebook"``, ``"terminal"`` or None: which bar ``progress_bar`` would show here."""
    if not enabled:
        return None
    if _in_notebook():
        return "notebook"
    stream = sys.stderr
    return "terminal" if stream is not None and hasattr(stream, "isatty") and stream.isatty() else None


def progress_bar(total: int, enabled: bool, unit: str) -> Any:
    kind = bar_kind(enabled)
    if kind == "notebook":
        from tqdm.notebook import tqdm as base
    else:
        from tqdm.std import tqdm as base

    class Progress(base):  # type: ignore[misc, valid-type]
        # No monitor thread: it would outlive the experiment.
        monitor_interval = 0

    return Progress(total=total, disable=kind is None, unit=unit, leave=False)


def _in_notebook() -> bool:
    """True in a Jupyter kernel that can show ipywidgets (tqdm.notebook's widget form)."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()
    except AttributeError:
        return False
    if ip is None or "IPKernelApp" not in getattr(ip, "config", {}):
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True
