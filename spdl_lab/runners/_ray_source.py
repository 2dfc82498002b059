"""The ray runner's source: what Ray Data splits must be indexable, with a known length."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..engine.queues import QueueClosed
from ..errors import PipelineSpecError, stage_failure
from ..pipeline import Pipeline

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
            raise stage_failure("source", len(items), exc, where="read here, before Ray starts") from exc
        if stopping():
            raise QueueClosed("closed while the source was read")
        if len(items) > MAX_MATERIALIZED:
            raise PipelineSpecError(
                f"ray runner: the source yields more than {MAX_MATERIALIZED} items without random access "
                f"(each is read into a list here before Ray Data splits them). Pass a sequence: "
                f"a list of paths, a range, or a dataset with __getitem__ and __len__")
