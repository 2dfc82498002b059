"""The tuner's advice: move to the best only when the side-by-side rounds put it beyond the noise,
on a machine whose other processes left the cores alone, with windows tighter than the gain;
otherwise keep what you have, and say the ratio measured."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._experiments.contender import MachineClock
from .._experiments.spread import BUSY_MACHINE
from .._table import spread
from .space import MIN_GAIN, Trial

_AGAIN = "no move is recommended from this measurement; tune again on a quieter machine"
#: Share of the cores other processes may take while the tuner measures; above it, rates move
#: with their load (not with the configuration) and no move is recommended.
BUSY_SHARE = BUSY_MACHINE


@dataclass(frozen=True)
class Advice:
    move: bool  # False: keep the starting configuration
    sentence: str  # "move to ...: ..." or "keep what you have: ..."
    warnings: tuple[str, ...]  # what made the measurement less than trustworthy


def others_percent(seconds: float = 0.5) -> float:
    """CPU used by every process outside this one and its children over ``seconds``, 100 = one core."""
    clock = MachineClock(None)
    t0, ours0, busy0, _ = clock.read()
    time.sleep(seconds)
    t1, ours1, busy1, _ = clock.read()
    return min(100.0 * clock.cores, max(0.0, (busy1 - busy0) - (ours1 - ours0)) / max(t1 - t0, 1e-9) * 100.0)


def busy_reason(measured: Iterable[Any], cores: int, when: str = "while it was measured") -> str | None:
    """Why the machine was too busy for ``measured`` (trials, or percentages of one core), or None."""
    figures = [getattr(m, "others_percent", m) for m in measured]
    figures = [f for f in figures if isinstance(f, (int, float)) and math.isfinite(f)]
    worst = max(figures, default=0.0)
    if cores < 1 or worst <= 100.0 * BUSY_SHARE * cores:
        return None
    return (f"other processes took {worst / 100:.1f} of the {cores} cores ({worst / cores:.0f}%, more than "
            f"{BUSY_SHARE:.0%}) {when}")


def ratio_text(mid: float, lo: float, hi: float) -> str:
    """``0.99x [0.95-1.03]`` (the range only when it is one)."""
    return spread(mid, lo, hi, ".2f", "x")


def advise(start: Trial, best: Trial, change: Trial | None, speedup: tuple[float, float, float], *,
           cores: int, before: float = math.nan, during: Sequence[float] = ()) -> Advice:
    """Whether to move from ``start`` to ``best`` (side by side: ``speedup`` median, lo, hi); ``change``
    is the fastest other than the start, named to keep. ``before``, ``during``: other processes' CPU
    (100 = one core) before measuring and over the windows that compared the two."""
    early = busy_reason([before], cores, "before it measured")
    late = busy_reason([start, best, *during], cores)
    warnings = [f"{why}: {_AGAIN}" for why in (early, late) if why is not None]
    if best.config == start.config:
        if change is None:
            return Advice(False, "keep what you have: no other configuration was measured", tuple(warnings))
        # The climb's own trials: the change's windows against the start's.
        ratio = ratio_text(change.batches_per_s / start.batches_per_s, change.lo / start.hi, change.hi / start.lo)
        named = f"the best change ({change.config.describe()}) measured {ratio}"
    else:
        named = f"the best change ({best.config.describe()}) measured {ratio_text(*speedup)} side by side"
    if early or late:
        return Advice(False, f"keep what you have: the machine was busy; {named}", tuple(warnings))
    if best.config == start.config:
        return Advice(False, f"keep what you have: {named}", tuple(warnings))
    mid, lo, hi = speedup
    if not (lo > 1.0 and mid >= 1.0 + MIN_GAIN):
        return Advice(False, f"keep what you have: {named}, within the noise", tuple(warnings))
    wide = max((start, best), key=lambda t: t.spread if math.isfinite(t.spread) else 0.0)
    if math.isfinite(wide.spread) and wide.spread > mid - 1.0:
        warnings.append(f"the windows of {wide.config.describe()} spread {wide.spread:.0%}, wider than the "
                        f"{mid - 1.0:+.0%} the change would claim: no move is recommended from this measurement")
        return Advice(False, f"keep what you have: {named}, within its spread", tuple(warnings))
    return Advice(True, f"move to {best.config.describe()}: it measured {ratio_text(mid, lo, hi)} the start "
                        f"side by side", tuple(warnings))
