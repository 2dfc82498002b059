"""``cache``: headspace, what training would do if loading were free: the first ``num_caches``
outputs of another runner, replayed for as many steps as the pipeline would have made."""

from __future__ import annotations

import itertools
import math
from typing import Any

from .._engine.engine import EngineReading
from .._engine.queues import END, TIMEOUT
from .._pipeline import Pipeline, check_ints
from ..errors import PipelineSpecError
from . import runner_class
from .base import Runner

#: A source without len() is counted by iterating it; past this many items it is taken as endless.
MAX_COUNTED_ITEMS = 10_000_000


class CacheRunner(Runner):
    """Replays the first ``num_caches`` outputs of ``source_runner``: the cached objects themselves,
    not copies, so a step that mutates its batch in place sees its own changes next time."""

    name = "cache"

    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool,
                 source_runner: str = "thread", num_caches: int = 8, forever: bool = False,
                 num_outputs: int | None = None, **source_options: Any) -> None:
        super().__init__(pipeline, buffer_size=buffer_size, max_failures=max_failures, metered=metered)
        if source_runner == "cache":
            raise PipelineSpecError("cache runner: source_runner must be another runner than 'cache'")
        check_ints("cache runner", num_caches=(num_caches, 1))
        source_class = runner_class(source_runner)
        source_class.check_names(source_options)
        self._source = source_class(pipeline, buffer_size=buffer_size, max_failures=max_failures, metered=metered,
                                    **source_options)
        self._num_caches = num_caches
        self._forever = forever
        self._num_outputs = num_outputs
        self._cache: list[tuple[int, Any]] = []
        self._served = 0
        self._total: float = math.inf
        self._final: EngineReading | None = None  # the source's last reading; None until replaying
        self._closed = False

    def start(self) -> None:
        self._source.start()

    def get(self, timeout: float) -> Any:
        if self._closed:  # by another thread: no replay after close()
            return END
        if self._final is None:
            record = self._source.get(timeout)
            if record is TIMEOUT:
                return TIMEOUT
            if record is not END:
                self._cache.append((record[1], record[2]))
                self._served += 1
                if len(self._cache) >= self._num_caches:
                    self._start_replay()
                return self._served - 1, record[1], record[2]
            self._start_replay(source_ended=True)
        if self._closed or self._served >= self._total or not self._cache:
            return END
        index, value = self._cache[self._served % len(self._cache)]
        self._served += 1
        return self._served - 1, index, value

    def _start_replay(self, source_ended: bool = False) -> None:
        self._final = self._source.read()
        self._source.close()
        if self._forever:
            return
        if self._num_outputs is not None:
            self._total = self._num_outputs
        elif source_ended:  # every output there is: counting the source would replay dropped items
            self._total = self._served
        else:
            self._total = expected_outputs(self.pipeline)

    def set_concurrency(self, stage: str, n: int) -> None:
        if self._final is None:
            self._source.set_concurrency(stage, n)

    def concurrency(self, stage: str) -> int:
        return self._source.concurrency(stage)

    def read(self) -> EngineReading:
        return self._final if self._final is not None else self._source.read()

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        self._source.close(timeout)


def expected_outputs(pipeline: Pipeline) -> int:
    """How many outputs the pipeline yields (map stages drop nothing): len(source), or a count."""
    try:
        if pipeline.source_is_factory:
            raise TypeError("a factory has no length of its own")
        n = len(pipeline.source)  # type: ignore[arg-type]
    except TypeError:
        n = sum(1 for _ in itertools.islice(pipeline.open_source(), MAX_COUNTED_ITEMS + 1))
        if n > MAX_COUNTED_ITEMS:
            raise PipelineSpecError(f"cache runner: the source has no len() and more than "
                                    f"{MAX_COUNTED_ITEMS:,} items (it may be endless), so the number of "
                                    f"outputs to replay is unknown; pass num_outputs=N or forever=True") from None
    for stage in pipeline.stages:
        if stage.kind == "batch":
            size = stage.size or 1
            n = n // size if stage.drop_last else -(-n // size)
    return n
