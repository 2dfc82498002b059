"""From a comparison's windows to its table and its warnings. A runner's batches/s is the median
of its rounds and ``_lo``/``_hi`` their range (see ``coverage``); ratios to the headspace pair
rounds measured seconds apart, so a slow spell of the machine that hits both cancels."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from .contender import Window

#: Share of the cores used by other processes above which a comparison or a diagnosis names the load.
BUSY_MACHINE = 0.25
#: A runner whose fastest round is this much faster than its slowest is named in a warning.
WIDE_SPREAD = 1.25
#: A runner beats the headspace when every round's ratio is above 1 and the median above this.
BEATS_HEADSPACE = 1.03


def coverage(rounds: int) -> float:
    """Coverage of [min, max] of ``rounds`` values as a distribution-free confidence interval of
    their median (94% for 5 rounds); two runners whose ranges overlap are within noise."""
    return 1.0 - 2.0 ** (1 - rounds) if rounds > 1 else 0.0


def runner_row(windows: Sequence[Window]) -> dict[str, float]:
    """The table's figures for one runner over its measured windows."""
    rates = [w.batches_per_s for w in windows]
    records = [r for w in windows for r in w.records]
    wait = sum(r.data_wait_s for r in records)
    loop = sum(r.data_wait_s + r.step_s for r in records)
    device = [r.device_s for r in records if not math.isnan(r.device_s)]
    step_ms = np.array([r.step_s for r in records]) * 1e3
    weights = [w.loop_s for w in windows]
    row = {
        "batches_per_s": statistics.median(rates),
        "batches_per_s_lo": min(rates),
        "batches_per_s_hi": max(rates),
        "step_p50_ms": float(np.percentile(step_ms, 50)) if len(step_ms) else math.nan,
        "step_p90_ms": float(np.percentile(step_ms, 90)) if len(step_ms) else math.nan,
        "data_wait_frac": wait / loop if loop > 0 else math.nan,
        "device_util": min(1.0, sum(device) / loop) if device and loop > 0 else math.nan,
        "others_cpu_percent": _weighted([w.others_percent for w in windows], weights),
        "steps": float(len(records)),
        "elapsed_s": loop,
    }
    for name in ("cpu_percent", "train_gil_wait_frac", "train_runqueue_wait_frac", "gil_wait_frac",
                 "runqueue_wait_frac"):
        row[name] = _weighted([getattr(w, name) for w in windows], weights)
    return row


def ratios(windows: Sequence[Window], to: Sequence[Window]) -> tuple[float, float, float]:
    """(median, lo, hi) of the per-round ratios of ``windows`` to ``to``, paired by round."""
    base = {w.round: w.batches_per_s for w in to}
    per_round = [w.batches_per_s / base[w.round] for w in windows
                 if w.round in base and base[w.round] > 0 and not math.isnan(w.batches_per_s)]
    if not per_round:
        return math.nan, math.nan, math.nan
    return statistics.median(per_round), min(per_round), max(per_round)


def beats_headspace(row: dict[str, float]) -> bool:
    lo, mid = row.get("vs_cache_lo", math.nan), row.get("vs_cache", math.nan)
    return lo > 1.0 and mid > BEATS_HEADSPACE


def warnings_for(table: dict[str, dict[str, float]], rounds: int, cores: int) -> list[str]:
    """Sentences: everything that makes the comparison less than trustworthy."""
    out: list[str] = []
    if rounds < 3:
        out.append(f"Only {rounds} round(s) per runner: the spread cannot be told from so few; "
                   f"use repeats=3 or more.")
    others = [row["others_cpu_percent"] for row in table.values() if not math.isnan(row["others_cpu_percent"])]
    if others and max(others) / (100.0 * cores) >= BUSY_MACHINE:
        out.append(f"Other processes used up to {max(others):.0f}% of a core (the machine has {cores} cores) "
                   f"while runners were measured: the rates may be low and their order unsure; "
                   f"compare again on a quiet machine.")
    cache = table.get("cache")
    for runner, row in table.items():
        if runner != "cache" and cache is not None and beats_headspace(row):
            out.append(_beats_headspace(runner, row, cache, cores))
        lo, hi = row["batches_per_s_lo"], row["batches_per_s_hi"]
        if lo > 0 and hi / lo > WIDE_SPREAD:
            out.append(f"{runner}'s rounds ranged from {lo:.3g} to {hi:.3g} batches/s ({hi / lo - 1:.0%} apart): "
                       f"the machine's speed moved or the pipeline's cost varies; more rounds (repeats=) "
                       f"narrow the median.")
    out.extend(_within_noise(table))
    return out


def _beats_headspace(runner: str, row: dict[str, float], cache: dict[str, float], cores: int) -> str:
    why = []
    load = max(row["others_cpu_percent"], cache["others_cpu_percent"])
    if load / (100.0 * cores) >= 0.1:
        why.append(f"other processes used {load:.0f}% of a core during these windows")
    if cache["step_p50_ms"] > 1.03 * row["step_p50_ms"]:
        why.append(f"the step itself ran slower in the cache's windows (p50 {cache['step_p50_ms']:.1f} ms "
                   f"against {row['step_p50_ms']:.1f} ms): the cache runner's own cost, or the machine's "
                   f"speed moved between windows")
    if not why:
        why.append("nothing measured explains it; the step's own time may vary between rounds")
    return (f"{runner} beat the headspace (cache) in every round ({row['vs_cache_lo']:.2f}x to "
            f"{row['vs_cache_hi']:.2f}x): no runner can be faster than loading made free, so this "
            f"comparison is not trustworthy. Why: {'; '.join(why)}.")


def _within_noise(table: dict[str, dict[str, float]]) -> list[str]:
    names = [r for r in table if r != "cache"]
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = table[a], table[b]
            if ra["batches_per_s_lo"] <= rb["batches_per_s_hi"] and rb["batches_per_s_lo"] <= ra["batches_per_s_hi"]:
                out.append(f"{a} and {b} are within noise of each other ({_range(ra)} against "
                           f"{_range(rb)} batches/s).")
    return out


def _range(row: dict[str, float]) -> str:
    return f"{row['batches_per_s_lo']:.3g}-{row['batches_per_s_hi']:.3g}"


def _weighted(values: Sequence[float], weights: Sequence[float]) -> float:
    pairs = [(v, w) for v, w in zip(values, weights) if not math.isnan(v) and w > 0]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else math.nan
