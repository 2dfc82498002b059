"""``lab.from_spdl``: an SPDL pipeline as a ``lab.Pipeline``, for every lab runner and experiment.

Converts a source, pipes (sync or async functions) and fixed-size aggregates; anything else is
refused, naming the stage. ``lab.run(builder, step=...)`` watches one as SPDL runs it (``spdl_monitor``).
"""

from __future__ import annotations

from typing import Any

from ..pipeline import Pipeline
from ._event_loop import LoopThread
from ._ops import AsyncSource, Op
from ._spdl_config import SpdlNotInstalledError, op_kind, pipe_fields, pipe_ordered, read_spec

__all__ = ["SpdlNotInstalledError", "from_spdl"]


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
    spec = read_spec(builder_or_config, caller="lab.from_spdl", convert=True)
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
        pipeline = pipeline.map(fn, concurrency=part.concurrency, name=part.name, ordered=pipe_ordered(part.cfg))
    return pipeline

