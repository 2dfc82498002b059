"""The runner contract (one implementation per parallelism model; callers never special-case a
runner by name), ``ThreadRunner``, and ``PumpRunner``, which process and ray share."""

from __future__ import annotations

import inspect
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from .._engine.engine import Engine, EngineReading, default_buffer_size
from .._engine.queues import END, TIMEOUT, BoundedQueue, QueueClosed
from .._pipeline import Pipeline
from ..errors import PipelineSpecError, RunnerError, SpdlLabError, drop_tracebacks

#: How often a consumer waiting in ``PumpRunner.get`` runs the runner's ``_check``.
_CHECK_S = 0.1


class Runner(ABC):
    """Executes a Pipeline once; a Loader makes a new Runner per iteration. ``get`` returns
    ``(seq, index, value)`` records, ``END`` when the pipeline is exhausted, or ``TIMEOUT`` when
    nothing came within ``timeout`` seconds; it raises ``PipelineError`` or ``RunnerError``."""

    #: the name in ``lab.RUNNERS``
    name: str = ""
    #: For a runner whose parallelism is one pool for every stage (``process``): the pseudo-stage
    #: naming it in ``set_concurrency``, and the option a Loader carries to later runs.
    pool_stage: str | None = None
    pool_option: str | None = None
    #: For how long after its first batch it may still start processes (Ray starts workers for
    #: its first tasks then): a comparison waits for them before it measures. 0: all are up by
    #: then (a DataLoader's workers, the subprocess child).
    late_start_s: float = 0.0

    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool) -> None:
        self.pipeline = pipeline
        self.buffer_size = buffer_size
        self.max_failures = max_failures
        self.metered = metered

    @classmethod
    def check_options(cls, pipeline: Pipeline, options: dict[str, Any]) -> None:
        """Reject bad options before anything starts: building a runner checks them and starts nothing."""
        cls.check_names(options)
        cls(pipeline, **options)

    @classmethod
    def check_names(cls, options: dict[str, Any]) -> None:
        params = inspect.signature(cls).parameters
        unknown = [k for k in options if k not in params]
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
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

    def park(self, parked: bool) -> None:  # noqa: B027 - most runners have nothing to park
        """Take no CPU while another runner is measured, or be ready again (ray: its instance)."""


class ThreadRunner(Engine, Runner):
    """``thread``: every stage in thread pools in this process (SPDL's "mt"); the engine itself."""

    name = "thread"


class Delivered:
    """Numbers (source items or chunks) delivered or dropped, so a restart neither loses nor
    repeats one: a contiguous prefix plus the few beyond it. The pump writes it, ships a copy."""

    def __init__(self, below: int = 0, beyond: Iterable[int] = ()) -> None:
        self.below = below
        self._beyond = set(beyond)

    def __contains__(self, number: int) -> bool:
        return number < self.below or number in self._beyond

    def add(self, numbers: Iterable[int]) -> None:
        self._beyond.update(numbers)
        self._advance()

    def cover(self, end: int) -> None:
        """Every number below ``end`` is done with (delivered, or dropped as a failure)."""
        if end > self.below:
            self.below = end
            self._beyond = {n for n in self._beyond if n >= end}
            self._advance()

    def copy(self) -> Delivered:
        return Delivered(self.below, self._beyond)

    def _advance(self) -> None:
        while self.below in self._beyond:
            self._beyond.discard(self.below)
            self.below += 1


class PumpRunner(Runner):
    """A runner whose pump thread puts outputs into a bounded queue that ``get`` reads. The first
    error, met by the pump or by ``_check`` (run while the consumer waits), ends the run: the queue
    closes and ``get`` raises it. An error after ``close`` is not reported."""

    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool) -> None:
        super().__init__(pipeline, buffer_size=buffer_size, max_failures=max_failures, metered=metered)
        capacity = buffer_size if buffer_size is not None else default_buffer_size(pipeline)
        self._output = BoundedQueue(f"{self.pool_stage or self.name}→output", capacity)
        self._delivered = Delivered()
        self._lock = threading.Lock()
        self._error: SpdlLabError | None = None
        self._stopping = False
        self._closed = False
        self._pump: threading.Thread | None = None

    @abstractmethod
    def _pump_all(self) -> bool:
        """Put the outputs into ``self._output``: True at the end of the data, False on a stop."""

    @abstractmethod
    def _pump_error(self, exc: BaseException) -> SpdlLabError:
        """A foreign exception from the pump as the run's error."""

    def _check(self) -> None:
        """While the consumer waits: ``_fail`` the run if what it runs on has died."""

    def start(self) -> None:
        if self._pump is not None:
            raise RunnerError(f"{self.name} runner: start() was already called; make a new runner")
        self._pump = threading.Thread(target=self._run_pump, name=f"spdl_lab:{self.name}-pump", daemon=True)
        self._pump.start()

    def _run_pump(self) -> None:
        try:
            if self._pump_all():
                self._output.finish()
        except QueueClosed:
            pass
        except SpdlLabError as exc:
            self._fail(exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the consumer, with its cause
            self._fail(self._pump_error(exc))

    def _fail(self, error: SpdlLabError) -> None:
        drop_tracebacks(error)  # frames of torch's or Ray Data's iterators hold workers and threads
        with self._lock:
            if self._error is None and not self._closed:
                self._error = error
        self._stopping = True
        self._output.close()

    def get(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                record = self._output.get(max(0.0, min(left, _CHECK_S)))
            except QueueClosed:
                if self._error is not None:
                    raise self._error from self._error.__cause__
                return END
            if record is not TIMEOUT:
                return record
            self._check()
            if left <= _CHECK_S and self._error is None:  # a failure _check found is raised now
                return TIMEOUT

    def _stop(self) -> bool:
        """Tell the pump to stop and close the queue; True on the first call."""
        with self._lock:
            first, self._closed, self._stopping = not self._closed, True, True
        self._output.close()
        return first

    def _join_pump(self, timeout: float) -> bool:
        """True if the pump has ended within ``timeout``."""
        pump = self._pump
        if pump is None or pump is threading.current_thread():
            return True
        pump.join(timeout)
        return not pump.is_alive()
