"""Sending a pipeline to another process: cloudpickle, or an error naming what cannot go."""

from __future__ import annotations

import cloudpickle

from ..errors import PipelineSpecError
from ..pipeline import Pipeline

__all__ = ["ship"]


def ship(pipeline: Pipeline, runner: str, destination: str) -> bytes:
    """The pipeline as cloudpickle bytes (functions from notebooks and ``__main__`` included).

    If it cannot be pickled, the error names the source or stage that is the
    culprit, so the user knows which function captures a lock, file or client.
    """
    try:
        return cloudpickle.dumps(pipeline)
    except Exception as exc:
        raise PipelineSpecError(
            f"{runner} runner: {_unpicklable_part(pipeline)} cannot be pickled to send it to "
            f"{destination} ({type(exc).__name__}: {exc}). Create locks, open files and clients "
            f"inside the function instead of capturing them, or use runner='thread'."
        ) from exc


def _unpicklable_part(pipeline: Pipeline) -> str:
    parts = [("the source", pipeline.source)]
    parts += [(f"stage {s.name!r} (its function)", s.fn) for s in pipeline.stages if s.fn is not None]
    for label, part in parts:
        try:
            cloudpickle.dumps(part)
        except Exception:
            return label
    return "the pipeline"
