"""Sending work to another process and outputs back: cloudpickle, or an error naming the culprit."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle

from .._pipeline import Pipeline
from ..errors import PipelineError, PipelineSpecError, describe, stage_failure


def ship(pipeline: Pipeline, runner: str, destination: str) -> bytes:
    """The pipeline as cloudpickle bytes, or an error naming the source or stage that cannot go."""
    try:
        return cloudpickle.dumps(pipeline)
    except Exception as exc:
        raise PipelineSpecError(
            f"{runner} runner: {_unpicklable_part(pipeline)} cannot be pickled to send it to "
            f"{destination} ({describe(exc)}). Create locks, open files and clients "
            f"inside the function instead of capturing them, or use runner='thread'.") from exc


def _unpicklable_part(pipeline: Pipeline) -> str:
    parts = [("the source", pipeline.source)]
    parts += [(f"stage {s.name!r} (its function)", s.fn) for s in pipeline.stages if s.fn is not None]
    for label, part in parts:
        try:
            cloudpickle.dumps(part)
        except Exception:
            return label
    return "the pipeline"


def output_stage(pipeline: Pipeline) -> str:
    """The stage whose return values make up the outputs: the last map, else the source."""
    maps = [s.name for s in pipeline.stages if s.kind == "map"]
    return maps[-1] if maps else "source"


def unsendable_output(stage: str, index: int | None, exc: BaseException, runner: str,
                      destination: str) -> PipelineError:
    """The error for an output that cannot be pickled back to ``destination``."""
    where = "the source" if stage == "source" else f"stage {stage!r}"
    item = f" on item {index}" if index is not None else ""
    return stage_failure(stage, index, exc, message=(
        f"{runner} runner: {where} returned an object{item} that cannot be sent to {destination} "
        f"({describe(exc)}). The pipeline stopped. Return picklable values from it (arrays, "
        f"tensors, numbers, strings, and lists, tuples or dicts of them): create locks, "
        f"generators and open files where the batch is used instead, or use runner='thread'."))


def pickled(exc: BaseException, dumps: Callable[[Any], bytes] = pickle.dumps) -> bytes | None:
    """An exception as bytes that load back (some pickle, yet cannot be rebuilt), or None."""
    try:
        data = dumps(exc)
        pickle.loads(data)
    except Exception:
        return None
    return data
