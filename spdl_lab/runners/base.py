"""The runner contract: one small interface, one implementation per parallelism model.

A Loader drives a runner; callers never special-case a runner by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ..engine.engine import EngineReading
from ..pipeline import Pipeline

__all__ = ["Runner", "RunnerOptions"]


class RunnerOptions(dict):
    """Options specific to one runner (e.g. ``num_workers`` for ``process``)."""


class Runner(ABC):
    """Executes a Pipeline once; a Loader makes a new Runner per iteration.

    ``get`` returns ``(seq, index, value)`` records, ``END`` when the pipeline is
    exhausted, or ``TIMEOUT`` when nothing came within ``timeout`` seconds; it
    raises ``PipelineError`` or ``RunnerError`` when the run failed.
    """

    #: the name in ``lab.RUNNERS``
    name: str = ""

    def __init__(
        self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool
    ) -> None:
        self.pipeline = pipeline
        self.buffer_size = buffer_size
        self.max_failures = max_failures
        self.metered = metered

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def get(self, timeout: float) -> Any: ...

    @abstractmethod
    def set_concurrency(self, stage: str, n: int) -> None: ...

    @abstractmethod
    def concurrency(self, stage: str) -> int: ...

    @abstractmethod
    def read(self) -> EngineReading: ...

    @abstractmethod
    def close(self, timeout: float = 5.0) -> None: ...
