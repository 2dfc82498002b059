"""The progress bar experiments share: a widget in a notebook (tqdm.auto), text on a terminal, and
nothing where stderr is not one (a redrawn bar is litter in a log or a pipe)."""

from __future__ import annotations

import sys
from typing import Any


def bar_kind(enabled: bool = True) -> str | None:
    """``"notebook"``, ``"terminal"`` or None: which bar ``progress_bar`` would show here."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    # tqdm.auto imports tqdm.notebook only in a kernel, and mixes it in only where ipywidgets loads.
    notebook = sys.modules.get("tqdm.notebook")
    if notebook is not None and issubclass(tqdm, notebook.tqdm_notebook):
        return "notebook"
    return "terminal" if getattr(sys.stderr, "isatty", lambda: False)() else None  # None: no stderr


def progress_bar(total: int, enabled: bool, unit: str) -> Any:
    from tqdm.auto import tqdm

    class Progress(tqdm):  # type: ignore[misc, valid-type]
        # No monitor thread: it would outlive the experiment.
        monitor_interval = 0

    return Progress(total=total, disable=bar_kind(enabled) is None, unit=unit, leave=False)
