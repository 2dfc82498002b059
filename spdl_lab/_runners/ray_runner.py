"""``ray``: the Pipeline on Ray Data (``_ray_plan``), on a local Ray instance or a real cluster; a
pump thread iterates the Dataset's rows into a bounded queue, meters add up in an actor."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from .._engine.engine import EngineReading
from .._engine.queues import QueueClosed
from .._pipeline import Pipeline
from .._telemetry.meters import QueueReading
from ..errors import PipelineSpecError, RunnerError, SpdlLabError, describe, stage_failure
from ._ray_cluster import RayConnection
from .base import PumpRunner

try:
    import ray
    from ray.data.block import BlockAccessor
    from ray.exceptions import GetTimeoutError

    from . import _ray_meters as meters
    from . import _ray_plan as plan
except ImportError:  # without Ray Data, making a RayRunner says what to install
    ray = None

_POLL_S = 0.1
#: How stale the meters may be: a sampler tick reads the board at most this often.
_READ_EVERY_S = 0.2
#: While no batch comes, whether the local instance is alive is checked this often.
_ALIVE_EVERY_S = 0.5
#: How long the final reading of the meters (at the end of the data, at close) may wait.
_FINAL_READ_S = 2.0
#: How long the end of the data may wait for complete counts (the meter actor may start slowly).
_SETTLE_S = 10.0
_SETTLE_POLL_S = 0.02
_IN_RAY = "in a Ray worker"
#: A source without random access is read into a list in the driver, up to this many items.
MAX_MATERIALIZED = 1_000_000


class RayRunner(PumpRunner):
    """Runs the pipeline on Ray Data: ``address`` None starts a local instance, ``"auto"`` or
    ``"ray://host:port"`` joins a cluster; ``resources`` holds Ray task options per stage. Example::

        with lab.Loader(p, runner="ray") as loader:            # a local Ray instance
            for batch in loader: ...
        lab.Loader(p, runner="ray", address="ray://head:10001")  # a real cluster
    """

    name = "ray"
    late_start_s = 1.0

    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool,
                 address: str | None = None, ray_init_kwargs: dict[str, Any] | None = None,
                 resources: dict[str, dict[str, float]] | None = None) -> None:
        super().__init__(pipeline, buffer_size=buffer_size, max_failures=max_failures, metered=metered)
        if ray is None:
            raise PipelineSpecError("runner 'ray' needs Ray Data: pip install 'ray[data]==2.60.0'")
        self._connection = RayConnection(address, ray_init_kwargs)
        self._parked = False
        self._resources = _check_resources(pipeline, resources)
        self._source: Any = None  # an indexable source, made when the run starts
        self._count = 0
        self._concurrency = {s.name: s.concurrency for s in pipeline.stages if s.kind == "map"}
        self._ordered = all(s.ordered for s in pipeline.stages if s.kind == "map")
        self._key = uuid.uuid4().hex
        self._board: Any = None
        self._settled = False  # the counts are final (the end of the data)
        self._totals: dict[str, Any] = {}
        self._read_at = 0.0
        self._asked: Any = None  # a board reading asked for and not yet taken
        self._read_lock = threading.Lock()
        self._generation = 0
        self._executor: Any = None  # the running Ray Data execution (its StreamingExecutor)
        self._groups: list[Any] = []  # its operations' stages (``_ray_plan.groups``)
        self._alive_at = 0.0

    def start(self) -> None:
        if self._pump is None:
            self._connection.open()
            try:
                self._board = meters.board(shared=self._connection.role != "user")
            except BaseException:
                self._connection.close()
                raise
        super().start()

    def _pump_all(self) -> bool:
        self._open_source()
        while not self._stopping:
            if self._run_window():
                self._settle()
                self._check_failures()
                return True
        return False

    def _pump_error(self, exc: BaseException) -> SpdlLabError:
        failure = plan.find_failure(exc)
        if failure is not None:
            return stage_failure(failure.stage, failure.index, failure.error or exc, what=failure.what,
                                 where=_IN_RAY)
        error = RunnerError(f"ray runner: the Ray Data execution failed: {describe(exc)}")
        error.__cause__ = exc
        return error

    def _open_source(self) -> None:
        """A ``range``, or a sequence (Ray Data splits a known number) put in the object store."""
        source = self.pipeline.source() if self.pipeline.source_is_factory else self.pipeline.source
        if not isinstance(source, (range, Sequence)):
            source = self._read_source(iter(source))
        self._count = len(source)
        if not isinstance(source, range):
            source = ray.put(source)  # once into the object store, not once per task
        self._source = source

    def _read_source(self, iterator: Any) -> list[Any]:
        items: list[Any] = []
        try:
            for item in iterator:
                items.append(item)
                if self._stopping or len(items) > MAX_MATERIALIZED:
                    break
        except Exception as exc:  # noqa: BLE001 - the user's source: the run's error, naming the item
            raise stage_failure("source", len(items), exc, where="read here, before Ray starts") from exc
        if self._stopping:
            raise QueueClosed("closed while the source was read")
        if len(items) > MAX_MATERIALIZED:
            raise PipelineSpecError(
                f"ray runner: the source yields more than {MAX_MATERIALIZED} items without random access "
                f"(each is read into a list here before Ray Data splits them). Pass a sequence: "
                f"a list of paths, a range, or a dataset with __getitem__ and __len__")
        return items

    def _run_window(self) -> bool:
        """One execution over the next window: True at the end of the data, False on a restart."""
        with self._lock:
            generation = self._generation
            concurrency = dict(self._concurrency)
        chunk = plan.chunk_size(self.pipeline)
        start = self._delivered.below // chunk * chunk  # a batch boundary
        if start >= self._count:
            return True
        end = min(self._count, start + plan.WINDOW_CHUNKS * chunk)
        ds = plan.build(self.pipeline, self._source, start=start, count=end - start,
                        total=self._count, concurrency=concurrency, key=self._key, board=self._board,
                        strict=self.max_failures == 0, resources=self._resources, ordered=self._ordered)
        # Bundles, not Ray Data's row iterators: their prefetch thread outlives an error or a
        # stop. The executor is made here so that close() can stop a task that never returns.
        executor = ds._create_executor()
        with self._lock:
            if self._stopping:
                return False
            self._executor = executor
            self._groups = plan.groups(self.pipeline, concurrency, self._resources)
        bundles = ds._build_bundle_iterator(executor)
        try:
            batches = self.pipeline.stages[-1].kind == "batch"
            for bundle in bundles:
                for ref in bundle.block_refs:
                    for row in plan.rows_of(self._get_block(ref), batches):
                        if self._stopping or self._generation != generation:
                            return False
                        self._deliver(row, chunk)
                    self._check_failures()  # once a block: the counts move a flush at a time
            if self._stopping:
                return False
            self._delivered.cover(end)  # all of the window was delivered or dropped
            return end >= self._count
        finally:
            with self._lock:
                self._executor = None
            executor.shutdown(force=True)  # at once if it ran to the end; else cancels its tasks
            del bundles

    def _get_block(self, ref: Any) -> Any:
        """A block fetched from Ray, as Ray Data's numpy columns (``idx``, ``item``)."""
        while True:
            try:
                return BlockAccessor.for_block(ray.get(ref, timeout=_POLL_S)).to_batch_format("numpy")
            except GetTimeoutError:
                if self._stopping:
                    raise QueueClosed("closed while a block was fetched") from None

    def _deliver(self, row: tuple[Any, Any], chunk: int) -> None:
        idx, value = row
        indices = idx if isinstance(idx, list) else [idx]
        if indices and all(i in self._delivered for i in indices):
            return  # made again after a restart; it was delivered before
        if self._ordered:
            # Every item before this batch is done with: a restart must not count a failure twice.
            self._delivered.cover(indices[0] // chunk * chunk)
        self._output.put(self._output.puts, value)  # the pump alone puts: the output's number
        self._delivered.add(indices)

    def _check_failures(self) -> None:
        """More failures than ``max_failures`` (counted by the workers' meters) end the run."""
        if self.max_failures == 0:
            return
        totals = self._read_totals(force=False)
        failed = sum(t["failures"] for t in totals.values())
        if failed > self.max_failures:
            # The one too many in item order (tasks finish out of order), as the other runners name it.
            seen = sorted((f for t in totals.values() for f in t["failed"]), key=lambda f: (f[1], f[3]))
            stage, index, what, _ = seen[min(self.max_failures, len(seen) - 1)]
            raise stage_failure(stage, index, None, what=what, where=_IN_RAY, dropped=failed - 1,
                                max_failures=self.max_failures)

    def _settle(self) -> None:
        """Wait until the counts are final: a task sends them before its block, so briefly."""
        deadline = time.monotonic() + _SETTLE_S
        while time.monotonic() <= deadline and not self._complete(self._read_totals(force=True)):
            time.sleep(_SETTLE_POLL_S)
        self._settled = True

    def _complete(self, totals: dict[str, Any]) -> bool:
        """Nothing in flight, and each stage ran at least what the one before it made."""
        if any(t["started"] != t["tasks"] for t in totals.values()):
            return False
        made = self._count  # the source's items
        for name, kind in [("source", "source"), *((s.name, s.kind) for s in self.pipeline.stages)]:
            t = totals.get(name, {"tasks": 0, "failures": 0})
            if t["tasks"] < (min(made, 1) if kind == "batch" else made):  # batches made, not items
                return False
            made = t["tasks"] - t["failures"]
        return True

    def _check(self) -> None:
        """A batch is late: has the instance died? (Ray would wait for ever.)"""
        now = time.monotonic()
        if now - self._alive_at < _ALIVE_EVERY_S:
            return
        self._alive_at = now
        lost = self._connection.lost()
        pump = self._pump
        # A pump that ended well finished the queue first: a get that timed out just before is no loss.
        if lost is None and pump is not None and not pump.is_alive() and not self._output.finished \
                and self._error is None:
            lost = "its pump thread ended without a result"
        if lost is not None:
            self._fail(RunnerError(f"ray runner: {lost}; the run cannot go on (killed, or out of memory: "
                                   f"see dmesg). Start a new Loader"))

    def set_concurrency(self, stage: str, n: int) -> None:
        with self._lock:  # the Loader has checked both
            if self._concurrency[stage] != n:
                self._concurrency[stage] = n
                self._generation += 1  # the pump restarts from the first item not delivered

    def concurrency(self, stage: str) -> int:
        return self._concurrency[stage]

    def _read_totals(self, force: bool) -> dict[str, Any]:
        """The board's totals: a reading asked for earlier if it has come, else the last ones.
        Waits only if ``force``: the actor may take seconds to start, and the sampler must not."""
        with self._read_lock:
            if self._board is None:
                return self._totals
            now = time.monotonic()
            if force or (self._asked is None and now - self._read_at >= _READ_EVERY_S):
                self._asked, self._read_at = self._board.read.remote(self._key), now
            if self._asked is None:  # none asked for, none due
                return self._totals
            try:
                ready, _ = ray.wait([self._asked], timeout=_FINAL_READ_S if force else 0)
                if ready:
                    self._asked = None
                    self._totals = ray.get(ready[0])
            except Exception:  # noqa: BLE001 - a gone board: keep the last totals
                self._asked = None
            return self._totals

    def read(self) -> EngineReading:
        totals = self._read_totals(force=False)
        source = meters.reading_of(totals.get("source"), "source", "source", 1)
        stages = [meters.reading_of(totals.get(s.name), s.name, s.kind,
                                  self._concurrency.get(s.name, 1)) for s in self.pipeline.stages]
        return EngineReading(source=source, stages=stages, inputs={},
                             queues=[*self._operation_queues(), self._output.read()])

    def _operation_queues(self) -> list[QueueReading]:
        """Per operation, the blocks the next one has not taken (capacity 0: memory bounds them)."""
        with self._lock:
            executor, groups = self._executor, self._groups
        topology = getattr(executor, "_topology", None)
        if not topology or not groups:
            return []
        states = [state for op, state in list(topology.items()) if op.input_dependencies]  # not the input
        names = [g.stages[-1].name for g in groups]
        nexts = [g.stages[0].name for g in groups[1:]] + ["pump"]
        out = []
        for state, name, after in zip(states, names, nexts):
            try:
                depth = int(state.output_queue.num_blocks)
            except Exception:  # noqa: BLE001 - Ray Data's internals moved: no reading rather than a wrong one
                continue
            out.append(QueueReading(f"{name}→{after}", max(0, depth), 0))
        return out

    def park(self, parked: bool) -> None:
        self._parked = parked
        self._connection.park(parked)

    def get(self, timeout: float) -> Any:
        if self._parked:  # asked for a batch: the instance must run
            self.park(False)
        return super().get(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._connection.park(False)
        self._stop()
        with self._lock:  # after _stop: the pump sets an executor only while not stopping
            executor = self._executor
        if executor is not None:
            try:
                executor.shutdown(force=True)  # cancels its tasks
            finally:  # the pump's wait for output ends (StopIteration)
                if executor._output_node is not None:
                    executor._output_node[1].mark_finished()
        self._join_pump(timeout)
        if self._board is not None:
            if not self._settled:
                time.sleep(2 * meters.FLUSH_S)  # the workers' last counts are at most one flush away
                self._read_totals(force=True)  # the final figures, kept for stats() after close
            with contextlib.suppress(Exception):  # the instance may be gone already
                if self._connection.role == "user":  # the user's own instance: nothing of ours stays
                    ray.kill(self._board)
                else:
                    self._board.drop.remote(self._key)
            self._board = None
        self._connection.close(timeout)  # nothing to undo unless opened


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
