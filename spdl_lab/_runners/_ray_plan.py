"""A lab Pipeline as a Ray Dataset: runs of stages as Ray Data operations (its executor, object
store and concurrency caps as they are), ``batch`` inside them; the lab's meters in its workers."""

from __future__ import annotations

import itertools
import logging
import math
import re
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import cloudpickle
import numpy as np
import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, TaskPoolStrategy, from_blocks
from ray.data.extensions import ArrowPythonObjectArray, ArrowTensorArray

from .._pipeline import Pipeline, Stage
from ..errors import describe, in_chain
from ._ray_meters import flush, record
from ._transport import pickled

#: Chunks (whole batches) a block holds at most: Ray Data's cost per block caps a cheap stage.
MAX_BLOCK_CHUNKS = 64
#: Chunks one execution runs at most: a larger source runs as several executions in turn.
WINDOW_CHUNKS = 4096
#: How often a task sends what it has made (whole chunks), while it runs on.
YIELD_EVERY_S = 0.1

Row = tuple[Any, Any]  # (source index, or the flat list of them for a batch; the value)


def _not_our_failures(record: logging.LogRecord) -> bool:
    """Drops Ray Data's records of a lab stage failure (logged twice; the PipelineError says it all)
    and its notice that progress bars are off (the lab turns them off)."""
    if record.name == "ray.data._internal.progress":
        return False
    ours = in_chain(record.exc_info[1] if record.exc_info else None, StageFailure)
    return not ours and "StageFailure" not in record.getMessage()


class StageFailure(Exception):
    """A stage raised inside a Ray worker: the item's number at that stage (a batch's after a
    batch stage), and ``error`` itself when it survives pickling."""

    def __init__(self, stage: str, index: int, what: str, error: BaseException | None) -> None:
        super().__init__(stage, index, what, error)
        self.stage, self.index, self.what, self.error = stage, index, what, error

    def __str__(self) -> str:
        return f"StageFailure: stage {self.stage!r} failed on item {self.index}: {self.what}"


_FAILURE_LINE = re.compile(r"StageFailure: stage '([^']*)' failed on item (\d+): (.*)")


def find_failure(exc: BaseException) -> StageFailure | None:
    """Our StageFailure inside whatever Ray wrapped it in, or read back from its text."""
    if (found := in_chain(exc, StageFailure)) is not None:
        return found
    match = _FAILURE_LINE.search(str(exc))
    return None if match is None else StageFailure(match[1], int(match[2]), match[3], None)


def uses_actors(stage: Stage) -> bool:
    """A callable object (state worth keeping) runs in an actor pool, unpickled once per actor."""
    fn = stage.fn.func if isinstance(stage.fn, partial) else stage.fn
    return not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type))


def chunk_size(pipeline: Pipeline) -> int:
    """Items per block unit: a multiple of every batch stage's size (restarts start at its multiples)."""
    return math.prod(s.size or 1 for s in pipeline.stages if s.kind == "batch")


def block_sizes(chunks: int, spread: int = 1) -> list[int]:
    """Chunks per block (a task each): 1, for a first batch soon; then equal blocks, 2 or more per
    concurrent task (``spread``) and at most ``MAX_BLOCK_CHUNKS``, each streaming its output."""
    if chunks <= 1:
        return [chunks] if chunks else []
    rest, spread = chunks - 1, max(1, spread)
    parts = max(2 * spread, -(-rest // MAX_BLOCK_CHUNKS))
    parts = min(rest, -(-parts // spread) * spread)
    size, extra = divmod(rest, parts)
    return [1, *(size + (i < extra) for i in range(parts))]


@dataclass
class Group:
    """One Ray Data operation: consecutive stages of one setting (an operation per stage would hold
    a CPU per task for a source or batch doing next to nothing); ``actors``: see ``uses_actors``."""

    stages: list[Stage] = field(default_factory=list)
    actors: bool = False
    concurrency: int | None = None
    resources: dict[str, float] = field(default_factory=dict)


def groups(pipeline: Pipeline, concurrency: dict[str, int],
           resources: dict[str, dict[str, float]]) -> list[Group]:
    """The pipeline's stages cut into groups (the source belongs to the first)."""
    out = [Group()]
    for stage in pipeline.stages:
        if stage.kind == "map":
            setting = (uses_actors(stage), concurrency.get(stage.name, stage.concurrency),
                       dict(resources.get(stage.name, {})))
            group = out[-1]
            if group.concurrency is None:  # its first map stage: the group takes its setting
                group.actors, group.concurrency, group.resources = setting
            elif setting != (group.actors, group.concurrency, group.resources):
                out.append(Group([], *setting))
        out[-1].stages.append(stage)
    return out


class _Stages:
    """Runs one group's pieces on a block (a Ray Data ``map_batches`` function). ``strict``
    (max_failures=0): a stage's exception fails the run, Ray not retrying it; else it is counted."""

    def __init__(self, pieces: list[tuple], source: tuple | None, batches_in: bool, key: str, board: Any,
                 strict: bool) -> None:
        self.key, self.board, self.strict = key, board, strict
        self.source, self.batches_in = source, batches_in
        self.pieces = [(kind, name, cloudpickle.loads(arg) if kind == "map" else arg, span)
                       for kind, name, arg, span in pieces]

    def __call__(self, block: dict[str, np.ndarray]) -> Iterator[dict[str, Any]]:
        """The output in parts of whole chunks, one per ``YIELD_EVERY_S``, streamed as it goes."""
        if self.source is None:
            yield self._send(self._run_rows(rows_of(block, self.batches_in)))
            return
        part: list[Row] = []
        since = time.monotonic()
        for chunk_id in block["data"].tolist():
            part += self._run_rows(self._read([chunk_id]))
            if time.monotonic() - since >= YIELD_EVERY_S:
                yield self._send(part)
                part, since = [], time.monotonic()
        if part or not block["data"].size:
            yield self._send(part)

    def _run_rows(self, rows: list[Row]) -> list[Row]:
        for kind, name, arg, span in self.pieces:
            rows = self._map(name, arg, span, rows) if kind == "map" else self._batch(name, arg, span, rows)
        return rows

    def _send(self, rows: list[Row]) -> Any:
        flush(self.key)  # sent before the block: the counts of a block the driver holds are on their way
        return _block_of(rows)

    def _read(self, chunk_ids: list[int]) -> list[Row]:
        """The source's items of these chunks, read as a stage whose failure always ends the run."""
        source, start, end, chunk = self.source
        indices = [i for c in chunk_ids for i in range(start + c * chunk, min(start + (c + 1) * chunk, end))]
        if isinstance(source, range):  # cannot fail: read, and counted, all at once
            t0 = time.perf_counter_ns()
            rows = [(i, source[i]) for i in indices]
            record(self.key, self.board, "source", "ran", time.perf_counter_ns() - t0, n=len(rows))
            return rows
        return self._map("source", _fetched(source).__getitem__, 1, [(i, i) for i in indices], strict=True)

    def _map(self, name: str, fn: Any, span: int, rows: list[Row], strict: bool = False) -> list[Row]:
        out = []
        for index, item in rows:
            record(self.key, self.board, name, "started")
            t0 = time.perf_counter_ns()
            try:
                value = fn(item)
            except Exception as exc:  # noqa: BLE001 - the user's function: counted, then raised or dropped
                number, what = _first(index) // span, describe(exc)
                ns = time.perf_counter_ns() - t0
                record(self.key, self.board, name, "failed", ns, (name, number, what, time.time()))
                if strict or self.strict:
                    error = exc if pickled(exc, cloudpickle.dumps) is not None else None
                    raise StageFailure(name, number, what, error) from None
                continue
            record(self.key, self.board, name, "done", time.perf_counter_ns() - t0)
            out.append((index, value))
        return out

    def _batch(self, name: str, spec: tuple[int, bool, int], span: int, rows: list[Row]) -> list[Row]:
        """The items of one ``size``-aligned window of source indices make a batch, as elsewhere."""
        size, drop_last, last_window = spec
        out: list[Row] = []
        for window, group in itertools.groupby(rows, key=lambda row: _first(row[0]) // span):
            indices, items = [], []
            for index, item in group:
                indices.extend(index if isinstance(index, list) else [index])
                items.append(item)
            if not (drop_last and window == last_window and len(items) < size):
                record(self.key, self.board, name, "ran")
                out.append((indices, items))
        return out


class _ActorStages(_Stages):
    """The same, as an actor class: Ray makes one per actor with these constructor arguments."""


#: A source list put in the object store, fetched once per worker process (one run's at a time).
_fetched = lru_cache(maxsize=1)(ray.get)


def _first(index: Any) -> int:
    """The first source index of a row (a batch's row holds the list of them)."""
    return index[0] if isinstance(index, list) else index


def rows_of(block: dict[str, np.ndarray], batches: bool) -> list[Row]:
    """A block as rows: Python indices (a batch's as a list), values (numpy scalars as Python's)."""
    def scalar(value: Any) -> Any:
        return value.item() if isinstance(value, np.generic) else value

    items = [[scalar(x) for x in v] for v in block["item"]] if batches else [scalar(v) for v in block["item"]]
    idx = block["idx"]
    lists = idx.ndim == 2 or idx.dtype == object  # a batch's, -1 padded (ragged: Ray joined widths)
    indices = [row[row >= 0].tolist() for row in map(np.asarray, idx)] if lists else idx.tolist()
    return list(zip(indices, items))


def _block_of(rows: list[Row]) -> Any:
    """Rows as a block: a dict of arrays, or a table with a column of pickled objects."""
    if not rows:
        return {"idx": np.empty(0, dtype=np.int64), "item": np.empty(0, dtype=object)}
    indices = [i for i, _ in rows]
    if isinstance(indices[0], list):  # a batch's: one row each, padded with -1 (a plain tensor column)
        idx = np.full((len(indices), max(map(len, indices))), -1, dtype=np.int64)
        for row, i in zip(idx, indices):
            row[:len(i)] = i
    else:
        idx = np.asarray(indices, dtype=np.int64)
    item = _column([v for _, v in rows])
    if not isinstance(item, pa.Array):
        return {"idx": idx, "item": item}
    return pa.table({"idx": pa.array(idx) if idx.ndim == 1 else ArrowTensorArray.from_numpy(idx), "item": item})


#: What Arrow holds natively (a column of these, or of lists of them).
_NATIVE = (int, float, str, bytes, type(None), np.generic)


def _column(values: list[Any]) -> Any:
    """Arrays (or batches) of one shape and dtype as one tensor column, read without a copy; mixed
    arrays, numbers and text as they are; else pickled now (Ray's Arrow try prints the column)."""
    first = values[0]
    if isinstance(first, list) and first and all(isinstance(v, list) and v for v in values):
        inner = first[0]
        if _plain_array(inner) and all(_like(x, inner) for v in values for x in v):
            if any(len(v) != len(first) for v in values):
                return [np.stack(v) for v in values]  # a short last batch: tensors of two shapes
            out = np.empty((len(values), len(first), *inner.shape), dtype=inner.dtype)
            for i, v in enumerate(values):
                np.stack(v, out=out[i])
            return out
    elif all(_plain_array(v) for v in values):
        return np.stack(values) if all(_like(v, first) for v in values) else values
    if all(isinstance(v, _NATIVE) or (isinstance(v, list) and all(isinstance(x, _NATIVE) for x in v))
           for v in values):
        return values
    return ArrowPythonObjectArray.from_objects(values)


def _plain_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype != object and value.ndim > 0


def _like(value: Any, model: np.ndarray) -> bool:
    return isinstance(value, np.ndarray) and value.shape == model.shape and value.dtype == model.dtype


def build(pipeline: Pipeline, source: Any, *, start: int, count: int, total: int, concurrency: dict[str, int],
          key: str, board: Any, strict: bool, resources: dict[str, dict[str, float]], ordered: bool) -> Any:
    """The Dataset running ``count`` of the ``total`` items of ``source`` from ``start``."""
    chunk = chunk_size(pipeline)
    chunks = -(-count // chunk)
    cut = groups(pipeline, concurrency, resources)
    spread = max((g.concurrency or 1 for g in cut), default=1)
    bounds = np.cumsum([0, *block_sizes(chunks, spread)])
    # Blocks made here: from_numpy would run a Ray task per block to convert it, and wait for them.
    ds = from_blocks([pa.table({"data": np.arange(a, b, dtype=np.int64)})
                      for a, b in zip(bounds[:-1], bounds[1:])])
    span, last, batches_in = 1, total - 1, False
    for i, group in enumerate(cut):
        pieces = []
        for stage in group.stages:
            if stage.kind == "map":
                pieces.append(("map", stage.name, cloudpickle.dumps(stage.fn), span))
            else:
                span *= stage.size or 1
                pieces.append(("batch", stage.name, (stage.size or 1, stage.drop_last, last // span), span))
        origin = (source, start, start + count, chunk) if i == 0 else None
        args = (pieces, origin, batches_in, key, board, strict)
        batches_in = group.stages[-1].kind == "batch"
        fn, options = ((_ActorStages, {"fn_constructor_args": args}) if group.actors
                       else (_Stages(*args), {}))
        compute = (ActorPoolStrategy if group.actors else TaskPoolStrategy)(size=group.concurrency)
        ds = ds.map_batches(fn, batch_size=None, batch_format="numpy", compute=compute, **options,
                            **group.resources)
    for name in ("ray.data", "ray.data._internal.execution.streaming_executor"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger("ray.data").handlers:
        handler.addFilter(_not_our_failures)  # once: addFilter skips a filter it has
    # A stage's exception comes back as our StageFailure, not as text in a UserCodeException.
    ds.context.raise_original_map_exception = True
    ds.context.execution_options.preserve_order = ordered
    ds.context.enable_progress_bars = False
    return ds
