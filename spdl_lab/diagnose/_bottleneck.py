"""Which stage limits the pipeline, and which stages' advice would change its rate.

Stages are compared like with like: each stage's thread QPS at its concurrency in
the pipeline (the measured point there, or interpolated between the nearest two),
in source items per second (a stage after ``batch(n)`` handles n items per input).
The slowest limits the pipeline; a stage at least FAR_FASTER times faster than it
gets its verdict and no advice: changing it does not change the pipeline's rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .result import Diagnosis, StageDiagnosis

__all__ = ["FAR_FASTER", "BUSY_MACHINE", "rate_at", "limiting", "headline", "machine_load"]

FAR_FASTER = 2.0
#: Share of the cores used by other processes above which the diagnosis names the load.
BUSY_MACHINE = 0.25


def rate_at(stage: StageDiagnosis) -> float:
    points = sorted((p for p in stage.thread_points() if p.status in ("ok", "unstable") and p.qps > 0),
                    key=lambda p: p.concurrency)
    if not points or stage.concurrency is None:
        return math.nan
    c = stage.concurrency
    below = [p for p in points if p.concurrency <= c]
    above = [p for p in points if p.concurrency >= c]
    if below and above:
        lo, hi = below[-1], above[0]
        if lo.concurrency == hi.concurrency:
            qps = lo.qps
        else:  # linear in log2(concurrency), as the sweep's levels double
            t = (math.log2(c) - math.log2(lo.concurrency)) / (math.log2(hi.concurrency) - math.log2(lo.concurrency))
            qps = lo.qps + t * (hi.qps - lo.qps)
    else:
        qps = (below or above)[-1 if below else 0].qps  # beyond the sweep: the nearest point
    return qps * stage.items_per_input


def limiting(stages: Iterable[StageDiagnosis]) -> tuple[StageDiagnosis, float, StageDiagnosis | None, float] | None:
    """(slowest stage, its rate, next slowest, its rate) among stages with a verdict."""
    rated = sorted(((s, s.rate_now()) for s in stages if s.verdict is not None), key=lambda sr: sr[1])
    rated = [(s, r) for s, r in rated if not math.isnan(r)]
    if not rated:
        return None
    slowest, rate = rated[0]
    nxt, nxt_rate = rated[1] if len(rated) > 1 else (None, math.nan)
    return slowest, rate, nxt, nxt_rate


def headline(diag: Diagnosis) -> str:
    failed = [s.name for s in diag.stages.values() if s.status == "failed"]
    found = limiting(diag.stages.values())
    parts = []
    if failed:
        parts.append(f"Stage {', '.join(map(repr, failed))} failed: fix it first (its traceback is below).")
    if found is None:
        return " ".join(parts) or "No stage could be measured, so no stage can be named as the limit."
    s, rate, nxt, nxt_rate = found
    by = (f", {nxt_rate / rate:.1f}x slower than the next slowest ({nxt.name!r}, {_n(nxt_rate)} items/s)"
          if nxt is not None else ", the only measured stage")
    if s.status == "unstable":
        advice = f" Its numbers are not settled: {s.recommendation}."
    else:
        advice = f" To go faster: {s.recommendation}." if s.recommendation else ""
    parts.append(f"{s.name!r} limits the pipeline: {_n(rate)} items/s at its concurrency {s.concurrency} "
                 f"({s.verdict}){by}.{advice}")
    return " ".join(parts)


def machine_load(diag: Diagnosis) -> str:
    others = [p.machine_cpu_util - p.cpu_util for s in diag.stages.values() for p in s.points
              if p.executor == "thread" and not math.isnan(p.machine_cpu_util) and not math.isnan(p.cpu_util)]
    worst = max(others, default=0.0)
    paused = diag.settings.get("paused_sessions") or 0
    said = []
    if paused:
        said.append(f"{paused} running session{'s' if paused > 1 else ''} of this kernel "
                    f"{'were' if paused > 1 else 'was'} paused while the stages were measured.")
    if worst >= BUSY_MACHINE:
        cores = diag.machine.get("cpu_cores", "?")
        said.append(f"Other processes used up to {worst:.0%} of the {cores} cores while stages were "
                    f"measured: rates may be low; diagnose again on a quiet machine.")
    return " ".join(said)


def _n(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"
