"""Reading an SPDL ``PipelineConfig``: its stages, their lab names, and what each one is.

``from_spdl`` and the SPDL monitor both start here, so a stage has the same
name whichever way it is run. Everything this package reads from SPDL's
private fields is read in this module (spdl_core 0.8).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import PipelineSpecError

__all__ = ["SpdlStage", "SpdlSpec", "config_of", "describe", "op_kind", "pipe_fields"]

#: Names lab gives the ends of an SPDL pipeline: its source, and SPDL's sink
#: stage (which moves items from the last stage's queue into the output buffer).
SOURCE, SINK = "source", "sink"


@dataclass(frozen=True)
class SpdlStage:
    """One SPDL stage as lab sees it.

    ``position`` is SPDL's stage id (the source is 0); ``what`` says in words
    what the stage is, for error messages; ``cfg`` is SPDL's own config object.
    """

    name: str
    kind: str  # "map" (pipe, disaggregate) or "batch" (aggregate); "other" for parts lab does not model
    concurrency: int
    position: int
    what: str
    cfg: Any


@dataclass(frozen=True)
class SpdlSpec:
    """What an SPDL pipeline is made of, in lab's terms; ``stages`` as ``lab.Stage`` records.

    It is a description, not a ``lab.Pipeline``: the functions stay in ``config``.
    """

    config: Any
    parts: tuple[SpdlStage, ...]

    @property
    def stages(self) -> tuple[Any, ...]:
        from ..pipeline import Stage

        return tuple(Stage(p.name, p.kind, p.concurrency) for p in self.parts)  # type: ignore[arg-type]

    def stage(self, name: str) -> SpdlStage:
        for part in self.parts:
            if part.name == name:
                return part
        known = ", ".join(repr(p.name) for p in self.parts) or "none"
        raise PipelineSpecError(f"no stage named {name!r}; this SPDL pipeline's stages: {known}")

    def __repr__(self) -> str:
        parts = [f"SPDL pipeline(source={_describe(getattr(self.config.src, 'source', self.config.src))})"]
        parts += [f"{p.what} {p.name!r}, concurrency={p.concurrency}" for p in self.parts]
        return "\n  ".join(parts)


def config_of(spec: Any, *, caller: str) -> Any:
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
            f"stages; pass the PipelineBuilder (or builder.get_config()) instead"
        )
    raise PipelineSpecError(
        f"{caller} takes an spdl.pipeline.PipelineBuilder or spdl.pipeline.defs.PipelineConfig, "
        f"got {type(spec).__name__}"
    )


def describe(config: Any, *, reject: Callable[[SpdlStage], str | None], caller: str) -> SpdlSpec:
    """The stages of ``config``, named as lab names them.

    ``reject(stage)`` returns why a stage cannot be taken (and what to do), or
    None; the first refusal raises ``PipelineSpecError`` naming the stage.
    Names are SPDL's; a repeated name (SPDL allows them, lab does not) gets
    ``_2``, ``_3``; ``source`` and ``sink`` are taken by the pipeline's ends.
    """
    from spdl.pipeline.defs import AggregateConfig, Collate, DisaggregateConfig, PipeConfig

    taken = {SOURCE, SINK}
    parts = []
    for position, cfg in enumerate(config.pipes, start=1):
        if isinstance(cfg, PipeConfig):
            op, _executor, concurrency = pipe_fields(cfg)
            base, kind, what = cfg.name, "map", f"pipe ({op_kind(op)})"
        elif isinstance(cfg, AggregateConfig):
            size = f"{cfg.op.n} items" if type(cfg.op) is Collate else f"custom {type(cfg.op).__name__}"
            base, kind, concurrency, what = cfg.name, "batch", 1, f"aggregate ({size})"
        elif isinstance(cfg, DisaggregateConfig):
            base, kind, concurrency, what = "disaggregate", "map", 1, "disaggregate"
        else:
            base, kind, concurrency, what = _other(cfg)
        name = _unique(str(base) or "stage", taken)
        part = SpdlStage(name, kind, concurrency, position, what, cfg)
        why = reject(part)
        if why is not None:
            raise PipelineSpecError(f"{caller}: stage {name!r} ({what}) is not supported: {why}")
        parts.append(part)
    return SpdlSpec(config, tuple(parts))


def pipe_fields(cfg: Any) -> tuple[Callable[[Any], Any], Any, int]:
    """``(op, executor, concurrency)`` of a PipeConfig (SPDL keeps them in ``_args``)."""
    try:
        args = cfg._args
        return args.op, args.executor, args.concurrency
    except AttributeError:
        raise PipelineSpecError(
            f"stage {cfg.name!r}: this SPDL version's PipeConfig has no _args; "
            f"spdl_lab reads SPDL pipelines of spdl_core 0.8"
        ) from None


def pipe_ordered(cfg: Any) -> bool:
    """True for ``output_order="input"``."""
    from spdl.pipeline.defs import _PipeType

    return cfg._type is _PipeType.OrderedPipe


def pipe_max_failures(cfg: Any) -> Any:
    return getattr(cfg, "_max_failures", None)


def op_kind(op: Any) -> str:
    """``"sync function"``, ``"async function"``, ``"generator"`` or ``"async generator"``."""
    call = getattr(op, "__call__", None)  # noqa: B004 - callable objects
    if inspect.isasyncgenfunction(op) or inspect.isasyncgenfunction(call):
        return "async generator"
    if inspect.iscoroutinefunction(op) or inspect.iscoroutinefunction(call):
        return "async function"
    if inspect.isgeneratorfunction(op) or inspect.isgeneratorfunction(call):
        return "generator"
    return "sync function"


def _other(cfg: Any) -> tuple[str, str, int, str]:
    from spdl.pipeline.defs import PathVariantsConfig, PlacementConfig

    if isinstance(cfg, PathVariantsConfig):
        return cfg.name or "path_variants_router", "other", 1, f"path_variants with {len(cfg.paths)} paths"
    if isinstance(cfg, PlacementConfig):
        return cfg.name, "other", 1, f".to({cfg.target!r}) region marker"
    return getattr(cfg, "name", None) or type(cfg).__name__, "other", 1, type(cfg).__name__


def _unique(base: str, taken: set[str]) -> str:
    name, n = base, 2
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def _describe(source: object) -> str:
    text = repr(source)
    return text if len(text) <= 40 else f"<{type(source).__name__}>"
