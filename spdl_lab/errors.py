"""Exceptions raised by spdl_lab.

Every message says what failed, where (which stage, which item, which runner)
and, where there is one, what to do about it.
"""

from __future__ import annotations

__all__ = [
    "SpdlLabError",
    "PipelineSpecError",
    "PipelineError",
    "RunnerError",
    "FileFormatError",
    "UsageError",
]


class SpdlLabError(Exception):
    """Base class of every error spdl_lab raises on purpose."""


class PipelineSpecError(SpdlLabError, ValueError, TypeError):
    """A pipeline, stage or setting was described wrongly.

    It is both a ``ValueError`` and a ``TypeError`` so that callers who catch
    either of the built-in kinds for bad arguments catch this one too.
    """


class PipelineError(SpdlLabError, RuntimeError):
    """A stage (or the source) raised while the pipeline ran.

    ``stage`` names the stage, ``index`` the item (source index for per-item
    stages, batch index after a ``batch`` stage); the original exception is
    chained as ``__cause__``.
    """

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
