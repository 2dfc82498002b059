"""Exceptions raised by spdl_lab, and the one stage-failure message every runner raises: what
failed, where (stage, item, runner) and, where there is one, what to do."""

from __future__ import annotations

__all__ = ["FileFormatError", "PipelineError", "PipelineSpecError", "RunnerError", "SpdlLabError", "UsageError",
           "describe", "drop_tracebacks", "in_chain", "stage_failure"]


class SpdlLabError(Exception):
    """Base class of every error spdl_lab raises on purpose."""


class PipelineSpecError(SpdlLabError, ValueError, TypeError):
    """A pipeline, stage or setting was described wrongly: a ``ValueError`` and a ``TypeError`` both,
    so that callers who catch either of the built-in kinds for bad arguments catch this one too."""


class PipelineError(SpdlLabError, RuntimeError):
    """A stage (or the source) raised while the pipeline ran: ``stage`` names the stage, ``index``
    the item (source index for per-item stages, batch index after a ``batch`` stage); the original
    exception is chained as ``__cause__``."""

    def __init__(self, message: str, *, stage: str, index: int | None) -> None:
        super().__init__(message)
        self.stage = stage
        self.index = index


class RunnerError(SpdlLabError, RuntimeError):
    """A runner could not start, or its machinery (a child process, a worker) failed."""


class FileFormatError(SpdlLabError, ValueError):
    """A saved file (or a result being saved) does not fit its format; ``field`` is its JSON path."""

    def __init__(self, message: str, *, source: str, field: str) -> None:
        super().__init__(message)
        self.source, self.field = source, field


class UsageError(SpdlLabError, ValueError):
    """A command line named something that cannot be used; the message says what to do."""


def describe(exc: BaseException) -> str:
    """``ValueError: bad record``, or the type's name alone when the message is empty."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def stage_failure(stage: str, index: int | None, cause: BaseException | None, *,
                  what: str | None = None, where: str = "", dropped: int = 0, max_failures: int = 0,
                  per_worker: bool = False, message: str | None = None) -> PipelineError:
    """The error a failing stage (or the source) ends a run with, under every runner. ``what``: the
    failure as text when ``cause`` did not survive a worker; ``where``: "in a Ray worker";
    ``per_worker``: ``max_failures`` counts per process; ``message``: worded so in a child."""
    if message is None:
        place = "the source" if stage == "source" else f"stage {stage!r}"
        item = f" on item {index}" if index is not None else ""
        what = what or (describe(cause) if cause is not None else "an error")
        ran = f" ({where})" if where else ""
        message = f"{place} failed{item}: {what}{ran}. The pipeline stopped. " + _advice(
            stage, dropped, max_failures, per_worker)
    error = PipelineError(message, stage=stage, index=index)
    error.__cause__ = cause
    return error


def _advice(stage: str, dropped: int, max_failures: int, per_worker: bool) -> str:
    if stage == "source":
        return "Fix the source; a source that raised cannot be resumed."
    if not max_failures:
        each = " per worker" if per_worker else ""
        return f"Pass max_failures=N to drop and count up to N failing items{each} instead."
    if per_worker:
        return (f"That worker had already dropped {dropped} failing item(s) (max_failures="
                f"{max_failures} applies per worker process); raise max_failures to drop more.")
    return (f"{dropped} failing item(s) were already dropped (max_failures={max_failures}); "
            f"raise max_failures to drop more.")


def drop_tracebacks(exc: BaseException | None) -> None:
    """Clear the tracebacks along an error's chain: a stored error holds no frames of live workers."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        if exc.__context__ is not None and exc.__context__ is not exc.__cause__:
            drop_tracebacks(exc.__context__)
        exc = exc.__cause__


def in_chain(exc: BaseException | None, kinds: type[BaseException] | tuple[type[BaseException], ...]
             ) -> BaseException | None:
    """The first of ``kinds`` among ``exc`` and the exceptions it was raised from or during
    (``__cause__``, ``__context__``, and the ``cause`` a Ray task error keeps), or None: a
    KeyboardInterrupt a library wrapped in its own error is still one."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kinds):
            return exc
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and (found := in_chain(cause, kinds)) is not None:
            return found
        exc = exc.__cause__ or exc.__context__
    return None
