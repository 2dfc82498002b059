"""The Pipeline spec: a source, per-item and per-batch ``map`` stages, ``batch`` stages. It runs
nothing; builder methods return a new Pipeline, so a spec can be shared and extended safely."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from .errors import PipelineSpecError

#: Upper bound on a stage's concurrency: beyond it a pool costs more than it can return anywhere.
MAX_CONCURRENCY = 1024


@dataclass(frozen=True)
class Stage:
    """One stage of a Pipeline: ``"map"`` (``fn`` on each item, ``concurrency`` at a time) or
    ``"batch"`` (``size`` consecutive items in a list)."""

    name: str
    kind: Literal["map", "batch"]
    concurrency: int
    fn: Callable[[Any], Any] | None = None
    ordered: bool = True
    size: int | None = None
    drop_last: bool = False


def validate_concurrency(value: object, *, stage: str) -> None:
    """Raise naming ``stage`` unless ``value`` is a valid concurrency."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
        raise PipelineSpecError(f"stage {stage!r}: concurrency must be an int in 1..{MAX_CONCURRENCY}, "
                                f"got {value!r} ({type(value).__name__})")


def check_ints(where: str, **values: tuple[Any, int]) -> None:
    """Each ``name=(value, low)`` must be an int of at least ``low``; else an error naming ``where``."""
    for name, (value, low) in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise PipelineSpecError(f"{where}: {name} must be an int >= {low}, got {value!r}")


class Pipeline:
    """A declarative data pipeline over ``source``: a re-iterable (a list, a Dataset-like object)
    or a zero-argument callable returning a fresh iterator (a plain iterator runs once).

    Example::

        p = lab.Pipeline(range(1000)).map(double, concurrency=4).batch(32).map(sum, name="total")
        with lab.Loader(p) as loader:
            totals = list(loader)
    """

    def __init__(self, source: Iterable[Any] | Callable[[], Iterable[Any]]) -> None:
        if not (callable(source) or hasattr(source, "__iter__")):
            raise PipelineSpecError(f"Pipeline source must be an iterable or a zero-argument callable "
                                    f"returning an iterator; got {type(source).__name__}")
        self._source = source
        self._stages: tuple[Stage, ...] = ()

    def map(self, fn: Callable[[Any], Any], *, concurrency: int = 1, name: str | None = None,
            ordered: bool = True) -> Pipeline:
        """Apply ``fn`` to every item (or batch, after ``batch``), ``concurrency`` at a time; with
        ``ordered=False`` outputs come as they finish, a slow item hidden behind faster ones."""
        label = name if name is not None else _default_name(fn)
        if not callable(fn):
            raise PipelineSpecError(f"stage {label!r}: fn must be callable, got {type(fn).__name__}")
        if not isinstance(ordered, bool):
            raise PipelineSpecError(f"stage {label!r}: ordered must be a bool, got {ordered!r}")
        validate_concurrency(concurrency, stage=label)
        stage_name = self._unique_name(label, explicit=name is not None)
        return self._with((*self._stages, Stage(stage_name, "map", concurrency, fn=fn, ordered=ordered)))

    def batch(self, size: int, *, drop_last: bool = False, name: str | None = None) -> Pipeline:
        """Group consecutive items into lists of ``size``; the last may be shorter."""
        label = name if name is not None else "batch"
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise PipelineSpecError(f"stage {label!r}: batch size must be an int >= 1, got {size!r} "
                                    f"({type(size).__name__})")
        if not isinstance(drop_last, bool):
            raise PipelineSpecError(f"stage {label!r}: drop_last must be a bool, got {drop_last!r}")
        stage_name = self._unique_name(label, explicit=name is not None)
        return self._with((*self._stages, Stage(stage_name, "batch", 1, size=size, drop_last=drop_last)))

    @property
    def source(self) -> Iterable[Any] | Callable[[], Iterable[Any]]:
        return self._source

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self._stages

    def stage(self, name: str) -> Stage:
        """The stage called ``name``; raises naming the stages there are."""
        return find_stage(self._stages, name, "this pipeline's")

    @property
    def source_is_factory(self) -> bool:
        """Whether the source is called for each iterator (a function, ``itertools.count``)."""
        source = self._source
        return isinstance(source, type) or not hasattr(source, "__iter__")

    def open_source(self) -> Iterator[Any]:
        """A fresh iterator over the source."""
        source = self._source
        if not self.source_is_factory:
            return iter(source)
        produced = source()
        if not hasattr(produced, "__iter__"):
            raise PipelineSpecError(f"Pipeline source callable {_default_name(source)!r} returned "
                                    f"{type(produced).__name__}, not an iterable")
        return iter(produced)

    def with_concurrency(self, name: str, concurrency: int) -> Pipeline:
        """A copy of this pipeline with stage ``name`` at ``concurrency``."""
        if self.stage(name).kind != "map":
            raise PipelineSpecError(f"stage {name!r} is a batch stage and has no concurrency")
        validate_concurrency(concurrency, stage=name)
        return self._with(tuple(replace(s, concurrency=concurrency) if s.name == name else s
                                for s in self._stages))

    def __repr__(self) -> str:
        parts = [f"Pipeline(source={describe_source(self._source)})"]
        for s in self._stages:
            if s.kind == "map":
                order = "" if s.ordered else ", ordered=False"
                parts.append(f".map({s.name}, concurrency={s.concurrency}{order})")
            else:
                drop = ", drop_last=True" if s.drop_last else ""
                parts.append(f".batch({s.size}{drop})")
        return "\n  ".join(parts)

    def _with(self, stages: tuple[Stage, ...]) -> Pipeline:
        clone = Pipeline(self._source)
        clone._stages = stages
        return clone

    def _unique_name(self, label: str, *, explicit: bool) -> str:
        if not isinstance(label, str) or not label:
            raise PipelineSpecError(f"stage name must be a non-empty str, got {label!r}")
        taken = {s.name for s in self._stages} | {"source"}
        if explicit and label in taken:
            raise PipelineSpecError(f"stage name {label!r} is already used in this pipeline; names "
                                    f"must be unique (taken: {', '.join(sorted(taken))})")
        return unique_name(label, taken)


def find_stage(stages: Sequence[Any], name: str, whose: str) -> Any:
    """The stage of ``stages`` called ``name``; else an error naming ``whose`` stages there are."""
    for stage in stages:
        if stage.name == name:
            return stage
    known = ", ".join(repr(s.name) for s in stages) or "none"
    raise PipelineSpecError(f"no stage named {name!r}; {whose} stages: {known}")


def unique_name(base: str, taken: Collection[str], sep: str = "_") -> str:
    """``base``, or the first of ``base_2``, ``base_3``, ... (``sep``, ``_``) not in ``taken``."""
    name, n = base, 2
    while name in taken:
        name, n = f"{base}{sep}{n}", n + 1
    return name


def _default_name(fn: object) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "lambda" if name == "<lambda>" else name


def describe_source(source: object) -> str:
    """``source``'s repr for a pipeline's, or its type where the repr is long."""
    text = repr(source)
    return text if len(text) <= 40 else f"<{type(source).__name__}>"
