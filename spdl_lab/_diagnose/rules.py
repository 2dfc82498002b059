"""From a stage's thread points to a verdict: ``scales`` (QPS rises; neither the GIL nor the cores
are full), ``cpu-bound`` (the cores are busy), ``gil-bound`` (the GIL probe waits, or caps a rise),
``contended`` (neither: a lock serializes it)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .._table import amount
from .result import Point, usable

RISE_MIN_SPEEDUP = 1.5  # a stage "rises": its best thread QPS is this many times its first point's
#: A stage that kept a core this busy at its lowest concurrency rises only by using more CPU:
#: with CPU growing less than CPU_GROWTH, the rise is the machine's speed changing.
BUSY_CORE = 0.8
CPU_GROWTH = 1.3
CPU_SATURATED = 0.75  # share of all cores busy at the best point: the cores are the limit
GIL_WAIT_BOUND = 0.30  # GIL probe wait share (concurrency >= 2): the GIL is what workers wait for
BEST_WITHIN = 0.05  # best_concurrency: the least within this share of the best QPS...
BEST_NOISE_CAP = 0.15  # ...or within the best point's window spread, up to this
PROCESS_HELPS = 1.3  # process QPS over the best thread QPS at which processes are advised


@dataclass(frozen=True)
class Judgement:
    verdict: str | None
    best_concurrency: int | None
    evidence: str  # one short sentence that agrees with the verdict
    recommendation: str
    details: str = ""  # the numbers behind it, for the report's details and the JSON


def rises(thread_points: Sequence[Point], cores: int) -> bool:
    """Whether thread QPS grows with concurrency (also decides whether processes are tried)."""
    ok = usable(thread_points)
    if len(ok) < 2:
        return False
    first, best = ok[0], max(ok, key=lambda p: p.qps)
    if best.qps < RISE_MIN_SPEEDUP * first.qps:
        return False
    busy_at_first = first.cpu_util * cores >= BUSY_CORE * min(first.concurrency, cores)
    return not busy_at_first or best.cpu_util >= CPU_GROWTH * first.cpu_util


def judge(thread_points: Sequence[Point], process_points: Sequence[Point] = (), *, cores: int) -> Judgement:
    ok = usable(thread_points)
    if not ok:
        return Judgement(None, None, "no measurement finished, so there is nothing to judge", "")
    first, best = ok[0], max(ok, key=lambda p: p.qps)
    tolerance = max(BEST_WITHIN, min(BEST_NOISE_CAP, 0.0 if math.isnan(best.qps_spread) else best.qps_spread))
    best_c = min(p.concurrency for p in ok if p.qps >= (1 - tolerance) * best.qps)
    speedup, cpu, machine = best.qps / first.qps, best.cpu_util, best.machine_cpu_util
    crowded = not cpu >= CPU_SATURATED and machine >= CPU_SATURATED  # others hold the cores
    gils = [p.gil_wait_frac for p in ok if p.concurrency >= 2 and not math.isnan(p.gil_wait_frac)]
    gil = statistics.median(gils) if gils else math.nan
    lo, hi = first.concurrency, ok[-1].concurrency
    span = f"from {lo} to {hi} threads"
    cpu_text = f"CPU at {_pct(cpu)} of {cores} cores"

    rising = rises(ok, cores)
    # Part I/O, part Python: it rises while the waits overlap, then the Python parts
    # queue for the GIL. The median over all points is low; the top point tells.
    ceiling = (rising and best_c < hi and not cpu >= CPU_SATURATED
               and ok[-1].gil_wait_frac >= GIL_WAIT_BOUND)
    gil_bound = gil >= GIL_WAIT_BOUND or ceiling
    if rising and not gil_bound and not cpu >= CPU_SATURATED:
        verdict = "scales"
        details = (f"QPS rose {speedup:.1f}x {span} ({amount(first.qps)} to {amount(best.qps)}/s, best at "
                   f"{best_c}) with {cpu_text}: the workers wait without holding the GIL or a core.")
        evidence = (f"QPS rose {speedup:.1f}x from {lo} to {best_c} threads without filling the cores "
                    f"or waiting on the GIL.")
        advice = f"set concurrency to {best_c}"
        if best_c == hi:
            advice += f" or more: QPS was still rising at {hi}"
    elif (cpu >= CPU_SATURATED or crowded) and not gil_bound:
        verdict = "cpu-bound"
        details = (f"QPS {'rose' if rising else 'changed'} {speedup:.1f}x {span} to "
                   f"{amount(best.qps)}/s at {best_c}")
        evidence = f"The cores were {_pct(cpu)} busy at {best_c} threads ({amount(best.qps)}/s): they are the limit."
        advice = (f"concurrency {best_c} is enough; more threads add nothing once the cores are busy. "
                  f"To go faster, make the function cheaper or give it more cores")
        if crowded:
            details += (f"; this process used {_pct(cpu)} of {cores} cores but the machine was {_pct(machine)} "
                        f"busy: other processes held the cores it needed.")
            evidence = (f"The machine's cores were {_pct(machine)} busy, mostly with other processes: "
                        "they are the limit.")
            advice = "diagnose again on a quiet machine: other processes held the cores; " + advice
        else:
            details += f", with {cpu_text} there: the cores are the limit."
    elif gil_bound:
        verdict = "gil-bound"
        advice = ("keep it off the training process's GIL: run the pipeline under subprocess-threads, "
                  "or make the function release the GIL (numpy/torch operations on whole arrays)")
        if ceiling and not gil >= GIL_WAIT_BOUND:
            details = (f"QPS rose {speedup:.1f}x from {lo} to {best_c} threads ({amount(first.qps)} to "
                       f"{amount(best.qps)}/s) and no further, with {cpu_text}; at {hi} threads the GIL probe "
                       f"waited {_pct(ok[-1].gil_wait_frac)} of the time: its waits overlap, its Python "
                       f"parts queue for the GIL.")
            evidence = (f"QPS stopped rising at {best_c} threads while the GIL probe waited "
                        f"{_pct(ok[-1].gil_wait_frac)} at {hi}: the GIL is its ceiling.")
            advice = f"set concurrency to {best_c}; to go faster, " + advice
        else:
            details = (f"QPS changed {speedup:.1f}x {span} (best {amount(best.qps)}/s at {best_c}) while the GIL "
                       f"probe waited {_pct(gil)} of the time, with {cpu_text}: the function holds the GIL.")
            evidence = (f"The GIL probe waited {_pct(gil)} of the time with 2 or more threads: "
                        f"the function holds the GIL.")
    else:
        verdict = "contended"
        gil_text = "GIL wait n/a" if math.isnan(gil) else f"GIL wait {_pct(gil)}"
        details = (f"QPS changed {speedup:.1f}x {span} (best {amount(best.qps)}/s at {best_c}) with "
                   f"{cpu_text} and {gil_text}: neither the GIL nor the cores are full, so a lock "
                   f"or another shared resource serializes it.")
        evidence = (f"More threads did not help, yet neither the GIL ({gil_text.removeprefix('GIL wait ')}) "
                    f"nor the cores ({_pct(cpu)}) were full: something shared serializes it.")
        advice = (f"concurrency {best_c} is as fast as any; find the shared lock or resource (a global "
                  f"RNG such as np.random.*: give each worker np.random.default_rng(); a shared "
                  f"client or lock) and give each worker its own")
    # A process point runs one task per worker: it cannot overlap waits as threads do,
    # so falling short of many threads says nothing against processes of threads.
    details, advice = _with_processes(details, advice, verdict, best, process_points,
                                      comparable=not (ceiling and verdict == "gil-bound"))
    return Judgement(verdict, best_c, evidence, advice, details)


def _with_processes(details: str, advice: str, verdict: str, best: Point,
                    process_points: Sequence[Point], comparable: bool = True) -> tuple[str, str]:
    ok = usable(process_points)
    if not ok:
        return details, advice
    top = max(ok, key=lambda p: p.qps)
    ratio = top.qps / best.qps
    details += (f" {top.concurrency} worker process{'es' if top.concurrency > 1 else ''} "
                 f"reached {amount(top.qps)}/s ({ratio:.1f}x the best with threads).")
    if ratio >= PROCESS_HELPS:
        advice = (f"processes help: {ratio:.1f}x with {top.concurrency} processes; run this stage under "
                  f"the process runner (DataLoader workers) or subprocess-threads; or " + advice)
    elif verdict in ("gil-bound", "contended") and comparable:
        advice += "; processes did not help here either"
    return details, advice


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0%}"
