"""``lab.from_spdl``: an SPDL pipeline as a ``lab.Pipeline``, for every lab runner and experiment
(``spdl_monitor`` watches one as SPDL runs it instead), its functions and source in the form lab
runners call: all picklable (cloudpickle carries the user's function by value).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Iterator
from typing import Any

from .._pipeline import Pipeline
from ..errors import SpdlLabError
from ._event_loop import LoopThread
from ._spdl_config import SpdlNotInstalledError, op_kind, pipe_fields, pipe_ordered, read_spec

__all__ = ["AsyncSource", "ItemSkipped", "Op", "SpdlNotInstalledError", "from_spdl"]


def from_spdl(builder_or_config: Any) -> Pipeline:
    """A ``lab.Pipeline`` that does what an SPDL pipeline (a builder or its config) does.

    Example::

        p = lab.from_spdl(PipelineBuilder().add_source(range(1000))
                          .pipe(decode, concurrency=4).aggregate(32).pipe(collate).add_sink(3))
        lab.diagnose(p)

    Names and concurrency are kept; async functions share one event loop thread. An item a pipe
    maps to ``None`` (SPDL drops it) counts as a failure; the sink's buffer is ``lab.Loader``'s.
    """
    spec = read_spec(builder_or_config, caller="lab.from_spdl", convert=True)
    loop = LoopThread()  # shared by the async stages, as SPDL shares one loop
    source = spec.config.src.source
    if not hasattr(source, "__iter__"):
        source = AsyncSource(source, loop)
    pipeline = Pipeline(source)
    for part in spec.parts:
        if part.kind == "batch":
            pipeline = pipeline.batch(part.cfg.op.n, drop_last=part.cfg.drop_last, name=part.name)
            continue
        op = pipe_fields(part.cfg)[0]
        fn = Op(op, part.name, loop if op_kind(op) == "async function" else None)
        pipeline = pipeline.map(fn, concurrency=part.concurrency, name=part.name, ordered=pipe_ordered(part.cfg))
    return pipeline


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
