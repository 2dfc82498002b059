"""``lab.from_spdl``: an SPDL pipeline as a ``lab.Pipeline``, for every lab runner and experiment.

Converts pipelines made of a source, pipes (sync or async functions) and
aggregates (fixed-size batches); anything else is refused with a
``PipelineSpecError`` naming the stage. To watch an SPDL pipeline as SPDL runs
it, without converting it, use ``lab.run(builder, step=...)`` (``spdl_monitor``).
"""

from __future__ import annotations

from typing import Any

from ..errors import PipelineSpecError, SpdlLabError
from ..pipeline import Pipeline

__all__ = ["SpdlNotInstalledError", "from_spdl", "require_spdl"]

_MONITOR = "lab.run(builder, step=...) monitors it as SPDL runs it, without converting"


class SpdlNotInstalledError(SpdlLabError, ImportError):
    """SPDL (the ``spdl_core`` package) is not installed."""


def require_spdl(caller: str) -> None:
    """Raise ``SpdlNotInstalledError`` unless ``spdl.pipeline`` imports."""
    try:
        import spdl.pipeline  # noqa: F401
        import spdl.pipeline.defs  # noqa: F401
    except ImportError as exc:
        raise SpdlNotInstalledError(
            f"{caller} needs SPDL, which is not installed here ({exc}). "
            f"Install it with `pip install spdl_core` (it provides spdl.pipeline)."
        ) from exc


def from_spdl(builder_or_config: Any) -> Pipeline:
    """A ``lab.Pipeline`` that does what an SPDL pipeline does.

    Example::

        from spdl.pipeline import PipelineBuilder
        import spdl_lab as lab

        builder = (PipelineBuilder().add_source(range(1000))
                   .pipe(download, concurrency=8).pipe(decode, concurrency=4)
                   .aggregate(32).pipe(collate).add_sink(3))
        p = lab.from_spdl(builder)            # or builder.get_config()
        diag = lab.diagnose(p)                # each stage alone, a verdict per stage
        cmp = lab.compare(p, step=train_step)

    Stage names and concurrency are kept (a repeated name gets ``_2``);
    ``output_order="input"`` becomes ``ordered=True``. Async functions run on
    an event loop in its own thread, which stops when the threads that used it
    end. SPDL drops items for which a pipe returns ``None``; a lab.Pipeline
    counts them as failures (``max_failures=N`` drops up to N). The sink's
    ``buffer_size`` is a Loader option in lab (``lab.Loader(p, buffer_size=n)``).

    Refused, with the stage named: generator ops, pipes with their own
    ``executor`` or ``max_failures``, custom ``Aggregator``s, ``disaggregate``,
    ``path_variants``, ``.to()`` regions, ``Merge`` sources and continuous sources.
    """
    require_spdl("lab.from_spdl")
    from ._event_loop import LoopThread
    from ._ops import AsyncOp, AsyncSource, SyncOp
    from ._spdl_config import config_of, describe, op_kind, pipe_fields, pipe_ordered

    config = config_of(builder_or_config, caller="lab.from_spdl")
    _check_source(config.src)
    spec = describe(config, reject=_refusal, caller="lab.from_spdl")
    loop = LoopThread()  # shared by the async stages, as SPDL shares one loop
    source = config.src.source
    if not hasattr(source, "__iter__"):
        source = AsyncSource(source, loop)
    pipeline = Pipeline(source)
    for part in spec.parts:
        if part.kind == "batch":
            pipeline = pipeline.batch(part.cfg.op.n, drop_last=part.cfg.drop_last, name=part.name)
            continue
        op = pipe_fields(part.cfg)[0]
        fn = AsyncOp(op, part.name, loop) if op_kind(op) == "async function" else SyncOp(op, part.name)
        pipeline = pipeline.map(fn, concurrency=part.concurrency, name=part.name, ordered=pipe_ordered(part.cfg))
    return pipeline


def _check_source(src: Any) -> None:
    from spdl.pipeline.defs import MergeConfig

    if isinstance(src, MergeConfig):
        raise PipelineSpecError(
            f"lab.from_spdl: the source (a Merge of {len(src.pipeline_configs)} pipelines) is not "
            f"supported: a lab.Pipeline has one source. Convert each merged pipeline on its own "
            f"(lab.from_spdl(config.src.pipeline_configs[i]))."
        )
    if src.continuous:
        raise PipelineSpecError(
            "lab.from_spdl: the source (continuous=True, re-iterated for ever with epoch markers) is "
            "not supported: a lab.Pipeline makes one pass over its source per run. Build with "
            "add_source(..., continuous=False)."
        )


def _refusal(part: Any) -> str | None:
    """Why ``part`` cannot become a lab stage, and what to do; None when it can."""
    from spdl.pipeline.defs import AggregateConfig, Collate, DisaggregateConfig, PipeConfig

    from ._spdl_config import op_kind, pipe_fields, pipe_max_failures

    cfg = part.cfg
    if isinstance(cfg, PipeConfig):
        op, executor, _ = pipe_fields(cfg)
        kind = op_kind(op)
        if kind in ("generator", "async generator"):
            return (f"a {kind} puts each value it yields downstream, and a lab map stage makes one "
                    f"output per input. Return one value (a list, then .disaggregate() in SPDL), or {_MONITOR}.")
        if executor is not None:
            return (f"it runs on its own executor ({type(executor).__name__}), and lab runs each stage "
                    f"in its own threads (or a runner's processes). Drop executor=, or {_MONITOR}.")
        if pipe_max_failures(cfg) is not None:
            return (f"it sets its own max_failures ({pipe_max_failures(cfg)}), and lab counts failures "
                    f"for the whole pipeline. Drop it and pass max_failures=N to lab.Loader or lab.run.")
        return None
    if isinstance(cfg, AggregateConfig):
        if type(cfg.op) is not Collate:
            return (f"a custom Aggregator ({type(cfg.op).__name__}) decides when to emit, and a "
                    f"lab.Pipeline batches by count only. Use aggregate(n), or {_MONITOR}.")
        return None
    if isinstance(cfg, DisaggregateConfig):
        return f"a lab.Pipeline cannot split batches back into items. Remove it, or {_MONITOR}."
    return ("a lab.Pipeline is a chain of map and batch stages, with no regions or branches. "
            "Remove it, or run the SPDL pipeline as it is (lab.run(builder.build(num_threads=n), "
            "step=...) measures the training step and the probes).")
