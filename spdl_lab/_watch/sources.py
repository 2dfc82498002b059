"""What a publisher reads from what it publishes, one interface for all (``sampler``, ``stats``,
``state``, ``set_concurrency``, ``controls``, ``close``), and ``published``, what it returns."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

from .. import _forksafe
from .._experiments.session import Session
from .._integrations import is_spdl_spec, open_spdl
from .._integrations.torch_dataloader import Proxy, WatchedDataLoader, is_dataloader
from .._pipeline import Pipeline
from .._runs import RunOwner
from .._telemetry.probes import CpuProbe, GilProbe
from .._telemetry.sampler import DEFAULT_HZ, Sampler
from .._training import StepClock
from ..errors import PipelineSpecError


def held_weakly(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj``, or a strong one where it takes none (a list, a tuple)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def source_of(obj: Any) -> SessionSource | OwnerSource | LoopSource:
    """The source for ``obj``: a Session, a Loader, an SPDL pipeline, a DataLoader or an iterable."""
    if isinstance(obj, Session):
        return SessionSource(obj)
    if isinstance(obj, RunOwner):
        return OwnerSource(obj)
    if is_spdl_spec(obj):
        monitor, _, _ = open_spdl(obj, None, DEFAULT_HZ, {})
        return OwnerSource(monitor)
    if isinstance(obj, Pipeline):
        raise PipelineSpecError(
            "lab.publish takes what the training loop iterates; a lab.Pipeline runs nothing by "
            "itself: publish lab.Loader(pipeline, runner=...) instead")
    if isinstance(obj, (str, bytes)) or not hasattr(obj, "__iter__"):
        raise PipelineSpecError(
            f"lab.publish takes a lab.Loader, a lab.run Session, a torch DataLoader, an SPDL "
            f"pipeline or another iterable of batches, got {type(obj).__name__}")
    return LoopSource(obj)


class _Epoch(Proxy):
    """One pass of the loop over a published iterable, timed by the step clock; other attributes
    (``len``, torch's ``_workers``) are the iterator's. A step held as the loop lets go ends."""

    def __init__(self, items: Iterator[Any], loop: _TimedLoop, started_ns: int | None) -> None:
        self._of, self._loop = items, loop
        self._timed = loop.clock.iterate_steps(items, started_ns)
        self.ended = False  # it ran out: a script may keep it, but it yields no more

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        if self._loop.cut:
            self._loop.resume()
        try:
            return next(self._timed)
        except StopIteration:
            self.ended = True
            raise

    def close(self) -> None:
        """Its run ends: the step it holds ends; batches the script still asks of it pass untimed
        (``lab.unpublish`` inside the loop stops the publishing, not the loop)."""
        self._timed.close()
        self._timed = self._of


#: Every loop lab.publish times, for ``_TimedLoop.epoch`` to end the steps of the others.
_LOOPS: weakref.WeakSet[_TimedLoop] = weakref.WeakSet()


class _TimedLoop:
    """The step clock and probes of a loop ``lab.publish`` times, one epoch at a time; ``children``
    is the CPU probe's (False, or a callable such as a DataLoader's workers, skips its scan)."""

    def __init__(self, children: Any, clock: StepClock | None = None) -> None:
        self.clock = clock or StepClock()
        self.gil = GilProbe()  # started and stopped by the source; the CPU probe needs neither
        self.sources: list[Any] = [self.clock.rows, self.gil, CpuProbe(children=children)]
        #: whether a step the loop let go of counts at the end (not when the script failed)
        self.left_counts: Callable[[], bool] = lambda: True
        # Weakly: a step held by an iterator the loop drops (a break, a teardown) ends then.
        self._epoch: weakref.ref[_Epoch] | None = None
        self._lock = _forksafe.Lock()
        self._thread: int | None = None  # the thread of its latest epoch
        self.cut = False  # another loop of its thread began an epoch in its step (``resume``)
        _LOOPS.add(self)

    def epoch(self, items: Iterator[Any], started_ns: int | None = None) -> _Epoch:
        """Time the loop over ``items`` (made at ``started_ns``, ``perf_counter_ns``, if known). A
        step still held from the epoch before (a trainer that stops at its length) ended then, and
        so did a step another loop of this thread holds: Lightning runs its validation loop while
        the training loop holds its last batch, and training's next epoch while validation holds
        its own; neither is the other's step."""
        self._thread, self.cut = threading.get_ident(), False
        for loop in list(_LOOPS):
            if loop is self or loop._thread == self._thread:
                loop.cut = loop is not self and loop.clock.undecided
                loop.clock.leave(started_ns)
        epoch = _Epoch(items, self, started_ns)
        self._replace(weakref.ref(epoch))
        return epoch

    def resume(self) -> None:
        """The loop goes on with the epoch another loop of its thread cut into (Lightning runs its
        validation inside a training epoch, ``val_check_interval``): that loop's last step, held
        until now, ended."""
        self.cut = False
        for loop in list(_LOOPS):
            if loop is not self and loop._thread == self._thread:
                loop.clock.leave()

    def idle(self) -> bool:
        """No epoch open: none began, or the last one ran out or the loop let go of it (a loop
        that keeps its iterator, ``it = iter(DataLoader(...))``, holds it until the next one)."""
        epoch = self._epoch() if self._epoch is not None else None
        return epoch is None or epoch.ended

    def close(self) -> None:
        """The run ends: a step let go of or still held counts, unless ``left_counts`` says no."""
        _LOOPS.discard(self)  # an epoch the script goes on with after (see _Epoch.close) ends no
        self.cut = False  # other loop's step
        self._replace(None)
        self.clock.settle(counted=self.left_counts())

    def _replace(self, epoch: weakref.ref[_Epoch] | None) -> None:
        """Close the epoch before if still open; one inside ``next()`` (a signal handler closes the
        run while the loop waits for data) holds no step to end."""
        with self._lock:
            previous, self._epoch = self._epoch, epoch
        still_open = previous() if previous is not None else None
        if still_open is not None:
            with contextlib.suppress(ValueError):  # "generator already executing"
                still_open.close()


class SessionSource:
    """A ``lab.run`` Session, published as it is and steered live, with its own clock and probes."""

    def __init__(self, obj: Any) -> None:
        self.published = self.obj = obj
        self.runner = obj.runner
        self.clock: StepClock = getattr(obj, "clock", None) or StepClock()
        self.set_concurrency, self.controls = obj.set_concurrency, obj.controls

    def sampler(self) -> Sampler | None:
        return self.obj.sampler

    def stats(self) -> dict[str, Any]:
        return self.obj.stats().to_dict()

    def state(self) -> str:
        return self.obj.state

    def dropped(self) -> bool:
        return False  # held here: it ends by its own stop() or end

    def close(self) -> None:
        pass  # the session's own stop() or end closes what it started


class OwnerSource(SessionSource):
    """A ``lab.Loader`` (or an SPDL pipeline monitored as SPDL runs it): stage meters from its runs,
    steps timed around each run's iterator (``RunOwner.consumer``), clock and probes sampled."""

    def __init__(self, owner: Any) -> None:
        super().__init__(owner)
        self.runner = owner.runner or "iterable"
        self.loop = _TimedLoop(children=self.runner != "thread")
        self.clock = self.loop.clock
        for source in self.loop.sources:
            owner.add_source(source)
        owner.consumer = self.loop.epoch
        self.loop.gil.start()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "step": self.loop.clock.summary().to_dict()}

    def state(self) -> str:
        """"running" until the Loader is closed (between epochs too), then "finished"."""
        return "finished" if self.obj.state == "closed" else "running"

    def close(self) -> None:
        self.loop.close()
        self.obj.consumer = None
        for source in self.loop.sources:
            self.obj.remove_source(source)
        self.loop.gil.stop()


class LoopSource:
    """Any other iterable, above all a DataLoader: ``next()`` is data wait, holding a batch is the
    step, a DataLoader's workers are read for CPU; its own sampler. ``before``: the closed source
    of the run it goes on with (``Publisher``), whose clock, stage totals and time carry on."""

    def __init__(self, iterable: Any, before: LoopSource | None = None) -> None:
        # Weakly: its user dropping it (a loop that makes a DataLoader each epoch) ends the run.
        self._obj = held_weakly(iterable)
        self.workers = (WatchedDataLoader(iterable, weakly=True, before=before and before.workers)
                        if is_dataloader(iterable) else None)
        self.loop = _TimedLoop(self.workers.processes if self.workers is not None else True,
                               before.clock if before is not None else None)
        self._elapsed_before = before.elapsed_s if before is not None else 0.0
        self.clock = self.loop.clock
        from_spdl = type(iterable).__module__.split(".")[0] == "spdl"
        self.runner = ("DataLoader" if self.workers is not None else "spdl" if from_spdl
                       else type(iterable).__name__)
        workers = [self.workers] if self.workers is not None else []
        self._sampler = Sampler([*self.loop.sources, *workers], hz=DEFAULT_HZ)
        self._closed = False
        self._published = weakref.ref(PublishedLoop(self))
        self.loop.gil.start()
        self._sampler.start()

    @property
    def published(self) -> PublishedLoop:
        """What ``publish`` returns; held weakly, so that dropping it and the iterable ends them
        as it would without the lab (a DataLoader's workers stop then, not at a collection)."""
        loop = self._published()
        if loop is None:
            loop = PublishedLoop(self)
            self._published = weakref.ref(loop)
        return loop

    def open_epoch(self, make: Callable[[], Iterator[Any]]) -> _Epoch:
        """Time one pass over ``make()``; a DataLoader's workers start metered, their start-up
        counted as the first batch's data wait."""
        started_ns = time.perf_counter_ns()
        items = self.workers.open(make) if self.workers is not None else make()
        return self.loop.epoch(items, started_ns)

    @property
    def obj(self) -> Any:
        return self._obj()

    def dropped(self) -> bool:
        """Its user let go of the iterable and its last epoch ended whole: the run is over. An
        epoch left mid-way waits for the script's end, which says whether its last step counts."""
        return self._obj() is None and self.loop.idle() and not self.clock.undecided

    def sampler(self) -> Sampler | None:
        return self._sampler

    @property
    def elapsed_s(self) -> float:
        """Seconds sampled, the runs it goes on with included."""
        return self._elapsed_before + self._sampler.elapsed_s

    def stats(self) -> dict[str, Any]:
        step = self.loop.clock.summary().to_dict()
        elapsed = self.elapsed_s
        stages = self.workers.stages(elapsed).values() if self.workers is not None else ()
        return {"runner": self.runner, "running": not self._closed, "elapsed_s": elapsed,
                "items_out": step["steps"], "stages": [asdict(s) for s in stages], "step": step}

    def state(self) -> str:
        return "finished" if self._closed else "running"

    def set_concurrency(self, stage: str, n: int) -> None:
        if self.workers is not None:
            raise PipelineSpecError(
                "a torch DataLoader cannot change its workers while it runs: num_workers is fixed "
                "when an epoch starts. Set num_workers=N where the script builds the DataLoader and "
                "restart it, or bring the dataset to the lab (lab.from_dataloader(dl) under the "
                "thread or subprocess-threads runner), whose concurrency changes live")
        raise PipelineSpecError(
            f"this run iterates a {self.runner}: it has no stage whose concurrency the lab can set; "
            f"publish a lab.Loader to steer it")

    def controls(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self.loop.close()  # before the sampler's last tick, which then counts the step it held
        self._closed = True
        self._sampler.stop()
        self.loop.gil.stop()
        if self.workers is not None:
            self.workers.close()


class PublishedLoop(Proxy):
    """What ``lab.publish`` returns for a DataLoader or another iterable: each ``for`` over it is an
    epoch, timed; ``len()`` and attributes are the original's."""

    def __init__(self, source: LoopSource) -> None:
        self._source = source
        self._of = source.obj

    def __iter__(self) -> Iterator[Any]:
        return self._source.open_epoch(lambda: iter(self._of))

    def __repr__(self) -> str:
        return f"published({self._of!r})"
