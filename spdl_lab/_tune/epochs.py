"""A training loop's epochs over a finite loader: ``Passes`` iterates the Loader again when a pass
ends and notes which batch began each; ``epoch_rate`` charges each batch its share of one restart,
so a configuration whose restarts cost more (workers starting again) is slower by what they cost."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from .._experiments.contender import Window
from .._pipeline import Pipeline
from ..errors import SpdlLabError

__all__ = ["EpochWindow", "Passes", "endless", "epoch_rate", "restart_extras"]


@dataclass(frozen=True)
class EpochWindow(Window):
    """A measured window whose rate is ``epoch_rate``: each of its batches pays its share of an
    epoch restart, and a restart inside it is not paid twice."""

    rate: float = math.nan
    restart_s: float = math.nan  # the restart's extra seconds charged (NaN: no restart known)
    steady_s: float = math.nan  # the mean seconds of its steps that began no pass

    @property
    def batches_per_s(self) -> float:
        return self.rate


class Passes:
    """Batches of ``loader``, pass after pass, without end; ``epoch_batches`` is the length of a
    pass when known beforehand (``len(dataloader)``), else that of the first pass that ends."""

    def __init__(self, loader: Any, epoch_batches: int | None = None, who: str = "tune") -> None:
        self.loader = loader
        self.epoch_batches = epoch_batches
        self.who = who
        self.yielded = 0  # batches handed out, all passes together
        self.passes = 0
        #: the number (in ``yielded`` order) of the batch that began each pass after the first
        self.restarts: list[int] = []
        self._it: Iterator[Any] | None = None
        self._in_pass = 0

    def __iter__(self) -> Passes:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._begin()
        try:
            batch = next(self._it)
        except StopIteration:
            if self.loader.state == "closed":  # closed (a timeout's watchdog): no new epoch
                raise
            if self._in_pass == 0:
                raise SpdlLabError(f"{self.who}: a pass of the {self.loader.runner!r} runner gave no batch; "
                                   f"the source ran out. Pass a re-iterable source (a list, a Dataset, a "
                                   f"sampler) or a zero-argument callable returning a fresh iterator") from None
            if self.epoch_batches is None:
                self.epoch_batches = self._in_pass
            self._begin()
            self.restarts.append(self.yielded)
            return self.__next__()
        self.yielded += 1
        self._in_pass += 1
        return batch

    def _begin(self) -> None:
        self._it = iter(self.loader)
        self.passes += 1
        self._in_pass = 0


def restart_extras(records: Iterable[Any], first: int, restarts: Iterable[int]) -> tuple[list[float], float]:
    """The extra seconds of each restart step among ``records`` (numbered from ``first``) beyond a
    steady step, and a steady step's mean seconds (data wait and step)."""
    records = list(records)
    at = {b - first for b in restarts if 0 <= b - first < len(records)}
    steady = [r.data_wait_s + r.step_s for i, r in enumerate(records) if i not in at]
    mean = sum(steady) / len(steady) if steady else math.nan
    extras = [max(0.0, records[i].data_wait_s + records[i].step_s - mean) for i in sorted(at)] if steady else []
    return extras, mean


def epoch_rate(steady_s: float, restart_s: float, epoch_batches: int | None) -> float:
    """Batches/s over whole epochs: a steady step of ``steady_s`` plus its share of one restart."""
    if not steady_s > 0:
        return math.nan
    share = restart_s / epoch_batches if epoch_batches and math.isfinite(restart_s) else 0.0
    return 1.0 / (steady_s + share)


def endless(pipeline: Pipeline) -> Pipeline:
    """``pipeline`` whose source starts its next pass where the last one ends: one run over every
    epoch, as DataLoader workers kept up (``persistent_workers=True``) see them."""
    looped = Pipeline(partial(_passes, Pipeline(pipeline.source)))
    for s in pipeline.stages:
        if s.kind == "map":
            looped = looped.map(s.fn, concurrency=s.concurrency, name=s.name, ordered=s.ordered)
        else:
            looped = looped.batch(s.size, drop_last=s.drop_last, name=s.name)
    return looped


def _passes(source: Pipeline) -> Iterator[Any]:
    """The source's items, pass after pass; it ends only if a pass is empty."""
    while True:
        empty = True
        for item in source.open_source():
            empty = False
            yield item
        if empty:
            return
