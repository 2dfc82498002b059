"""``lab.diagnose``: each stage alone, fed cached inputs, swept over concurrency; a verdict per stage.
A stage that hangs is cut off, one that raises is reported with its traceback, and the stages after
either are reported as not measured."""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import cloudpickle

from .._experiments.comparison import BUSY_MACHINE
from .._experiments.session import sessions_paused
from .._interpreter import describe
from .._pipeline import MAX_CONCURRENCY, Pipeline, Stage, check_ints
from .._progress import progress_bar
from .._runners.children import ChildGone, ChildTraceback, exit_reason, receive, spawn
from .._telemetry.probes import GilProbe
from ..errors import PipelineError, PipelineSpecError, RunnerError, SpdlLabError, stage_failure
from ._sweep import StageFeed, StageSweep, Sweep, SweepSettings
from .result import FAR_FASTER, Diagnosis, Point, StageDiagnosis, judge, limiting, rises, usable

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
DEFAULT_NUM_ITEMS = 100
PROCESS_START_S = 0.5  # kept back for a stage's process sweep besides its windows
SLOW_SPELLS = 0.25  # a thread point's window spread above this is named in the notes
_MISSING = object()


def diagnose(pipeline: Pipeline, concurrency: Sequence[int] = DEFAULT_CONCURRENCY, *,
             num_items: int = DEFAULT_NUM_ITEMS, processes: bool = True,
             process_concurrency: Sequence[int] | None = None, settings: SweepSettings | None = None,
             progress: bool = True, isolated: bool = True) -> Diagnosis:
    """Profile each stage of ``pipeline`` alone, in threads and (where threads do not help) in
    worker processes at ``process_concurrency`` (default: 1 and the core count), and say what
    limits it. It runs in a clean child interpreter unless ``isolated=False`` or the pipeline
    cannot be pickled there; this kernel's running sessions are paused meanwhile. Example::

        diag = lab.diagnose(p, concurrency=(1, 2, 4, 8, 16))
        diag.stages["decode"].verdict          # "scales" | "cpu-bound" | "gil-bound" | "contended"
        diag.table; diag.plot(); diag.to_html("report.html"); diag.to_json("report.json")
    """
    if not isinstance(pipeline, Pipeline):
        raise PipelineSpecError(f"diagnose takes a lab.Pipeline, got {type(pipeline).__name__}; "
                                "for a DataLoader use lab.from_dataloader(dl)")
    concurrency = _check_levels("concurrency", concurrency)
    cores = os.cpu_count() or 1
    levels = process_concurrency if process_concurrency is not None else {1, min(cores, max(concurrency))}
    process_levels = _check_levels("process_concurrency", levels)
    check_ints("diagnose", num_items=(num_items, 1))
    options = dict(concurrency=concurrency, num_items=num_items, processes=processes,
                   process_concurrency=process_levels, settings=settings or SweepSettings())
    payload = None
    with contextlib.suppress(Exception):  # unpicklable: measured here; settings["isolated"] says so
        payload = cloudpickle.dumps(pipeline) if isolated else None
    with sessions_paused() as paused:
        if payload is not None:
            diag = diagnose_in_child(payload, options, progress)
        else:
            diag = diagnose_here(pipeline, **options, isolated=False,
                                 bar_factory=lambda total, unit: progress_bar(total, progress, unit))
    diag.settings["paused_sessions"] = paused
    return diag


def diagnose_in_child(payload: bytes, options: dict[str, Any], progress: bool) -> Diagnosis:
    """``diagnose_here`` in a clean child (``_isolated_child``): this kernel's threads would take the
    GIL and its heap lengthen the collector's pauses. Ctrl-C, an error or a timeout stops the child."""
    folder = tempfile.TemporaryDirectory(prefix="spdl_lab_diagnose_", ignore_cleanup_errors=True)
    child = spawn(["-m", "spdl_lab._diagnose._isolated_child"])
    bar = None
    try:
        child.ctrl.send({"pipeline": payload, "options": options, "sys_path": list(sys.path),
                         "cwd": os.getcwd(), "result": str(Path(folder.name) / "diagnosis.json")})
        while True:
            try:  # no deadline of its own: the sweep's budget and point timeouts bound the child
                kind, *args = receive(child, math.inf)
            except ChildGone:
                raise RunnerError(f"diagnose: the child interpreter measuring the stages "
                                  f"{exit_reason(child.proc, 5.0)} before it finished; if it ran out of "
                                  f"memory, pass a smaller num_items=") from None
            if kind == "total":
                bar = progress_bar(args[0], progress, args[1])
            elif kind in ("set_description", "update") and bar is not None:
                getattr(bar, kind)(*args)  # the child's bar, a call at a time
            elif kind == "done":
                return Diagnosis.from_json(args[0])
            elif kind == "error":
                raise _child_error(*args)
    finally:
        if bar is not None:
            bar.close()
        child.close(timeout=3.0)
        folder.cleanup()


def _child_error(kind: str, message: str, text: str, stage: str | None, index: int | None) -> SpdlLabError:
    if kind == "PipelineError":  # worded by stage_failure in the child
        error: SpdlLabError = stage_failure(stage or "", index, None, message=message)
    elif kind == "PipelineSpecError":
        error = PipelineSpecError(message)
    else:
        error = SpdlLabError(f"diagnose failed in its child interpreter: {kind}: {message}")
    error.__cause__ = ChildTraceback(text)
    return error


def diagnose_here(pipeline: Pipeline, concurrency: tuple[int, ...], *, num_items: int, processes: bool,
                  process_concurrency: tuple[int, ...], settings: SweepSettings,
                  bar_factory: Callable[[int, str], Any], isolated: bool = True) -> Diagnosis:
    """The measurement, in this interpreter (the child's, from ``diagnose``)."""
    cores = os.cpu_count() or 1
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    begun = time.monotonic()
    inputs = _collect(pipeline, num_items)
    maps = [s for s in pipeline.stages if s.kind == "map"]
    deadline = begun + settings.stage_budget_s * len(maps)
    procs = process_concurrency if processes else ()
    # The thread sweep leaves room for every stage's process sweep.
    point_s = settings.warmup_s + settings.min_windows * settings.window_s
    reserve = len(maps) * (PROCESS_START_S + len(procs) * point_s) if procs else 0.0
    # A fixed total: process windows count from the start; what a stage leaves is added at the end.
    per_stage = (len(concurrency) + len(procs)) * settings.max_windows
    bar = bar_factory(len(maps) * per_stage, "window")
    probe = GilProbe()
    probe.start()
    sweep = Sweep(settings, probe=probe, on_window=bar.update)
    try:
        bar.set_description("first pass")
        done, passes = _passes(pipeline, inputs, settings)
        bar.update(per_stage * (len(maps) - len(passes)))
        bar.set_description("threads")
        for p in passes:
            sweep.add(p.feed, "thread", concurrency, deadline - reserve)
        _rounds(sweep, [p.feed for p in passes], procs, deadline, cores, bar)
        bar.set_description("done")
        bar.update(max(0, bar.total - bar.n))
    finally:
        sweep.close()
        probe.stop()
        bar.close()
    threads, in_processes = sweep.results("thread"), sweep.results("process")
    for p in passes:
        done[p.stage.name] = _judge(p, threads[p.feed.name], in_processes.get(p.feed.name), cores, settings)
    interp = describe()
    stages = _only_where_it_counts({s.name: done[s.name] for s in pipeline.stages})
    return Diagnosis(
        pipeline=repr(pipeline), stages=stages, created=started, elapsed_s=time.monotonic() - begun,
        settings={"concurrency": list(concurrency), "process_concurrency": list(process_concurrency),
                  "num_items": num_items, "inputs_collected": len(inputs),
                  **{k: v for k, v in asdict(settings).items() if k not in ("max_inputs", "start_timeout_s")},
                  "isolated": isolated},
        machine={"cpu_cores": cores, "python": interp.python, "gil": interp.gil,
                 "torch": interp.torch or ""},
    )


@dataclass
class StageRun:
    """One pass of a stage over its inputs: what the next stage gets, and what went wrong."""

    outputs: list[Any]
    ok_inputs: list[Any]  # the inputs that did not raise: what the sweep is fed
    failures: int
    first_error: str | None  # traceback text of the first failure
    hung: bool  # an item did not finish within the timeout
    abandoned_threads: int


def run_once(fn: Callable[[Any], Any], inputs: Sequence[Any], *, workers: int, timeout_s: float) -> StageRun:
    """The first pass: ``fn`` on every input, ``workers`` threads at a time, in order; items that
    raise are dropped, and what raised or hung is reported, not swept."""
    n = len(inputs)
    results: list[Any] = [_MISSING] * n
    errors: list[str | None] = [None] * n
    counter = itertools.count()
    progress = threading.Event()
    done = threading.Event()

    def work() -> None:
        while not done.is_set():
            if (i := next(counter)) >= n:
                return
            try:
                results[i] = fn(inputs[i])
            except Exception:
                errors[i] = traceback.format_exc()
            progress.set()

    threads = [threading.Thread(target=work, name=f"spdl_lab:diagnose-pass-{i}", daemon=True)
               for i in range(min(workers, max(1, n)))]
    for t in threads:
        t.start()
    hung = False
    while any(t.is_alive() for t in threads):
        progress.clear()
        if not progress.wait(timeout_s) and any(t.is_alive() for t in threads):
            hung = True
            break
    done.set()
    ok = [i for i in range(n) if errors[i] is None and results[i] is not _MISSING]
    return StageRun([results[i] for i in ok], [inputs[i] for i in ok], sum(e is not None for e in errors),
                    next((e for e in errors if e is not None), None), hung, sum(t.is_alive() for t in threads))


@dataclass
class _Pass:
    """A map stage that ran over its inputs once and can be swept."""

    stage: Stage
    inputs: int  # what it was fed
    feed: StageFeed  # the inputs that did not raise
    once: StageRun
    per_input: int = 1  # source items per input


def _passes(pipeline: Pipeline, inputs: list[Any],
            settings: SweepSettings) -> tuple[dict[str, StageDiagnosis], list[_Pass]]:
    """Every stage once, each on the outputs of the one before: the stages already settled
    (batches, failed ones and those after them) and the map stages to sweep."""
    done: dict[str, StageDiagnosis] = {}
    passes: list[_Pass] = []
    blocked: str | None = None  # why the stages after a failed one cannot be measured
    per_input = 1  # source items per input of the current stage
    for stage in pipeline.stages:
        if blocked is not None:
            done[stage.name] = StageDiagnosis(name=stage.name, kind=stage.kind, verdict=None, best_concurrency=None,
                                              evidence=f"not measured: {blocked}", recommendation="",
                                              error=f"not measured: {blocked}", status="not measured")
        elif stage.kind == "batch":
            inputs, done[stage.name] = _batch(stage, inputs)
            per_input *= stage.size or 1
        else:
            once = run_once(stage.fn, inputs, workers=stage.concurrency, timeout_s=settings.point_timeout_s)
            if (failed := _failed_pass(stage, inputs, once, settings, per_input)) is None:
                passes.append(_Pass(stage, len(inputs), StageFeed(stage.name, stage.fn, once.ok_inputs), once,
                                    per_input))
            else:
                # A stage that raised gets no verdict: timing its exceptions would measure the
                # error path. What it did produce still feeds the stages after it.
                done[stage.name] = failed
                if once.hung or not once.outputs:
                    blocked = f"no inputs: stage {stage.name!r} produced none ({failed.evidence.split(';')[0]})"
            inputs = once.outputs
    return done, passes


def _failed_pass(stage: Stage, inputs: list[Any], once: StageRun, settings: SweepSettings,
                 per_input: int) -> StageDiagnosis | None:
    if once.hung:
        error = (f"an item did not finish within {settings.point_timeout_s:g} s; the stage was cut off"
                 f" ({once.abandoned_threads} thread(s) stuck in it were left running as daemons)")
        evidence, advice = f"failed: {error}", "find why it blocks (a lock, a network call without a timeout)"
    elif once.failures:
        kind = (once.first_error or "").strip().splitlines()[-1].split(":", 1)[0].strip() or "an exception"
        error, evidence = once.first_error, f"failed: {kind} on {once.failures} of {len(inputs)} inputs"
        advice = "fix the error (first traceback below), then diagnose again"
    else:
        return None
    return StageDiagnosis(name=stage.name, kind="map", verdict=None, best_concurrency=None, evidence=evidence,
                          recommendation=advice, error=error, inputs=len(inputs), outputs=len(once.outputs),
                          status="failed", concurrency=stage.concurrency, items_per_input=per_input)


def _rounds(sweep: Sweep, feeds: Sequence[StageFeed], process_levels: Sequence[int], deadline: float,
            cores: int, bar: Any) -> None:
    """Rounds until every point is done; a stage's process points join once its thread points
    say threads do not help."""
    while True:
        sweep.round()
        threads = sweep.results("thread")
        for feed in feeds:
            points = [pt for pt in threads[feed.name].points if pt.repeats or pt.status == "timeout"]
            if not process_levels or sweep.has(feed.name, "process") or any(p.status == "timeout" for p in points):
                continue
            # Threads do not help: the stage does not rise, or its threads wait for the GIL or a lock.
            if not rises(points, cores) or judge(points, cores=cores).verdict in ("gil-bound", "contended"):
                sweep.add(feed, "process", process_levels, deadline)
        if sweep.done():
            return
        if sweep.done("thread"):
            bar.set_description("processes")


def _judge(p: _Pass, threads: StageSweep, processes: StageSweep | None, cores: int,
           settings: SweepSettings) -> StageDiagnosis:
    points = threads.points
    process_points = processes.points if processes is not None and processes.error is None else []
    verdict = judge(points, process_points, cores=cores)
    notes = [verdict.details] if verdict.details else []
    if processes is not None and processes.error is not None:  # the thread verdict stands
        notes.append(f"Processes were not tried: {processes.error}")
    elif processes is not None and processes.notes:
        notes.append(f"Processes: {processes.notes[0]}")
    if timeouts := [pt.concurrency for pt in points if pt.status == "timeout"]:
        notes.append(f"At concurrency {timeouts[0]} no task finished within {settings.point_timeout_s:g} s; "
                     f"higher concurrency was not tried.")
    if threads.abandoned:
        notes.append(f"{threads.abandoned} thread(s) stuck in the function were left running as daemons.")
    spells = [pt for pt in points if pt.status in ("ok", "unstable") and pt.qps_spread > SLOW_SPELLS]
    if spells:
        worst = max(spells, key=lambda pt: pt.qps_spread)
        notes.append(f"The windows of {len(spells)} of its {len(points)} thread points differed by more than "
                     f"{SLOW_SPELLS:.0%} (up to {worst.qps_spread:.0%} at concurrency {worst.concurrency}): the "
                     f"machine's speed moved, or its inputs differ in cost; a point's QPS is its second-best window.")
    if threads.others >= BUSY_MACHINE:
        notes.append(f"Other processes used up to {threads.others:.0%} of the cores while it was measured.")
    status, advice, shown, evidence = "measured", verdict.recommendation, verdict.verdict, verdict.evidence
    if (busy := others_share(points)) >= BUSY_MACHINE:
        # What other processes take moves every rate and share a verdict reads: no verdict, no advice.
        status, shown = "unstable", None
        evidence = f"unstable: the machine was busy (other processes used {busy:.0%} of the cores)"
        advice = "diagnose it again on a quieter machine"
        notes.append(f"Under that load it measured as {verdict.verdict}: {verdict.evidence}")
    elif _unstable(points):
        status = "unstable"
        advice = (f"measure again (its windows did not settle, so no advice is given): diagnose it with "
                  f"settings=lab.SweepSettings(max_windows={2 * settings.max_windows}, "
                  f"stage_budget_s={2 * settings.stage_budget_s:g}) on a quieter machine")
    return StageDiagnosis(name=p.stage.name, kind="map", verdict=shown,
                          best_concurrency=verdict.best_concurrency, evidence=evidence,
                          recommendation=advice, points=tuple(points) + tuple(process_points),
                          error=None, inputs=p.inputs, outputs=len(p.once.outputs), status=status,
                          notes=tuple(notes), concurrency=p.stage.concurrency, items_per_input=p.per_input)


def others_share(points: Sequence[Point]) -> float:
    """The share of the cores other processes took while the thread points were measured: the
    median over the points (each its windows' median), 0 where unknown."""
    shares = [pt.machine_cpu_util - pt.cpu_util for pt in usable(points)
              if math.isfinite(pt.machine_cpu_util) and math.isfinite(pt.cpu_util)]
    return max(0.0, statistics.median(shares)) if shares else 0.0


def _unstable(points: Sequence[Point]) -> bool:
    """The deciding points did not settle: the best thread point, or most of them, is unstable."""
    ok = usable(points)
    return bool(ok) and (max(ok, key=lambda pt: pt.qps).status == "unstable"
                         or 2 * sum(pt.status == "unstable" for pt in ok) > len(ok))


def _only_where_it_counts(stages: dict[str, StageDiagnosis]) -> dict[str, StageDiagnosis]:
    """Advice only for stages whose change would change the pipeline's rate (``result.limiting``)."""
    if (found := limiting(stages.values())) is None:
        return stages
    slowest, rate, *_ = found
    out = {}
    for name, st in stages.items():
        mine = st.rate_now()
        if st is not slowest and st.verdict is not None and mine >= FAR_FASTER * rate:
            note = (f"{mine / rate:.1f}x faster than the limiting stage {slowest.name!r} at its concurrency: "
                    f"changing it does not change the pipeline's rate, so no advice.")
            st = replace(st, recommendation="", notes=(*st.notes, note))
        out[name] = st
    return out


def _batch(stage: Stage, items: list[Any]) -> tuple[list[Any], StageDiagnosis]:
    size = stage.size or 1
    batches = [items[i:i + size] for i in range(0, len(items), size)]
    if stage.drop_last and batches and len(batches[-1]) < size:
        batches.pop()
    note = f"grouped {len(items)} items into {len(batches)} batches of up to {size}; batching is not measured"
    return batches, StageDiagnosis(name=stage.name, kind="batch", verdict=None, best_concurrency=None,
                                   evidence=note, recommendation="", inputs=len(items), outputs=len(batches),
                                   status="batch")


def _collect(pipeline: Pipeline, num_items: int) -> list[Any]:
    items: list[Any] = []
    try:
        items.extend(itertools.islice(pipeline.open_source(), num_items))
    except Exception as exc:
        raise PipelineError(
            f"diagnose: the source raised while collecting {num_items} inputs (after {len(items)}): "
            f"{type(exc).__name__}: {exc}",
            stage="source", index=len(items),
        ) from exc
    if not items:
        raise PipelineSpecError("diagnose: the source produced no items; nothing to feed the stages")
    return items


def _check_levels(name: str, levels: Sequence[int]) -> tuple[int, ...]:
    values: tuple = ()
    with contextlib.suppress(TypeError):
        values = tuple(levels)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_CONCURRENCY
                         for v in values):
        raise PipelineSpecError(f"diagnose: {name} must be ints in 1..{MAX_CONCURRENCY} (a sequence, e.g. "
                                f"(1, 2, 4, 8, 16)); got {levels!r}")
    return tuple(sorted(set(values)))

