"""The runner contract: one small interface, one implementation per parallelism model.

A Loader drives a runner; callers never special-case a runner by name.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any

from ..engine.engine import EngineReading
from ..errors import PipelineSpecError
from ..pipeline import Pipeline

__all__ = ["Runner"]


class Runner(ABC):
    """Executes a Pipeline once; a Loader makes a new Runner per iteration.

    ``get`` returns ``(seq, index, value)`` records, ``END`` when the pipeline is
    exhausted, or ``TIMEOUT`` when nothing came within ``timeout`` seconds; it
    raises ``PipelineError`` or ``RunnerError`` when the run failed.
    """

    #: the name in ``lab.RUNNERS``
    name: str = ""
    #: For runners whose parallelism is one pool for every stage (``process``):
    #: the pseudo-stage naming it in ``set_concurrency`` and the option that
    #: sizes it, so a Loader can accept the one and carry the other to later runs.
    pool_stage: str | None = None
    pool_option: str | None = None

    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool) -> None:
        self.pipeline = pipeline
        self.buffer_size = buffer_size
        self.max_failures = max_failures
        self.metered = metered

    @classmethod
    def check_options(cls, pipeline: Pipeline, options: dict[str, Any]) -> None:
        """Reject options this runner does not take, before anything starts.

        Runners with option values to check extend this.
        """
        params = inspect.signature(cls).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return
        unknown = [k for k in options if k not in params]
        if unknown:
            known = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
            raise PipelineSpecError(f"runner {cls.name!r} does not take option(s) "
                                    f"{', '.join(map(repr, unknown))}; it takes: {', '.join(known)}")

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
