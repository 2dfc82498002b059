"""A lab Pipeline as a Ray Dataset: each map stage one Ray Data operation, ``batch`` Ray's batching.

Rows are ``{"idx": source index (a list of them after a batch), "item": value}``.
Ray Data is used as it is (``map`` / ``flat_map`` / ``map_batches``, its
streaming executor, its object store); the lab adds only a wrapper around each
user function that times it into the meters and turns its exception into a
``StageFailure`` naming the stage and item.

Tasks or actors: a plain function (``def``, lambda, ``functools.partial``) runs
as Ray tasks, stateless and scheduled anywhere, at most ``concurrency`` at once
(``TaskPoolStrategy``). A callable object (a class instance holding state: a
tokenizer, a decoder with buffers) runs in a pool of ``concurrency`` actors
(``ActorPoolStrategy``), so its state is unpickled once per actor rather than
once per task.

Failures: with ``max_failures=0`` the first exception fails the run, and Ray
never retries it (application errors are not retried; ``retry_exceptions`` is
off, as Ray Data leaves it), so a deterministic error cannot hide behind retries. Above 0, a failing
item is dropped and counted, and the runner ends the run once more than
``max_failures`` were counted. A task whose worker dies is retried by Ray, as
Ray does for system failures.
"""

from __future__ import annotations

import logging
import time
import traceback
import types
from functools import partial
from typing import Any

import cloudpickle
import numpy as np

from ..pipeline import Pipeline, Stage
from ._ray_meters import record

__all__ = ["StageFailure", "build", "first_batch_size", "uses_actors"]

class StageFailure(Exception):
    """A stage raised inside a Ray worker: which stage, which item, and the traceback as text."""

    def __init__(self, stage: str, index: Any, text: str) -> None:
        super().__init__(stage, index, text)
        self.stage, self.index, self.text = stage, index, text

    def __str__(self) -> str:
        return f"stage {self.stage!r} failed on item {self.index}: {self.text.strip().splitlines()[-1]}"


def uses_actors(stage: Stage) -> bool:
    """A callable object (state worth keeping per worker) runs in actors; a function in tasks."""
    fn = stage.fn.func if isinstance(stage.fn, partial) else stage.fn
    return not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type))


class _Timed:
    """Runs one stage's function on a row, timed into the meters; failures become rows of none."""

    def __init__(self, name: str, payload: bytes, key: str, board: Any, strict: bool, batched: bool) -> None:
        self.name, self.key, self.board, self.strict, self.batched = name, key, board, strict, batched
        self.fn = cloudpickle.loads(payload)

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        item = row["item"]
        if self.batched and isinstance(item, np.ndarray):
            item = list(item)  # a batch arrives as one column; the user's function takes a list
        record(self.key, self.board, self.name, "started")
        t0 = time.perf_counter_ns()
        try:
            out = self.fn(item)
        except Exception as exc:  # noqa: BLE001 - the user's function: counted, then raised or dropped
            index = _plain(row["idx"])
            text = "".join(traceback.format_exception(exc))
            record(self.key, self.board, self.name, "failed", time.perf_counter_ns() - t0,
                   f"stage {self.name!r}, item {index}: {type(exc).__name__}: {exc}")
            if self.strict:
                raise StageFailure(self.name, index, text) from None
            return []
        record(self.key, self.board, self.name, "done", time.perf_counter_ns() - t0)
        return [{"idx": row["idx"], "item": out}]


class _ActorTimed(_Timed):
    """The same, as an actor class: Ray makes one per actor with these constructor arguments."""


class _Source:
    """Chunk number -> its ``{"idx", "item"}`` rows: the source read inside the workers.

    One input row per batch's worth of items keeps a batch's items in one block, so
    Ray's batching (which cuts at block ends) makes the same batches as the other runners.
    """

    def __init__(self, source: Any, start: int, end: int, chunk: int, key: str, board: Any) -> None:
        self.source, self.start, self.end, self.chunk = source, start, end, chunk
        self.key, self.board = key, board

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        first = self.start + int(row["id"]) * self.chunk
        items = _items(self.source)
        out = []
        for index in range(first, min(first + self.chunk, self.end)):
            record(self.key, self.board, "source", "started")
            t0 = time.perf_counter_ns()
            item = items[index]
            record(self.key, self.board, "source", "done", time.perf_counter_ns() - t0)
            out.append({"idx": index, "item": item})
        return out


_RESOLVED: dict[Any, Any] = {}


def _items(source: Any) -> Any:
    """A ``range`` as it is; a list put in the object store, fetched once per worker process."""
    if isinstance(source, range):
        return source
    if source not in _RESOLVED:
        import ray

        _RESOLVED.clear()  # one run's source at a time per worker
        _RESOLVED[source] = ray.get(source)
    return _RESOLVED[source]


class _Batch:
    """``batch_size`` rows -> one row holding the batch (a stacked column stays an ndarray)."""

    def __init__(self, size: int, drop_last: bool) -> None:
        self.size, self.drop_last = size, drop_last

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        idx, items = batch["idx"], batch["item"]
        if len(idx) == 0 or (self.drop_last and len(idx) < self.size):
            return {"idx": np.empty(0, dtype=object), "item": np.empty(0, dtype=object)}
        out_idx = np.empty(1, dtype=object)
        out_idx[0] = [_plain(i) for i in idx]
        if isinstance(items, np.ndarray) and items.dtype != object:
            return {"idx": out_idx, "item": items[np.newaxis]}  # one row: the whole [B, ...] array
        out = np.empty(1, dtype=object)
        out[0] = list(items)
        return {"idx": out_idx, "item": out}


def build(pipeline: Pipeline, source: Any, *, start: int, count: int, concurrency: dict[str, int], key: str,
          board: Any, strict: bool, resources: dict[str, dict[str, float]], ordered: bool) -> Any:
    """The Dataset running items ``start .. start + count`` of ``source`` (a range or an object ref)."""
    import ray.data
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    chunk = first_batch_size(pipeline)
    ds = ray.data.range(-(-count // chunk)).flat_map(_Source(source, start, start + count, chunk, key, board))
    batched = False
    for stage in pipeline.stages:
        if stage.kind == "batch":
            ds = ds.map_batches(_Batch(stage.size or 1, stage.drop_last), batch_size=stage.size or 1,
                                batch_format="numpy")
            batched = True
            continue
        n = concurrency.get(stage.name, stage.concurrency)
        args = (stage.name, cloudpickle.dumps(stage.fn), key, board, strict, batched)
        remote = dict(resources.get(stage.name, {}))
        if uses_actors(stage):
            ds = ds.flat_map(_ActorTimed, fn_constructor_args=args, compute=ActorPoolStrategy(size=n), **remote)
        else:
            ds = ds.flat_map(_Timed(*args), compute=TaskPoolStrategy(size=n), **remote)
    # Ray Data logs each execution at INFO (plan, progress) from its own loggers: a Loader is quieter.
    for name in ("ray.data", "ray.data._internal.execution.streaming_executor"):
        logging.getLogger(name).setLevel(logging.WARNING)
    ds.context.execution_options.preserve_order = ordered
    ds.context.enable_progress_bars = False
    return ds


def first_batch_size(pipeline: Pipeline) -> int:
    """Items per batch of the first ``batch`` stage (1 without one): restarts start at its multiples."""
    return next((s.size or 1 for s in pipeline.stages if s.kind == "batch"), 1)


def _plain(value: Any) -> Any:
    """numpy scalars and arrays from Ray's batches as plain Python (for messages and bookkeeping)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value
