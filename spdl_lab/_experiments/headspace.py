"""``lab.headspace``: the one-call form of the ``cache`` runner."""

from __future__ import annotations

from typing import Any

from .._loader import Loader
from .._pipeline import Pipeline
from ..errors import PipelineSpecError

__all__ = ["headspace"]


def headspace(loader_or_pipeline: Loader | Pipeline, *, num_caches: int = 8, forever: bool = False,
              **options: Any) -> Loader:
    """A Loader that replays the first ``num_caches`` outputs of a Loader (its runner makes them)
    or a Pipeline (``source_runner=``, default thread): the step time when loading is free::

        with lab.headspace(loader) as fast:
            for batch in fast:
                step(batch)
    """
    if isinstance(loader_or_pipeline, Loader):
        base = loader_or_pipeline
        merged = {**base.options, "source_runner": base.runner, **options}
        pipeline = base.pipeline
    elif isinstance(loader_or_pipeline, Pipeline):
        merged = dict(options)
        pipeline = loader_or_pipeline
    else:
        raise PipelineSpecError(f"headspace takes a lab.Loader or lab.Pipeline, "
                                f"got {type(loader_or_pipeline).__name__}")
    merged.pop("metered", None)
    return Loader(pipeline, runner="cache", num_caches=num_caches, forever=forever, **merged)
