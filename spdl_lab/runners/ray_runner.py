"""``ray``: the Pipeline on Ray Data, on a local Ray instance or a real cluster.

The Dataset is built by ``_ray_plan`` (runs of map stages with one setting make a Ray Data
operation, the source and ``batch`` inside them); a pump thread iterates its rows into a
bounded queue here, in order when the pipeline asks for order. Meters run inside the Ray
workers and add up in an actor (``_ray_meters``). ``set_concurrency`` cannot resize a
running Ray Data operation, so it restarts the execution from the first item not yet
delivered, as the process runner restarts its workers: items in flight are made again,
never delivered twice.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from ..engine.engine import EngineReading, default_buffer_size
from ..engine.queues import END, TIMEOUT, BoundedQueue, QueueClosed
from ..errors import PipelineSpecError, RunnerError, SpdlLabError, drop_tracebacks, stage_failure
from ..pipeline import Pipeline, validate_concurrency
from ..telemetry.meters import QueueReading
from ._delivered import Delivered
from ._ray_cluster import RayConnection
from ._ray_meters import FLUSH_S, board_class, reading_of
from ._ray_plan import build, chunk_size, find_failure, groups, rows_of, window_items
from ._ray_source import indexable
from .base import Runner

__all__ = ["RayRunner"]

_POLL_S = 0.1
#: How stale the meters may be: a sampler tick reads the board at most this often.
_READ_EVERY_S = 0.2
#: While no batch comes, whether the local instance is alive is checked this often.
_ALIVE_EVERY_S = 0.5
#: How long the final reading of the meters (at the end of the data, at close) may wait.
_FINAL_READ_S = 2.0
#: How long the end of the data may wait for complete counts (the meter actor can take seconds to
#: start on a loaded machine; complete counts end the wait at once).
_SETTLE_S = 10.0
#: Where a stage's failure happened, as its error says.
_IN_RAY = "in a Ray worker"


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
        self._source: Any = None  # (an indexable source and its length: when the run starts)
        self._count = 0
        self._concurrency = {s.name: s.concurrency for s in pipeline.stages if s.kind == "map"}
        self._kinds = {s.name: s.kind for s in pipeline.stages}
        self._ordered = all(s.ordered for s in pipeline.stages if s.kind == "map")
        capacity = buffer_size if buffer_size is not None else default_buffer_size(pipeline)
        self._output = BoundedQueue("ray→output", capacity)
        self._key = uuid.uuid4().hex
        self._board: Any = None
        self._totals: dict[str, Any] = {}
        self._read_at = 0.0
        self._asked: Any = None  # a board reading asked for and not yet taken
        self._read_lock = threading.Lock()
        self._delivered = Delivered()
        self._seq = 0
        self._generation = 0
        self._error: SpdlLabError | None = None
        self._stopping = False
        self._lock = threading.Lock()
        self._pump: threading.Thread | None = None
        self._executor: Any = None  # the running Ray Data execution (its StreamingExecutor)
        self._groups: list[Any] = []  # its operations' stages (``_ray_plan.groups``)
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
            self._board = board_class().remote(["source", *self._concurrency])
        except BaseException:
            self._connection.close()
            raise
        self._pump = threading.Thread(target=self._run_pump, name="spdl_lab:ray-pump", daemon=True)
        self._pump.start()

    def _run_pump(self) -> None:
        try:
            self._open_source()
            while not self._stopping:
                if self._run_window():
                    self._check_failures(final=True)
                    self._output.finish()
                    return
        except QueueClosed:
            pass
        except SpdlLabError as exc:
            self._fail(exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the consumer, with its cause
            # Its traceback runs through Ray Data's iterator frames, which hold a prefetch thread:
            # kept with the error, the thread would outlive the run.
            drop_tracebacks(exc)
            failure = find_failure(exc)
            if failure is not None:
                error: SpdlLabError = stage_failure(failure.stage, failure.index, failure.error or exc,
                                                    what=failure.what, where=_IN_RAY)
            else:
                error = RunnerError(f"ray runner: the Ray Data execution failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
            self._fail(error)

    def _open_source(self) -> None:
        """The source as an indexable sequence in the object store (a ``range`` travels as it is)."""
        source, self._count = indexable(self.pipeline, lambda: self._stopping)
        if not isinstance(source, range):
            import ray

            source = ray.put(source)  # once into the object store, not once per task
        self._source = source

    def _run_window(self) -> bool:
        """Run one execution over the next window of items: True once the data has ended.

        Returns early (False) on a stop or a new concurrency; the next window then starts at
        the first item not yet delivered.
        """
        with self._lock:
            generation = self._generation
            concurrency = dict(self._concurrency)
        chunk = chunk_size(self.pipeline)
        start = self._delivered.below // chunk * chunk  # a batch boundary
        if start >= self._count:
            return True
        end = min(self._count, start + window_items(self.pipeline))
        ds = build(self.pipeline, self._source, start=start, count=end - start, total=self._count,
                   concurrency=concurrency, key=self._key, board=self._board, strict=self.max_failures == 0,
                   resources=self._resources, ordered=self._ordered)
        # Ray Data's own bundles, each block fetched here: its row and batch iterators start a
        # prefetch thread that is stopped only when they run to the end (not on an error or a
        # stop). The executor is made here so that close() can stop it: a task that never
        # returns would otherwise keep this thread in Ray Data's wait for its output.
        executor = ds._create_executor()
        with self._lock:
            if self._stopping:
                return False
            self._executor = executor
            self._groups = groups(self.pipeline, concurrency, self._resources)
        bundles = ds._build_bundle_iterator(executor)
        try:
            batches = self._kinds[self.pipeline.stages[-1].name] == "batch"
            for bundle in bundles:
                for ref in bundle.block_refs:
                    for row in rows_of(_columns(self._get_block(ref)), batches):
                        if self._stopping or self._generation != generation:
                            return False
                        self._deliver(row, chunk)
                    self._check_failures(final=False)  # once a block: the counts move a flush at a time
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
        import ray
        from ray.exceptions import GetTimeoutError

        while True:
            try:
                return ray.get(ref, timeout=_POLL_S)
            except GetTimeoutError:
                if self._stopping:
                    raise QueueClosed("closed while a block was fetched") from None

    def _deliver(self, row: tuple[Any, Any], chunk: int) -> None:
        """Hand one row (plain Python: ``rows_of``) to the consumer, unless it was handed before."""
        idx, value = row
        indices = idx if isinstance(idx, list) else [idx]
        if self._delivered.seen(indices):
            return  # made again after a restart; it was delivered before
        if self._ordered:
            # In order, every item before this row's batch was delivered or dropped: a restart
            # must not make a dropped one again (and count its failure twice).
            self._delivered.cover(indices[0] // chunk * chunk)
        self._output.put(self._seq, value)
        self._seq += 1
        self._delivered.add(indices)

    def _check_failures(self, final: bool) -> None:
        """More failures than ``max_failures`` end the run, naming the one too many.

        The counts come from the workers' meters; at the end of the data the last flush is
        waited for, so a run never ends quietly with one failure too many.
        """
        if final:
            self._settle()
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
        """At the end of the data, wait for the workers' last counts (up to ``_SETTLE_S``).

        Each worker sends what it counted every FLUSH_S, and a message from a worker that
        just started can take longer: the counts are final once nothing is in flight and two
        readings a flush apart agree. Then stats() after a loop counts every task, and a
        failure one too many is not missed.
        """
        deadline = time.monotonic() + _SETTLE_S
        previous = None
        while True:
            time.sleep(FLUSH_S)
            totals = self._read_totals(force=True)
            now = {name: (t["started"], t["tasks"], t["failures"]) for name, t in totals.items()}
            idle = all(started == done for started, done, _ in now.values())
            if (idle and now == previous and self._complete(now)) or time.monotonic() > deadline:
                return
            previous = now

    def _complete(self, counts: dict[str, tuple[int, int, int]]) -> bool:
        """Every item read reached every stage: each stage ran at least what the one before made."""
        made = self._count  # the source's items
        for name in ["source", *(s.name for s in self.pipeline.stages)]:
            _, done, failed = counts.get(name, (0, 0, 0))
            batch = self._kinds.get(name) == "batch"  # counts batches made, not items taken
            if done < (min(made, 1) if batch else made):
                return False
            made = done - failed
        return True

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
        """The board's totals: a reading asked for earlier if it has come, else the last ones.

        Never waits unless ``force`` (the final figures): the board actor takes a second or
        more to start, and a reading must not hold up the sampler or the start of a run.
        """
        import ray

        with self._read_lock:
            board = self._board
            if board is None:
                return self._totals
            now = time.monotonic()
            if force or (self._asked is None and now - self._read_at >= _READ_EVERY_S):
                self._asked, self._read_at = board.read.remote(), now
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
        source = reading_of(totals.get("source"), "source", "source", 1)
        stages = [reading_of(totals.get(s.name), s.name, s.kind, self._concurrency.get(s.name, 1))
                  for s in self.pipeline.stages]
        return EngineReading(source=source, stages=stages, inputs={},
                             queues=[*self._operation_queues(), self._output.read()])

    def _operation_queues(self) -> list[QueueReading]:
        """Blocks each Ray Data operation has made and the next one (or this process) has not taken.

        Named ``<its last stage>→<the next operation's first stage>``; counted in blocks (whole
        batches: a few per block). Ray Data bounds them by object-store memory, not by a count,
        so their capacity reads 0.
        """
        with self._lock:
            executor, groups = self._executor, self._groups
        topology = getattr(executor, "_topology", None) if executor is not None else None
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
            out.append(QueueReading(f"{name}→{after}", max(0, depth), 0, 0, 0, 0, 0))
        return out

    # -- closing -----------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stopping = True
            executor = self._executor
        self._output.close()
        if executor is not None:
            _stop(executor)
        pump = self._pump
        if pump is not None and pump is not threading.current_thread():
            pump.join(timeout)
        if self._board is not None:
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


def _stop(executor: Any) -> None:
    """Shut a Ray Data execution down, cancelling its tasks, and wake its consumer."""
    try:
        executor.shutdown(force=True)
    finally:
        output = executor._output_node
        if output is not None:
            output[1].mark_finished()  # its consumer's wait for output ends (StopIteration)


def _columns(block: Any) -> Any:
    """A block fetched from Ray, as Ray Data's numpy columns (``idx``, ``item``)."""
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(block).to_batch_format("numpy")
