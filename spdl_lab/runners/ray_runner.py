"""``ray``: the Pipeline on Ray Data, on a local Ray instance or a real cluster.

The Dataset is built by ``_ray_plan`` (runs of map stages with one setting a Ray Data
operation at that concurrency, the source and ``batch`` inside them); a pump thread iterates its rows on the training side into a
bounded queue, in order when the pipeline asks for order. Meters run inside the
Ray workers and add up in an actor (``_ray_meters``). ``set_concurrency``
cannot resize a running Ray Data operation (its pools are fixed when the
execution plan starts), so it restarts the execution from the first item not
yet delivered, as the process runner restarts its workers; items in flight are
made again and never delivered twice.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..engine.engine import EngineReading, default_buffer_size
from ..engine.queues import END, TIMEOUT, BoundedQueue, QueueClosed
from ..errors import PipelineError, PipelineSpecError, RunnerError, SpdlLabError
from ..pipeline import Pipeline, validate_concurrency
from ._ray_cluster import RayConnection
from ._ray_meters import FLUSH_S, board_class, flush, reading_of
from ._ray_plan import StageFailure, build, chunk_size, plain, plain_scalar
from .base import Runner

__all__ = ["RayRunner", "MAX_MATERIALIZED"]

#: A source without random access is read into a list in the driver, up to this many items.
MAX_MATERIALIZED = 1_000_000
_POLL_S = 0.1
#: How stale the meters may be: a sampler tick reads the board at most this often.
_READ_EVERY_S = 0.2
#: While no batch comes, whether the local instance is alive is checked this often.
_ALIVE_EVERY_S = 0.5


class RayRunner(Runner):
    """Runs the pipeline on Ray Data.

    Options: ``address`` (None: a local Ray instance on 127.0.0.1 with this
    machine's cores and no dashboard, shut down on close; ``"auto"`` or
    ``"ray://host:port"``: that cluster, never shut down), ``ray_init_kwargs``
    (passed to ``ray.init``), ``resources`` (per stage, Ray's task options such as
    ``{"decode": {"num_cpus": 2}}``). Example::

        with lab.Loader(p, runner="ray") as loader:            # a local Ray instance
            for batch in loader: ...
        lab.Loader(p, runner="ray", address="ray://head:10001")  # a real cluster
    """

    name = "ray"

    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool,
                 address: str | None = None, ray_init_kwargs: dict[str, Any] | None = None,
                 resources: dict[str, dict[str, float]] | None = None) -> None:
        super().__init__(pipeline, buffer_size=buffer_size, max_failures=max_failures, metered=metered)
        self._connection = RayConnection(address, ray_init_kwargs)
        self._resources = _check_resources(pipeline, resources)
        self._source, self._count = _indexable(pipeline)
        self._concurrency = {s.name: s.concurrency for s in pipeline.stages if s.kind == "map"}
        self._kinds = {s.name: s.kind for s in pipeline.stages}
        self._ordered = all(s.ordered for s in pipeline.stages if s.kind == "map")
        capacity = buffer_size if buffer_size is not None else default_buffer_size(pipeline)
        self._output = BoundedQueue("ray→output", capacity)
        self._key = uuid.uuid4().hex
        self._board: Any = None
        self._source_ref: Any = None
        self._totals: dict[str, Any] = {}
        self._read_at = 0.0
        self._delivered = _Delivered()
        self._seq = 0
        self._generation = 0
        self._error: SpdlLabError | None = None
        self._stopping = False
        self._lock = threading.Lock()
        self._pump: threading.Thread | None = None
        self._alive_at = 0.0

    @classmethod
    def check_options(cls, pipeline: Pipeline, options: dict[str, Any]) -> None:
        super().check_options(pipeline, options)
        try:
            import ray.data  # noqa: F401
        except ImportError as exc:
            raise PipelineSpecError("runner 'ray' needs Ray Data: pip install 'ray[data]==2.60.0'") from exc
        cls(pipeline, **options)

    # -- running -----------------------------------------------------------------------
    def start(self) -> None:
        if self._pump is not None:
            raise RunnerError("ray runner: start() was already called; make a new runner")
        self._connection.open()
        try:
            source = self._source
            if not isinstance(source, range):
                import ray

                source = ray.put(source)  # once into the object store, not once per task
            self._source_ref = source
            self._board = board_class().remote(["source", *self._concurrency])
        except BaseException:
            self._connection.close()
            raise
        self._pump = threading.Thread(target=self._run_pump, name="spdl_lab:ray-pump", daemon=True)
        self._pump.start()

    def _run_pump(self) -> None:
        try:
            while not self._stopping:
                if self._run_generation():
                    self._output.finish()
                    return
        except QueueClosed:
            pass
        except SpdlLabError as exc:
            self._fail(exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the consumer, with its cause
            failure = _stage_failure(exc)
            if failure is not None:
                error: SpdlLabError = PipelineError(
                    f"stage {failure.stage!r} failed on item {failure.index} (ray runner):\n{failure.text}",
                    stage=failure.stage, index=failure.index if isinstance(failure.index, int) else None)
            else:
                error = RunnerError(f"ray runner: the Ray Data execution failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._fail(error)

    def _run_generation(self) -> bool:
        """Iterate one execution until the data ends (True), or a stop or a new concurrency (False)."""
        with self._lock:
            generation = self._generation
            concurrency = dict(self._concurrency)
        chunk = chunk_size(self.pipeline)
        start = self._delivered.first_missing() // chunk * chunk  # a batch boundary
        if start >= self._count:
            return True
        ds = build(self.pipeline, self._source_ref, start=start, count=self._count - start, concurrency=concurrency, key=self._key,
                   board=self._board, strict=self.max_failures == 0, resources=self._resources,
                   ordered=self._ordered)
        rows = iter(ds.iter_rows())
        try:
            for row in rows:
                if self._stopping or self._generation != generation:
                    return False
                self._deliver(row)
                self._check_failures()
            return True
        finally:
            close = getattr(rows, "close", None)
            if close is not None:
                close()

    def _deliver(self, row: dict[str, Any]) -> None:
        idx = plain(row["idx"])
        indices = idx if isinstance(idx, list) else [idx]
        if self._delivered.seen(indices):
            return  # made again after a restart; it was delivered before
        value = row["item"]
        if self._kinds[self.pipeline.stages[-1].name] == "batch":
            value = [plain_scalar(x) for x in value]
        else:
            value = plain_scalar(value)
        self._output.put(self._seq, value)
        self._seq += 1
        self._delivered.add(indices)

    def _check_failures(self) -> None:
        if self.max_failures == 0:
            return
        totals = self._read_totals(force=False)
        failed = sum(t["failures"] for t in totals.values())
        if failed > self.max_failures:
            last = next((t["last_failure"] for t in totals.values() if t["last_failure"]), "")
            stage = next((name for name, t in totals.items() if t["failures"]), "?")
            raise PipelineError(f"ray runner: {failed} items failed, more than max_failures={self.max_failures}; "
                                f"the last: {last}", stage=stage, index=None)

    def _fail(self, error: SpdlLabError) -> None:
        if self._error is None:
            self._error = error
        self._output.close()

    def get(self, timeout: float) -> Any:
        try:
            record = self._output.get(timeout)
        except QueueClosed:
            if self._error is not None:
                raise self._error from self._error.__cause__
            return END
        if record is TIMEOUT:
            self._check_alive()
            return TIMEOUT
        return record

    def _check_alive(self) -> None:
        """A batch is late: is the instance still there? (Its GCS or raylet dying leaves Ray waiting.)"""
        now = time.monotonic()
        if now - self._alive_at < _ALIVE_EVERY_S:
            return
        self._alive_at = now
        lost = self._connection.lost()
        if lost is None and self._pump is not None and not self._pump.is_alive() and self._error is None:
            lost = "its pump thread ended without a result"
        if lost is not None:
            error = RunnerError(f"ray runner: {lost}; the run cannot go on (killed, or out of memory: "
                                f"see dmesg). Start a new Loader")
            self._fail(error)
            raise error

    # -- concurrency -------------------------------------------------------------------
    def set_concurrency(self, stage: str, n: int) -> None:
        if self._kinds.get(stage) != "map":
            raise PipelineSpecError(f"ray runner: {stage!r} is not a map stage; map stages: "
                                    f"{', '.join(self._concurrency)}")
        validate_concurrency(n, stage=stage)
        with self._lock:
            if self._concurrency[stage] == n:
                return
            self._concurrency[stage] = n
            self._generation += 1  # the pump restarts the execution from the first item not delivered

    def concurrency(self, stage: str) -> int:
        return self._concurrency[stage]

    # -- reading -----------------------------------------------------------------------
    def _read_totals(self, force: bool) -> dict[str, Any]:
        now = time.monotonic()
        if self._board is not None and (force or now - self._read_at >= _READ_EVERY_S):
            import ray

            try:
                self._totals = ray.get(self._board.read.remote(), timeout=1.0)
                self._read_at = now
            except Exception:  # noqa: BLE001 - a slow or gone board: keep the last totals
                pass
        return self._totals

    def read(self) -> EngineReading:
        totals = self._read_totals(force=False)
        source = reading_of(totals.get("source"), "source", "source", 1)
        stages = [reading_of(totals.get(s.name), s.name, s.kind, self._concurrency.get(s.name, 1))
                  for s in self.pipeline.stages]
        return EngineReading(source=source, stages=stages, inputs={}, queues=[self._output.read()])

    # -- closing -----------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._output.close()
        pump = self._pump
        if pump is not None and pump is not threading.current_thread():
            pump.join(timeout)
        if self._board is not None:
            flush()
            time.sleep(2 * FLUSH_S)  # the workers' last counts are at most one flush away
            self._read_totals(force=True)  # the final figures, kept for stats() after close
            import ray

            try:
                ray.kill(self._board)
            except Exception:  # noqa: BLE001 - the instance may be gone already
                pass
            self._board = None
        if self._connection.role != "none":
            self._connection.close(timeout)


class _Delivered:
    """Source indices delivered: a contiguous prefix plus those beyond it (for restarts)."""

    def __init__(self) -> None:
        self._prefix = 0
        self._beyond: set[int] = set()

    def seen(self, indices: Sequence[int]) -> bool:
        return bool(indices) and all(i < self._prefix or i in self._beyond for i in indices)

    def add(self, indices: Sequence[int]) -> None:
        self._beyond.update(indices)
        while self._prefix in self._beyond:
            self._beyond.discard(self._prefix)
            self._prefix += 1

    def first_missing(self) -> int:
        return self._prefix


def _indexable(pipeline: Pipeline) -> tuple[Any, int]:
    """The source as something indexable with its length; a finite iterable is read into a list."""
    source = pipeline.source
    if pipeline.source_is_factory:
        source = source()
    if isinstance(source, range) or (hasattr(source, "__getitem__") and hasattr(source, "__len__")
                                     and isinstance(source, Sequence)):
        return source, len(source)
    if not hasattr(source, "__len__"):
        raise PipelineSpecError(
            "ray runner: the source has no len(); Ray Data splits a known number of items over its workers. "
            "Pass a sequence (a list of paths, a range) or a finite iterable with __len__")
    n = len(source)
    if n > MAX_MATERIALIZED:
        raise PipelineSpecError(f"ray runner: the source has {n} items without random access; up to "
                                f"{MAX_MATERIALIZED} are read into a list. Pass a sequence (indexable) instead")
    return list(source), n


def _check_resources(pipeline: Pipeline, resources: Any) -> dict[str, dict[str, float]]:
    if resources is None:
        return {}
    if not isinstance(resources, dict):
        raise PipelineSpecError(f"ray runner: resources must map stage names to Ray task options, "
                                f"got {type(resources).__name__}")
    maps = {s.name for s in pipeline.stages if s.kind == "map"}
    for name, value in resources.items():
        if name not in maps or not isinstance(value, dict):
            raise PipelineSpecError(f"ray runner: resources[{name!r}] must name a map stage ({sorted(maps)}) "
                                    f"and hold a dict such as {{'num_cpus': 2}}")
    return resources


def _stage_failure(exc: BaseException | None) -> StageFailure | None:
    """Our StageFailure inside whatever Ray wrapped it in (RayTaskError, UserCodeException, ...).

    Ray keeps the chain as text only, at times: then the StageFailure line of it is read back.
    """
    found = _in_chain(exc)
    if found is not None or exc is None:
        return found
    text = str(exc)
    match = _FAILURE_LINE.search(text)
    if match is None:
        return None
    stage, index = match.group(1), match.group(2)
    return StageFailure(stage, int(index) if index.isdigit() else index, text)


_FAILURE_LINE = re.compile(r"StageFailure: stage '([^']*)' failed on item (\S+?): ")


def _in_chain(exc: BaseException | None) -> StageFailure | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, StageFailure):
            return exc
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            found = _in_chain(cause)
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None
