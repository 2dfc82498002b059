"""SPDL pipelines in lab's terms: ``read_spec`` reads a builder or config (SPDL's private fields are
read only here, spdl_core 0.8) for the monitor and ``lab.from_spdl``, which converts one into a
picklable ``lab.Pipeline`` whose async stages are awaited on one event loop thread."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .._pipeline import Pipeline, Stage, describe_source, find_stage, unique_name
from ..errors import PipelineSpecError, SpdlLabError

#: Names lab gives the ends of an SPDL pipeline: its source, and SPDL's sink
#: stage (which moves items from the last stage's queue into the output buffer).
SOURCE, SINK = "source", "sink"


@dataclass(frozen=True)
class SpdlStage:
    """One SPDL stage as lab sees it: ``what`` it is in words; ``cfg``, SPDL's own config object."""

    name: str
    kind: str  # "map" (pipe, disaggregate) or "batch" (aggregate); "other" for parts lab does not model
    concurrency: int
    what: str
    cfg: Any
    threads: int = 0  # of SPDL's executor its tasks may hold at once (a sync pipe without its own)


@dataclass(frozen=True)
class SpdlSpec:
    """What an SPDL pipeline is made of, in lab's terms (a description: the functions stay in ``config``)."""

    config: Any
    parts: tuple[SpdlStage, ...]

    @property
    def stages(self) -> tuple[Any, ...]:
        return tuple(Stage(p.name, p.kind, p.concurrency) for p in self.parts)  # type: ignore[arg-type]

    def stage(self, name: str) -> SpdlStage:
        return find_stage(self.parts, name, "this SPDL pipeline's")

    def __repr__(self) -> str:
        parts = [f"SPDL pipeline(source={describe_source(getattr(self.config.src, 'source', self.config.src))})"]
        parts += [f"{p.what} {p.name!r}, concurrency={p.concurrency}" for p in self.parts]
        return "\n  ".join(parts)


class SpdlNotInstalledError(SpdlLabError, ImportError):
    """SPDL (the ``spdl_core`` package) is not installed."""


def read_spec(spec: Any, *, caller: str, convert: bool) -> SpdlSpec:
    """The stages of an SPDL builder or config, named as SPDL names them (a repeat gets ``_2``);
    a stage lab cannot take (branches, regions; with ``convert``, what a Pipeline can't) raises."""
    try:
        from spdl.pipeline import defs
    except ImportError as exc:
        raise SpdlNotInstalledError(
            f"{caller} needs SPDL, which is not installed here ({exc}). "
            f"Install it with `pip install spdl_core` (it provides spdl.pipeline).") from exc

    config = _config_of(spec, caller)
    _check_source(config.src, caller, convert)
    taken = {SOURCE, SINK}
    parts = []
    for cfg in config.pipes:
        # why lab cannot take it, and what to do; None when it can (each pipe: _pipe_refusal)
        kind, concurrency, threads, why = "other", 1, 0, _UNMODELLED
        if isinstance(cfg, defs.PipeConfig):
            op, executor, concurrency = pipe_fields(cfg)
            base, kind, what = cfg.name, "map", f"pipe ({op_kind(op)})"
            if executor is None and op_kind(op) in ("sync function", "generator"):
                threads = concurrency
            why = _pipe_refusal(cfg, op, executor) if convert else None
        elif isinstance(cfg, defs.AggregateConfig):
            custom = type(cfg.op) is not defs.Collate
            size = f"custom {type(cfg.op).__name__}" if custom else f"{cfg.op.n} items"
            base, kind, what = cfg.name, "batch", f"aggregate ({size})"
            why = (f"a custom Aggregator ({type(cfg.op).__name__}) decides when to emit, and a "
                   f"lab.Pipeline batches by count only. Use aggregate(n), or {_MONITOR}."
                   if convert and custom else None)
        elif isinstance(cfg, defs.DisaggregateConfig):
            base, kind, what = "disaggregate", "map", "disaggregate"
            why = (f"a lab.Pipeline cannot split batches back into items. Remove it, or {_MONITOR}."
                   if convert else None)
        elif isinstance(cfg, defs.PathVariantsConfig):
            base, what = cfg.name or "path_variants_router", f"path_variants with {len(cfg.paths)} paths"
        elif isinstance(cfg, defs.PlacementConfig):
            base, what = cfg.name, f".to({cfg.target!r}) region marker"
            why = f"its stages run in worker processes, where lab's hooks do not reach, and {why}"
        else:
            base, what = getattr(cfg, "name", None) or type(cfg).__name__, type(cfg).__name__
        name = unique_name(str(base) or "stage", taken)
        taken.add(name)
        if why is not None:
            raise PipelineSpecError(f"{caller}: stage {name!r} ({what}) is not supported: {why}")
        parts.append(SpdlStage(name, kind, concurrency, what, cfg, threads))
    return SpdlSpec(config, tuple(parts))


def _config_of(spec: Any, caller: str) -> Any:
    """The ``PipelineConfig`` of a ``PipelineBuilder`` (``get_config()``) or a config itself."""
    from spdl.pipeline import Pipeline as BuiltPipeline
    from spdl.pipeline import PipelineBuilder
    from spdl.pipeline.defs import PipelineConfig

    if isinstance(spec, PipelineConfig):
        return spec
    if isinstance(spec, PipelineBuilder):
        try:
            return spec.get_config()
        except (RuntimeError, ValueError) as exc:
            raise PipelineSpecError(
                f"{caller}: the PipelineBuilder is not complete: {exc} (a builder needs "
                f"add_source(...) and add_sink(n); a .to() region must be closed with .to(MAIN_PROCESS))"
            ) from exc
    if isinstance(spec, BuiltPipeline):
        raise PipelineSpecError(
            f"{caller}: got a built spdl.pipeline.Pipeline, which keeps no public description of its "
            f"stages; pass the PipelineBuilder (or builder.get_config()) instead")
    raise PipelineSpecError(
        f"{caller} takes an spdl.pipeline.PipelineBuilder or spdl.pipeline.defs.PipelineConfig, "
        f"got {type(spec).__name__}")


_MONITOR = "lab.run(builder, step=...) monitors it as SPDL runs it, without converting"
_AS_ITERABLE = ("run the built pipeline as a plain iterable: lab.run(builder.build(num_threads=n), "
                "step=...) measures the training step and the probes")
_UNMODELLED = (f"lab takes a chain of map and batch stages, with no regions or branches. "
               f"Remove it, or {_AS_ITERABLE}.")


def _check_source(src: Any, caller: str, convert: bool) -> None:
    from spdl.pipeline.defs import MergeConfig

    if isinstance(src, MergeConfig):
        raise PipelineSpecError(
            f"{caller}: the source (a Merge of {len(src.pipeline_configs)} pipelines) is not supported: "
            f"lab takes one source. Take each merged pipeline on its own (config.src.pipeline_configs[i]), "
            f"or {_AS_ITERABLE}.")
    if convert and src.continuous:
        raise PipelineSpecError(
            f"{caller}: the source (continuous=True, re-iterated for ever with epoch markers) is "
            "not supported: a lab.Pipeline makes one pass over its source per run. Build with "
            "add_source(..., continuous=False).")


def _pipe_refusal(cfg: Any, op: Any, executor: Any) -> str | None:
    """Why a lab.Pipeline cannot take this pipe, and what to do; None when it can."""
    kind = op_kind(op)
    if kind in ("generator", "async generator"):
        return (f"a {kind} puts each value it yields downstream, and a lab map stage makes one "
                f"output per input. Return one value (a list, then .disaggregate() in SPDL), or {_MONITOR}.")
    if executor is not None:
        return (f"it runs on its own executor ({type(executor).__name__}), and lab runs each stage "
                f"in its own threads (or a runner's processes). Drop executor=, or {_MONITOR}.")
    if getattr(cfg, "_max_failures", None) is not None:
        return (f"it sets its own max_failures ({cfg._max_failures}), and lab counts failures "
                f"for the whole pipeline. Drop it and pass max_failures=N to lab.Loader or lab.run.")
    return None


def pipe_fields(cfg: Any) -> tuple[Callable[[Any], Any], Any, int]:
    """``(op, executor, concurrency)`` of a PipeConfig (SPDL keeps them in ``_args``)."""
    try:
        args = cfg._args
        return args.op, args.executor, args.concurrency
    except AttributeError:
        raise PipelineSpecError(
            f"stage {cfg.name!r}: this SPDL version's PipeConfig has no _args; "
            f"spdl_lab reads SPDL pipelines of spdl_core 0.8") from None


def op_kind(op: Any) -> str:
    """``"sync function"``, ``"async function"``, ``"generator"`` or ``"async generator"``."""
    call = getattr(op, "__call__", None)  # noqa: B004 - callable objects
    kinds = {"async generator": inspect.isasyncgenfunction, "async function": inspect.iscoroutinefunction,
             "generator": inspect.isgeneratorfunction}
    return next((kind for kind, test in kinds.items() if test(op) or test(call)), "sync function")


def from_spdl(builder_or_config: Any) -> Pipeline:
    """A ``lab.Pipeline`` that does what an SPDL pipeline (a builder or its config) does.

    Names and concurrency are kept; async functions share one event loop thread. An item a pipe
    maps to ``None`` (SPDL drops it) counts as a failure; the sink's buffer is ``lab.Loader``'s::

        p = lab.from_spdl(PipelineBuilder().add_source(range(1000))
                          .pipe(decode, concurrency=4).aggregate(32).pipe(collate).add_sink(3))
        lab.diagnose(p)
    """
    spec = read_spec(builder_or_config, caller="lab.from_spdl", convert=True)  # SPDL imports here
    from spdl.pipeline.defs import _PipeType  # ordered: output_order="input"

    loop = LoopThread()  # shared by the async stages, as SPDL shares one loop
    source = spec.config.src.source
    if not hasattr(source, "__iter__"):
        source = AsyncSource(source, loop)
    pipeline = Pipeline(source)
    for part in spec.parts:
        if part.kind == "batch":
            pipeline = pipeline.batch(part.cfg.op.n, drop_last=part.cfg.drop_last, name=part.name)
            continue
        op = pipe_fields(part.cfg)[0]
        fn = Op(op, part.name, loop if op_kind(op) == "async function" else None)
        ordered = part.cfg._type is _PipeType.OrderedPipe
        pipeline = pipeline.map(fn, concurrency=part.concurrency, name=part.name, ordered=ordered)
    return pipeline


class ItemSkipped(SpdlLabError):
    """An SPDL op returned ``None``: SPDL drops the item, a lab.Pipeline counts it as a failure."""


class Op:
    """An SPDL op as a lab stage function; an async one is awaited on ``loop`` while the calling
    thread blocks, so N threads keep up to N coroutines on the loop: SPDL's concurrency."""

    def __init__(self, fn: Callable[[Any], Any], stage: str, loop: LoopThread | None = None) -> None:
        self.fn = fn
        self.stage = stage
        self.loop = loop

    def __call__(self, item: Any) -> Any:
        result = self.fn(item) if self.loop is None else self.loop.run(self.fn, item)
        if result is None:
            raise ItemSkipped(
                f"stage {self.stage!r} returned None: SPDL drops such items, but a lab.Pipeline has no "
                f"filter, so the item counts as a failed one. Pass max_failures=N to lab.Loader or "
                f"lab.run to drop and count up to N of them.")
        return result


class AsyncSource:
    """An async iterable as a lab source: a factory of iterators that step it on ``loop``."""

    def __init__(self, source: AsyncIterable[Any], loop: LoopThread) -> None:
        self.source = source
        self.loop = loop

    def __call__(self) -> Iterator[Any]:
        iterator = self.loop.run(_aiter, self.source)
        try:
            while True:
                try:
                    yield self.loop.run(anext, iterator)
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                self.loop.run(lambda _: aclose(), None)

    def __repr__(self) -> str:
        return f"AsyncSource({type(self.source).__name__})"


async def _aiter(source: AsyncIterable[Any]) -> Any:
    return aiter(source)


class LoopThread:
    """One event loop in a daemon thread, started on first use; a pickled copy starts its own. No
    runner knows of it, so each submitting thread holds a thread-local lease, dropped as the thread
    ends (before its ``join()`` returns): the last one gone stops the loop, as a Loader closes."""

    def __init__(self, name: str = "spdl_lab:async-stages") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._local = threading.local()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._leases = 0

    def __reduce__(self) -> tuple[Any, ...]:
        return (LoopThread, (self.name,))

    def run(self, make: Callable[[Any], Awaitable[Any]], arg: Any) -> Any:
        """``await make(arg)`` on the loop; block this thread until it is done."""
        future = asyncio.run_coroutine_threadsafe(_await(make, arg), self._loop_here())
        try:
            return future.result()
        finally:
            # A traceback holds this frame: no future in it, so no cycle waits for the collector.
            del future

    def _loop_here(self) -> asyncio.AbstractEventLoop:
        """The loop, leased to the calling thread (never in a frame a traceback can hold)."""
        lease = getattr(self._local, "lease", None)
        if lease is None:
            lease = self._local.lease = self._acquire()
        return lease.loop

    def _acquire(self) -> _Lease:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()
                thread = threading.Thread(target=_serve, args=(loop, ready), name=self.name, daemon=True)
                thread.start()
                ready.wait()
                self._loop = loop
            self._leases += 1
            return _Lease(self, self._loop)

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:
        # Runs while a worker thread is being torn down: no joins, no current_thread().
        with self._lock:
            self._leases -= 1
            if self._leases > 0:
                return
            self._loop = None
        with contextlib.suppress(RuntimeError):  # already closed (interpreter shutdown)
            loop.call_soon_threadsafe(loop.stop)


class _Lease:
    def __init__(self, owner: LoopThread, loop: asyncio.AbstractEventLoop) -> None:
        self.owner = owner
        self.loop = loop

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the daemon loop thread dies with it
            self.owner._release(self.loop)


async def _await(make: Callable[[Any], Awaitable[Any]], arg: Any) -> Any:
    # run_coroutine_threadsafe takes coroutines only; ``make`` may return any awaitable.
    return await make(arg)


def _serve(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(ready.set)
    try:
        loop.run_forever()
    finally:
        try:
            tasks = asyncio.all_tasks(loop)  # a call interrupted in its thread leaves its task
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
