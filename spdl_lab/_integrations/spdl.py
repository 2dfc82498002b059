"""``lab.from_spdl``: an SPDL pipeline as a ``lab.Pipeline``, for every lab runner and experiment
(``spdl_monitor`` watches one as SPDL runs it instead).
"""

from __future__ import annotations

from typing import Any

from .._pipeline import Pipeline
from ._event_loop import LoopThread
from ._ops import AsyncSource, Op
from ._spdl_config import SpdlNotInstalledError, op_kind, pipe_fields, pipe_ordered, read_spec

__all__ = ["SpdlNotInstalledError", "from_spdl"]


def from_spdl(builder_or_config: Any) -> Pipeline:
    """A ``lab.Pipeline`` that does what an SPDL pipeline (a builder or its config) does.

    Example::

        p = lab.from_spdl(PipelineBuilder().add_source(range(1000))
                          .pipe(decode, concurrency=4).aggregate(32).pipe(collate).add_sink(3))
        lab.diagnose(p)

    Names and concurrency are kept; async functions share one event loop thread. An item a pipe
    maps to ``None`` (SPDL drops it) counts as a failure; the sink's buffer is ``lab.Loader``'s.
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

