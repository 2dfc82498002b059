"""``lab.diagnose``: each stage alone, fed cached inputs, swept over concurrency; a verdict per stage.

The source runs once to collect ``num_items`` inputs; each stage is fed the
outputs of the stage before. A stage that hangs is cut off (its points marked
``timeout``), a stage that raises is reported with its traceback, and the
stages after either are reported as not measured. Rules: ``verdict_rules``.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

from ..errors import PipelineError, PipelineSpecError, RunnerError
from ..interpreter import describe
from ..pipeline import MAX_CONCURRENCY, Pipeline, Stage
from ..telemetry.probes import GilProbe
from ._progress import progress_bar
from ._thread_sweep import SweepSettings, measure_threads, run_once
from .diagnosis import Diagnosis, Point, StageDiagnosis
from .verdict_rules import judge, rises

__all__ = ["DEFAULT_CONCURRENCY", "DEFAULT_NUM_ITEMS", "diagnose"]

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
DEFAULT_NUM_ITEMS = 100
#: Share of the cores used by other processes during a point above which the
#: evidence warns that the machine was busy.
BUSY_MACHINE = 0.25


def diagnose(
    pipeline: Pipeline,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    *,
    num_items: int = DEFAULT_NUM_ITEMS,
    processes: bool = True,
    process_concurrency: Sequence[int] | None = None,
    settings: SweepSettings | None = None,
    progress: bool = True,
) -> Diagnosis:
    """Profile each stage of ``pipeline`` alone and say what limits it.

    Example::

        diag = lab.diagnose(p, concurrency=(1, 2, 4, 8, 16))
        diag.stages["decode"].verdict          # "scales" | "cpu-bound" | "gil-bound" | "contended"
        diag.stages["decode"].best_concurrency
        diag.table; diag.plot(); diag.to_html("report.html"); diag.to_json("report.json")

    Each point warms up, then measures windows until the last three agree
    within 5% (``settings``), so start-up never counts. Stages whose thread
    throughput does not rise are also run by worker processes at
    ``process_concurrency`` (default: 1 and the core count), to tell whether
    processes would help (``processes=False`` skips that).
    """
    if not isinstance(pipeline, Pipeline):
        raise PipelineSpecError(f"diagnose takes a lab.Pipeline, got {type(pipeline).__name__}")
    concurrency = _check_levels("concurrency", concurrency)
    cores = os.cpu_count() or 1
    process_levels = _check_levels(
        "process_concurrency",
        process_concurrency if process_concurrency is not None else sorted({1, min(cores, max(concurrency))}),
    )
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 1:
        raise PipelineSpecError(f"diagnose: num_items must be an int >= 1, got {num_items!r}")
    settings = settings or SweepSettings()
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()

    inputs = _collect(pipeline, num_items)
    collected = len(inputs)
    maps = [s for s in pipeline.stages if s.kind == "map"]
    bar = progress_bar(len(maps) * len(concurrency), progress, "point")
    probe = GilProbe()
    probe.start()
    stages: dict[str, StageDiagnosis] = {}
    blocked: str | None = None  # why the stages after a failed one cannot be measured
    try:
        for stage in pipeline.stages:
            if blocked is not None:
                stages[stage.name] = _not_measured(stage, blocked)
                bar.update(len(concurrency) if stage.kind == "map" else 0)
                continue
            if stage.kind == "batch":
                inputs, stages[stage.name] = _batch(stage, inputs)
                continue
            bar.set_description(stage.name)
            result, inputs = _diagnose_map(stage, inputs, concurrency, process_levels, processes,
                                           settings, probe, cores, bar)
            stages[stage.name] = result
            if not inputs:
                blocked = f"no inputs: stage {stage.name!r} produced none ({_short(result)})"
    finally:
        probe.stop()
        bar.close()
    interp = describe()
    return Diagnosis(
        pipeline=repr(pipeline), stages=stages, created=started, elapsed_s=time.perf_counter() - t0,
        settings={"concurrency": list(concurrency), "process_concurrency": list(process_levels),
                  "num_items": num_items, "inputs_collected": collected,
                  "warmup_s": settings.warmup_s, "window_s": settings.window_s,
                  "min_windows": settings.min_windows, "max_windows": settings.max_windows,
                  "stable_within": settings.stable_within, "point_timeout_s": settings.point_timeout_s},
        machine={"cpu_cores": cores, "python": interp.python, "gil": interp.gil,
                 "torch": interp.torch or ""},
    )


def _diagnose_map(
    stage: Stage, inputs: list[Any], concurrency: Sequence[int], process_levels: Sequence[int],
    processes: bool, settings: SweepSettings, probe: GilProbe, cores: int, bar: Any,
) -> tuple[StageDiagnosis, list[Any]]:
    fn = stage.fn
    assert fn is not None
    once = run_once(fn, inputs, workers=stage.concurrency, timeout_s=settings.point_timeout_s)
    common = dict(name=stage.name, kind="map", inputs=len(inputs), outputs=len(once.outputs))
    if once.hung:
        bar.update(len(concurrency))
        why = (f"an item did not finish within {settings.point_timeout_s:g} s; the stage was cut off"
               f" ({once.abandoned_threads} thread(s) stuck in it were left running as daemons)")
        return StageDiagnosis(verdict=None, best_concurrency=None, evidence=why,
                              recommendation="find why it blocks (a lock, a network call without a timeout)",
                              error=why, **common), []
    if not once.outputs:
        bar.update(len(concurrency))
        return StageDiagnosis(verdict=None, best_concurrency=None,
                              evidence=f"every one of its {len(inputs)} inputs raised",
                              recommendation="fix the error below", error=once.first_error, **common), []
    feed = once.ok_inputs
    points, abandoned, others = measure_threads(stage.name, fn, feed, concurrency, probe=probe, settings=settings,
                                        mean_task_s=once.mean_task_s, on_point=lambda _: bar.update(1))
    bar.update(len(concurrency) - len(points))
    process_points: list[Point] = []
    process_note = ""
    # Processes are tried where threads do not help: the stage does not rise,
    # or the GIL is what its threads wait for.
    threads_only = judge(points, cores=cores).verdict
    worth_trying = not rises(points, cores) or threads_only in ("gil-bound", "contended")
    if processes and worth_trying and not any(p.status == "timeout" for p in points):
        from ._process_sweep import measure_processes

        bar.set_description(f"{stage.name} (processes)")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                process_points = measure_processes(
                    stage.name, fn, feed, process_levels, warmup_s=settings.warmup_s,
                    window_s=settings.window_s, min_windows=settings.min_windows,
                    max_windows=settings.max_windows, stable_within=settings.stable_within,
                    point_timeout_s=settings.point_timeout_s,
                )
            if caught:
                process_note = f" Processes: {caught[0].message}"
        except (PipelineSpecError, RunnerError) as exc:
            # The thread verdict stands; say why processes could not be tried.
            process_note = f" Processes were not tried: {exc}"
    verdict = judge(points, process_points, cores=cores)
    evidence, error = verdict.evidence + process_note, None
    if once.failures:
        evidence += f" {once.failures} of {len(inputs)} inputs raised and were dropped (first traceback below)."
        error = once.first_error
    timeouts = [p.concurrency for p in points if p.status == "timeout"]
    if timeouts:
        evidence += (f" At concurrency {timeouts[0]} no task finished within {settings.point_timeout_s:g} s;"
                     f" higher concurrency was not tried.")
    if abandoned:
        evidence += f" {abandoned} thread(s) stuck in the function were left running as daemons."
    if others >= BUSY_MACHINE:
        evidence += (f" Other processes used up to {others:.0%} of the cores while it was measured:"
                     f" these numbers may be low; diagnose again on a quiet machine.")
    return StageDiagnosis(verdict=verdict.verdict, best_concurrency=verdict.best_concurrency,
                          evidence=evidence, recommendation=verdict.recommendation,
                          points=tuple(points) + tuple(process_points), error=error, **common), once.outputs


def _batch(stage: Stage, items: list[Any]) -> tuple[list[Any], StageDiagnosis]:
    size = stage.size or 1
    batches = [items[i:i + size] for i in range(0, len(items), size)]
    if stage.drop_last and batches and len(batches[-1]) < size:
        batches.pop()
    note = f"grouped {len(items)} items into {len(batches)} batches of up to {size}; batching is not measured"
    return batches, StageDiagnosis(name=stage.name, kind="batch", verdict=None, best_concurrency=None,
                                   evidence=note, recommendation="", inputs=len(items), outputs=len(batches))


def _not_measured(stage: Stage, why: str) -> StageDiagnosis:
    return StageDiagnosis(name=stage.name, kind=stage.kind, verdict=None, best_concurrency=None,
                          evidence=f"not measured: {why}", recommendation="", error=f"not measured: {why}")


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
    try:
        values = tuple(levels)
    except TypeError:
        raise PipelineSpecError(
            f"diagnose: {name} must be ints in 1..{MAX_CONCURRENCY} (a sequence, e.g. (1, 2, 4, 8, 16)); "
            f"got {levels!r}"
        ) from None
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_CONCURRENCY]
    if not values or bad:
        raise PipelineSpecError(
            f"diagnose: {name} must be ints in 1..{MAX_CONCURRENCY}, e.g. (1, 2, 4, 8, 16); got {levels!r}"
        )
    return tuple(sorted(set(values)))


def _short(result: StageDiagnosis) -> str:
    return result.evidence.split(";")[0] if result.evidence else "it failed"
