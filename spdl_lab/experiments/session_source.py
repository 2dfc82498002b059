"""What ``lab.run`` iterates: a Pipeline under a runner, a Loader, an SPDL pipeline or any
iterable, with checks that name what was wrong and what to pass instead."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import PipelineSpecError
from ..integrations import is_spdl_spec, open_spdl
from ..loader import Loader
from ..pipeline import Pipeline

__all__ = ["check_limits", "open_source"]


def open_source(
    source: Any, runner: str | None, sample_hz: float, options: dict[str, Any]
) -> tuple[Loader | None, Iterable[Any], str]:
    """The Loader to sample (None for a plain iterable), the iterable to loop over, the runner's name."""
    if isinstance(source, Pipeline):
        if runner == "cache" and not {"forever", "num_outputs"} & set(options):
            # The session decides when to stop; headspace replays until then
            # rather than counting the source first (which may be endless).
            options = {**options, "forever": True}
        loader = Loader(source, runner=runner or "thread", sample_hz=sample_hz, **options)
        return loader, loader, loader.runner
    if isinstance(source, Loader):
        if runner is not None and runner != source.runner or options:
            raise PipelineSpecError(
                "run: pass runner options to the lab.Loader itself, not to run(), when giving a Loader"
            )
        return source, source, source.runner
    # SPDL pipelines (spdl_lab.integrations): monitored as SPDL runs them, or converted for a lab runner.
    if is_spdl_spec(source):
        return open_spdl(source, runner, sample_hz, options)
    if runner is not None or options:
        raise PipelineSpecError(
            f"run: runner= and loader options apply to a lab.Pipeline; "
            f"{type(source).__name__} is iterated as it is"
        )
    if not hasattr(source, "__iter__"):
        raise PipelineSpecError(
            f"run: expected a lab.Pipeline, a lab.Loader or an iterable, got {type(source).__name__}"
        )
    return None, source, type(source).__name__


def check_limits(steps: int | None, duration: float | None) -> None:
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise PipelineSpecError(f"run: steps must be an int >= 1 or None, got {steps!r}")
    if duration is not None and (not isinstance(duration, (int, float)) or duration <= 0):
        raise PipelineSpecError(f"run: duration must be a number of seconds > 0 or None, got {duration!r}")
