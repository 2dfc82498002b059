"""``thread``: every stage runs in thread pools inside this process (SPDL's "mt")."""

from __future__ import annotations

from typing import Any

from .._engine.engine import ITEM_QUEUE_SIZE, Engine, EngineReading
from .._pipeline import Pipeline
from .base import Runner

__all__ = ["ThreadRunner"]


class ThreadRunner(Runner):
    name = "thread"

    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool,
                 item_queue_size: int = ITEM_QUEUE_SIZE) -> None:
        super().__init__(pipeline, buffer_size=buffer_size, max_failures=max_failures, metered=metered)
        self._engine = Engine(pipeline, buffer_size=buffer_size, max_failures=max_failures,
                              metered=metered, item_queue_size=item_queue_size)

    def start(self) -> None:
        self._engine.start()

    def get(self, timeout: float) -> Any:
        return self._engine.get(timeout)

    def set_concurrency(self, stage: str, n: int) -> None:
        self._engine.set_concurrency(stage, n)

    def concurrency(self, stage: str) -> int:
        return self._engine.concurrency(stage)

    def read(self) -> EngineReading:
        return self._engine.read()

    def close(self, timeout: float = 5.0) -> None:
        self._engine.close(timeout)
