"""``lab.compare``: one pipeline and step under several runners in interleaved rounds (one window
each, the order rotating), so a slow spell of the machine hits all alike. ``lab.headspace``: the
``cache`` runner in one call, the step time when loading is free."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from .._loader import Loader
from .._pipeline import Pipeline, check_ints
from .._progress import progress_bar
from .._runners import LOCAL_RUNNERS, RUNNERS
from .._runners.cache import expected_outputs
from .._telemetry.probes import GilProbe
from .._training import SimulatedDevice
from ..errors import PipelineSpecError
from .comparison import ROUND_COLUMNS, TABLE_COLUMNS, Comparison, ratios, runner_row, warnings_for
from .contender import Contender, MachineClock, Window, park_all_but

DEFAULT_STEPS = 200  # measured steps per runner, over all rounds
DEFAULT_WARMUP = 10  # unmeasured steps per runner at the start of each of its windows
DEFAULT_REPEATS = 5  # rounds


def compare(pipeline: Pipeline, step: Callable[[Any], Any] | SimulatedDevice, *,
            runners: Sequence[str] = LOCAL_RUNNERS, steps: int = DEFAULT_STEPS,
            warmup: int = DEFAULT_WARMUP, repeats: int | None = None,
            runner_options: dict[str, dict[str, Any]] | None = None, timeout: float | None = None,
            progress: bool = True, probes: bool = True) -> Comparison:
    """Run ``pipeline`` and ``step`` under each runner in interleaved rounds; return a Comparison.

    ``steps`` measured steps per runner are split over ``repeats`` rounds, each window after
    ``warmup`` unmeasured steps; ``runner_options`` maps a runner to its Loader options;
    ``timeout`` bounds each runner's seconds, all its windows together. Example::

        cmp = lab.compare(*lab.workloads.noisy_neighbour(), steps=100)
        cmp.table; cmp.warnings; cmp.plot()
    """
    if repeats is None and isinstance(steps, int) and not isinstance(steps, bool):
        repeats = max(1, min(DEFAULT_REPEATS, steps))
    runners = _check(pipeline, runners, steps, warmup, repeats, timeout)
    shares = [steps // repeats + (1 if i < steps % repeats else 0) for i in range(repeats)]
    options = runner_options or {}
    bar = progress_bar(len(runners) * (repeats * warmup + steps), progress, "step")
    probe = GilProbe() if probes else None
    t0 = time.perf_counter()
    contenders: dict[str, Contender] = {}
    windows: list[Window] = []
    spent = dict.fromkeys(runners, 0.0)
    try:
        if probe is not None:
            probe.start()
        machine = MachineClock(probe)
        for r in runners:
            contenders[r] = Contender(pipeline, r, step, options.get(r, {}), probe, t0)
        for round_ in range(repeats):
            for runner in runners[round_ % len(runners):] + runners[:round_ % len(runners)]:
                bar.set_description(f"round {round_ + 1}/{repeats}: {runner}")
                left = None if timeout is None else max(0.001, timeout - spent[runner])
                park_all_but(contenders, runner)
                started = time.perf_counter()
                windows.append(contenders[runner].window(round_, warmup, shares[round_], machine, left))
                spent[runner] += time.perf_counter() - started
                bar.update(warmup + shares[round_])
        frames = {r: c.loader.frames() for r, c in contenders.items()}
    finally:
        for c in contenders.values():
            c.close()
        if probe is not None:
            probe.stop()
        bar.close()
    by_runner = {r: [w for w in windows if w.runner == r] for r in runners}
    rows = {r: runner_row(ws) for r, ws in by_runner.items()}
    for r, row in rows.items():
        vs = ratios(by_runner[r], by_runner["cache"]) if "cache" in by_runner else (math.nan,) * 3
        row["vs_cache"], row["vs_cache_lo"], row["vs_cache_hi"] = vs
    table = pd.DataFrame.from_dict(rows, orient="index")[TABLE_COLUMNS].rename_axis("runner")
    table = table.astype({"steps": int})
    rounds = pd.DataFrame([(w.runner, w.round, w.started_s, w.batches_per_s) for w in windows],
                          columns=ROUND_COLUMNS)
    return Comparison(table=table, frames=frames, steps=steps, warmup=warmup, repeats=repeats,
                      warnings=warnings_for(rows, repeats, machine.cores), rounds=rounds)


def _check(pipeline: Any, runners: Sequence[str], steps: Any, warmup: Any, repeats: Any,
           timeout: Any) -> list[str]:
    if not isinstance(pipeline, Pipeline):
        raise PipelineSpecError(f"compare takes a lab.Pipeline, got {type(pipeline).__name__}; "
                                "for a DataLoader use lab.from_dataloader(dl)")
    runners = list(runners)
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown or not runners:
        raise PipelineSpecError(f"compare: unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    if len(set(runners)) != len(runners):
        raise PipelineSpecError(f"compare: a runner is named twice in {runners}")
    check_ints("compare", steps=(steps, 1), warmup=(warmup, 0), repeats=(repeats, 1))
    if repeats > steps:
        raise PipelineSpecError(f"compare: repeats ({repeats}) is more than steps ({steps}); every round "
                                "measures at least one step")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise PipelineSpecError(f"compare: timeout must be a number of seconds > 0 or None, got {timeout!r}")
    available, needed = pipeline_length(pipeline), repeats * warmup + steps
    if available is not None and available < needed:  # the source is known to run out
        raise PipelineSpecError(
            f"compare: the pipeline yields {available} outputs per epoch; each runner needs {needed} "
            f"({repeats} rounds x {warmup} warm-up + {steps} measured steps). Pass fewer steps=, "
            f"warmup= or repeats=, or a longer source (e.g. repeat the epoch in the source)")
    return runners


def pipeline_length(pipeline: Pipeline) -> int | None:
    """Outputs of one pass of ``pipeline`` when its source has a ``len()``; None when unknown."""
    if pipeline.source_is_factory or not hasattr(pipeline.source, "__len__"):
        return None
    return expected_outputs(pipeline)


def headspace(loader_or_pipeline: Loader | Pipeline, *, num_caches: int = 8, forever: bool = False,
              **options: Any) -> Loader:
    """A Loader that replays the first ``num_caches`` outputs of a Loader (its runner makes them)
    or a Pipeline (``source_runner=``, default thread): the step time when loading is free::

        with lab.headspace(loader) as fast:
            for batch in fast:
                step(batch)
    """
    pipeline = loader_or_pipeline
    if isinstance(pipeline, Loader):
        options = {**pipeline.options, "source_runner": pipeline.runner, **options}
        pipeline = pipeline.pipeline
    elif not isinstance(pipeline, Pipeline):
        raise PipelineSpecError(f"headspace takes a lab.Loader or lab.Pipeline, "
                                f"got {type(pipeline).__name__}")
    options.pop("metered", None)
    return Loader(pipeline, runner="cache", num_caches=num_caches, forever=forever, **options)
