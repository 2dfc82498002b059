"""The ray runner's source: what Ray Data splits must be indexable, with a known length."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..engine.queues import QueueClosed
from ..errors import PipelineSpecError
from ..pipeline import Pipeline
from ._ray_errors import pipeline_error

__all__ = ["MAX_MATERIALIZED", "indexable"]

#: A source without random access is read into a list in the driver, up to this many items.
MAX_MATERIALIZED = 1_000_000


def indexable(pipeline: Pipeline, stopping: Any = lambda: False) -> tuple[Any, int]:
    """The source as something indexable, with its length: a sequence as it is, any other
    iterable read into a list here (up to ``MAX_MATERIALIZED`` items), as Ray Data splits a
    known number of items over its workers."""
    source = pipeline.source() if pipeline.source_is_factory else pipeline.source
    if isinstance(source, (range, Sequence)):
        return source, len(source)
    items: list[Any] = []
    iterator = iter(source)
    while True:
        try:
            items.append(next(iterator))
        except StopIteration:
            return items, len(items)
        except Exception as exc:  # noqa: BLE001 - the user's source: the run's error, naming the item
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            error = pipeline_error("source", len(items), what, 0, 0, "read here, before Ray starts")
            raise error from exc
        if stopping():
            raise QueueClosed("closed while the source was read")
        if len(items) > MAX_MATERIALIZED:
            raise PipelineSpecError(
                f"ray runner: the source yields more than {MAX_MATERIALIZED} items without random access "
                f"(each is read into a list here before Ray Data splits them). Pass a sequence: "
                f"a list of paths, a range, or a dataset with __getitem__ and __len__")
