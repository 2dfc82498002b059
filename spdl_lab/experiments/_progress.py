"""The progress bar experiments share: tqdm.auto (a widget in notebooks, text elsewhere)."""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar"]


def progress_bar(total: int, enabled: bool, unit: str) -> Any:
    from tqdm.auto import tqdm

    class Progress(tqdm):  # type: ignore[misc, valid-type]
        # No monitor thread: it would outlive the experiment.
        monitor_interval = 0

    return Progress(total=total, disable=not enabled, unit=unit, leave=False)
