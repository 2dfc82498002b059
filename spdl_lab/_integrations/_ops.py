"""Stage functions and sources of a converted SPDL pipeline, in the form lab runners call.

All are picklable (cloudpickle carries the user's function by value).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Iterator
from typing import Any

from ..errors import SpdlLabError
from ._event_loop import LoopThread

__all__ = ["AsyncSource", "ItemSkipped", "Op"]


class ItemSkipped(SpdlLabError):
    """An SPDL op returned ``None``: SPDL drops the item, a lab.Pipeline counts it as a failure."""


class Op:
    """An SPDL op as a lab stage function; an async one is awaited on ``loop`` while the calling
    thread blocks, so N threads keep up to N coroutines on the loop: SPDL's concurrency."""

    __slots__ = ("fn", "stage", "loop")

    def __init__(self, fn: Callable[[Any], Any], stage: str, loop: LoopThread | None = None) -> None:
        self.fn = fn
        self.stage = stage
        self.loop = loop

    def __call__(self, item: Any) -> Any:
        result = self.fn(item) if self.loop is None else self.loop.run(self.fn, item)
        if result is None:
            raise ItemSkipped(
                f"stage {self.stage!r} returned None: SPDL drops such items, but a lab.Pipeline has no "
                f"filter, so the item counts as a failed one. Pass max_failures=N to lab.Loader or "
                f"lab.run to drop and count up to N of them.")
        return result


class AsyncSource:
    """An async iterable as a lab source: a factory of iterators that step it on ``loop``."""

    __slots__ = ("source", "loop")

    def __init__(self, source: AsyncIterable[Any], loop: LoopThread) -> None:
        self.source = source
        self.loop = loop

    def __call__(self) -> Iterator[Any]:
        return self._items()

    def _items(self) -> Iterator[Any]:
        iterator = self.loop.run(_aiter, self.source)
        try:
            while True:
                try:
                    yield self.loop.run(_anext, iterator)
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                self.loop.run(lambda _: aclose(), None)

    def __repr__(self) -> str:
        return f"AsyncSource({type(self.source).__name__})"


async def _aiter(source: AsyncIterable[Any]) -> Any:
    return aiter(source)


async def _anext(iterator: Any) -> Any:
    return await anext(iterator)
