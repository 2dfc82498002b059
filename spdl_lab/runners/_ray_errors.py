"""The ray runner's errors: a stage's failure in a Ray worker as the PipelineError every runner raises."""

from __future__ import annotations

import re

from ..errors import PipelineError
from ._ray_plan import StageFailure

__all__ = ["drop_tracebacks", "pipeline_error", "stage_failure"]


def pipeline_error(stage: str, index: int | None, what: str, dropped: int, max_failures: int,
                    where_run: str = "in a Ray worker") -> PipelineError:
    """The error a failing stage ends the run with, worded as under every other runner."""
    where = "the source" if stage == "source" else f"stage {stage!r}"
    item = f" on item {index}" if index is not None else ""
    if stage == "source":
        advice = "Fix the source; a source that raised cannot be resumed."
    elif max_failures:
        advice = (f"{dropped} failing item(s) were already dropped (max_failures={max_failures}); "
                  f"raise max_failures to drop more.")
    else:
        advice = "Pass max_failures=N to drop and count up to N failing items instead."
    return PipelineError(f"{where} failed{item}: {what} ({where_run}). The pipeline stopped. {advice}",
                         stage=stage, index=index)


def stage_failure(exc: BaseException | None) -> StageFailure | None:
    """Our StageFailure inside whatever Ray wrapped it in (RayTaskError, UserCodeException, ...).

    Ray keeps the chain as text only, at times: then the StageFailure line of it is read back.
    """
    found = _in_chain(exc)
    if found is not None or exc is None:
        return found
    text = str(exc)
    match = _FAILURE_LINE.search(text)
    if match is None:
        return None
    stage, index, what = match.group(1), match.group(2), match.group(3)
    return StageFailure(stage, int(index), what, text, None)


_FAILURE_LINE = re.compile(r"StageFailure: stage '([^']*)' failed on item (\d+): (.*)")


def drop_tracebacks(exc: BaseException | None) -> None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _in_chain(exc: BaseException | None) -> StageFailure | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, StageFailure):
            return exc
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            found = _in_chain(cause)
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None
