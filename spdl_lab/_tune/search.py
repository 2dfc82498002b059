"""A hill climb on the model's predictions, as tf.data's autotuner climbs its model: from the best
trial each knob a rung up or down, a jump of the limiting stage, each other runner; the best predicted
gain is measured next and kept only beyond the noise (``decide``), and moved to only so (``advise``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .._experiments.compare import MachineClock
from .._experiments.comparison import BUSY_MACHINE
from .._table import spread
from .space import MIN_GAIN, WORKERS, Config, Move, Prediction, RateModel, Space, Trial, margin

CPU_SAVING = 0.10  # within the noise, a move is still kept for saving this share of the CPU,
CPU_SAVING_POINTS = 10.0  # and at least this many percent of one core
GIL_SWITCH = 0.10  # the step's GIL wait from which leaving the interpreter is measured anyway
PROBE_GIL_SWITCH = 0.25  # the same, from the GIL probe when the step's own wait is unknown
JUMP_HEADROOM = 1.25  # a jump lifts the limiting stage this far above the next limit
FED = 0.05  # data wait below this share of the loop: the loader keeps up
_AGAIN = "no move is recommended from this measurement; tune again on a quieter machine"


@dataclass(frozen=True)
class Candidate:
    move: Move
    predicted: Prediction
    why: str  # why this move is measured


@dataclass(frozen=True)
class Decision:
    kept: bool
    reason: str
    gain: float  # measured / best - 1


def decide(best: Trial, new: Trial, cores: int | None = None) -> Decision:
    """Keep ``new`` only when faster than ``best`` beyond the noise and either trial's spread, or as
    fast for less CPU; never from a measurement other processes disturbed (given ``cores``)."""
    if not new.batches_per_s > 0:
        return Decision(False, "no batches measured", math.nan)
    gain = new.batches_per_s / best.batches_per_s - 1.0
    need = margin(best, new)
    busy = busy_reason([best, new], cores) if cores else None
    if busy is not None and gain > -need:
        return Decision(False, f"{gain:+.0%}, but {busy}", gain)
    if gain > need:
        wide = max(best, new, key=_spread)
        if _spread(wide) > gain:
            return Decision(False, f"{gain:+.0%}, but the windows of {wide.config.describe()} spread "
                                   f"{_spread(wide):.0%}, wider than that gain", gain)
        return Decision(True, f"{gain:+.0%}, beyond the noise (±{need:.0%})", gain)
    # Cheaper (never with a NaN) only breaks a tie: a median lower by more than MIN_GAIN is never kept.
    if gain >= -MIN_GAIN and new.cpu_percent < min(best.cpu_percent * (1.0 - CPU_SAVING),
                                                   best.cpu_percent - CPU_SAVING_POINTS):
        return Decision(True, f"{gain:+.0%}, within the noise (±{need:.0%}), for {new.cpu_percent:.0f}% CPU "
                              f"instead of {best.cpu_percent:.0f}%", gain)
    if gain >= -need:
        return Decision(False, f"{gain:+.0%}, within the noise (±{need:.0%})", gain)
    return Decision(False, f"{gain:+.0%}, slower beyond the noise (±{need:.0%})", gain)


def _spread(trial: Trial) -> float:
    return trial.spread if math.isfinite(trial.spread) else 0.0


@dataclass(frozen=True)
class Advice:
    move: bool  # False: keep the starting configuration
    sentence: str  # "move to ...: ..." or "keep what you have: ..."
    warnings: tuple[str, ...]  # what made the measurement less than trustworthy


def others_percent(seconds: float = 0.5) -> float:
    """CPU used by every process outside this one and its children over ``seconds``, 100 = one core."""
    clock = MachineClock(None)
    before = clock.read()
    time.sleep(seconds)
    return clock.between(before, clock.read())[1]


def busy_reason(measured: Iterable[Any], cores: int, when: str = "while it was measured") -> str | None:
    """Why the machine was too busy for ``measured`` (trials, or percentages of one core), or None."""
    figures = (getattr(m, "others_percent", m) for m in measured)
    worst = max((f for f in figures if isinstance(f, (int, float)) and math.isfinite(f)), default=0.0)
    if cores < 1 or worst <= 100.0 * BUSY_MACHINE * cores:
        return None
    return (f"other processes took {worst / 100:.1f} of the {cores} cores ({worst / cores:.0f}%, more than "
            f"{BUSY_MACHINE:.0%}) {when}")


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
    mid, lo, hi = speedup
    wide = max(start, best, key=_spread)
    if best.config != start.config:
        named = f"the best change ({best.config.describe()}) measured {ratio_text(*speedup)} side by side"
    elif change is None:
        return Advice(False, "keep what you have: no other configuration was measured", tuple(warnings))
    else:  # the climb's own trials: the change's windows against the start's
        ratio = ratio_text(change.batches_per_s / start.batches_per_s, change.lo / start.hi, change.hi / start.lo)
        named = f"the best change ({change.config.describe()}) measured {ratio}"
    if early or late:
        keep = f"the machine was busy; {named}"
    elif best.config == start.config:
        keep = named
    elif not (lo > 1.0 and mid >= 1.0 + MIN_GAIN):
        keep = f"{named}, within the noise"
    elif _spread(wide) > mid - 1.0:
        warnings.append(f"the windows of {wide.config.describe()} spread {wide.spread:.0%}, wider than the "
                        f"{mid - 1.0:+.0%} the change would claim: no move is recommended from this measurement")
        keep = f"{named}, within its spread"
    else:
        ratio = ratio_text(mid, lo, hi)
        return Advice(True, f"move to {best.config.describe()}: it measured {ratio} the start "
                            f"side by side", tuple(warnings))
    return Advice(False, f"keep what you have: {keep}", tuple(warnings))


class Climb:
    """Proposes the next move from the best trial so far; remembers what was measured."""

    def __init__(self, space: Space, model: RateModel) -> None:
        self.space = space
        self.model = model
        self.tried: set[Config] = set()
        self._explored: set[Config] = set()
        self._jumped: dict[Config, str] = {}  # reached by a jump -> the knob (its headroom a guess)
        self.best_by_runner: dict[str, Trial] = {}  # a switch goes back to the runner's best

    def record(self, trial: Trial) -> None:
        self.tried.add(trial.config)
        self.model.observe(trial)
        best = self.best_by_runner.get(trial.config.runner)
        if best is None or trial.batches_per_s > best.batches_per_s:
            self.best_by_runner[trial.config.runner] = trial
        # Rungs above the cores open once ``cores`` workers beat fewer beyond the noise.
        if trial.config.runner != "process" or trial.config.knob(WORKERS) != self.space.cores:
            return
        fewer = [t for t in self.model.trials
                 if t.config.runner == "process" and t.config.knob(WORKERS) < self.space.cores]
        if fewer:
            verdict = decide(max(fewer, key=lambda t: t.batches_per_s), trial)
            self.space.allow_more_workers |= verdict.kept and verdict.gain > 0

    def candidates(self, best: Trial) -> list[Candidate]:
        """Every untried move from ``best``, with the model's prediction and the reason."""
        here = self.model.predict(best.config)
        moves: list[tuple[Move, str]] = [(m, "") for m in self.space.neighbours(best.config)]
        if (jump := self._jump(best.config, here)) is not None:
            moves.append((jump, f"enough {jump.knob} workers to stop it limiting"))
        moves += [(m, "") for m in self._switches(best)]
        out: dict[Config, Candidate] = {}
        for move, why in moves:
            if move.config not in self.tried and move.config not in out:
                out[move.config] = Candidate(move, self.model.predict(move.config), why)
        return list(out.values())

    def next_move(self, best: Trial, affordable: Callable[[Config], bool]) -> Candidate | None:
        """The candidate to measure next, or None when nothing is left worth measuring; a move the
        budget cannot pay for (a runner's start-up) is passed over, not counted as tried."""
        if not (candidates := [c for c in self.candidates(best) if affordable(c.move.config)]):
            return None
        # The model sees the GIL only through task times: leaving the interpreter is measured first.
        if self._gil_says(best) and (switch := self._explore(best, candidates, "switch")):
            return switch
        top = max(candidates, key=lambda c: _score(c.predicted.batches_per_s))
        # Against the model's own figure for the best: its bias (e.g. the loop's overheads) cancels.
        here = self.model.predict(best.config)
        if _score(top.predicted.batches_per_s) > _score(here.batches_per_s) * (1.0 + MIN_GAIN):
            if top.move.kind == "raise" and top.why:
                self._jumped[top.move.config] = top.move.knob
            return Candidate(top.move, top.predicted,
                             top.why or f"{here.describe()}; predicted the largest gain")
        return self._explore(best, candidates)

    def _explore(self, best: Trial, candidates: list[Candidate], kind: str = "") -> Candidate | None:
        """The first exploration (of ``kind``, if given), marked explored."""
        found = next((c for c in self._explorations(best, candidates) if kind in ("", c.move.kind)), None)
        if found is not None:
            self._explored.add(found.move.config)
        return found

    def _explorations(self, best: Trial, candidates: list[Candidate]) -> Iterable[Candidate]:
        fresh = [c for c in candidates if c.move.config not in self._explored]
        gil = best.train_gil_wait_frac
        if self._gil_says(best):
            switches = [c for c in fresh if c.move.kind == "switch"]
            for c in sorted(switches, key=_switch_rank, reverse=True):
                wait = (f"the training thread waited for the GIL {gil:.0%} of its step" if math.isfinite(gil)
                        else f"the GIL probe waited {best.gil_wait_frac:.0%} of the time")
                yield Candidate(c.move, c.predicted, f"{wait}: loading out of this interpreter")
        jumped = self._jumped.get(best.config)
        lowers = [c for c in fresh if c.move.kind == "lower"
                  and (best.data_wait_frac < FED or c.move.knob == jumped)
                  and _score(c.predicted.batches_per_s) >= best.batches_per_s * (1.0 - MIN_GAIN)]
        for c in sorted(lowers, key=lambda c: (c.move.old - c.move.new), reverse=True):
            why = (f"data wait is {best.data_wait_frac:.0%}: {c.move.knob} has slack"
                   if best.data_wait_frac < FED else
                   f"{c.move.knob} jumped past what the model said it needs, by a margin")
            yield Candidate(c.move, c.predicted, f"{why}, and fewer loader threads may leave the step more CPU")
        # The model does not see a DataLoader's own options: each move of one is measured once.
        for c in fresh:
            if c.move.kind == "set":
                yield Candidate(c.move, c.predicted, f"the model does not see {c.move.knob}: measured once")
        # Across runners the model is least sure (pickling, another interpreter's GIL, the step's
        # neighbours): a runner never measured is measured once, at its best predicted setting.
        switches = [c for c in fresh if c.move.kind == "switch"
                    and c.move.config.runner not in self.best_by_runner]
        unmeasured = {r: max((c for c in switches if c.move.config.runner == r), key=_switch_rank)
                      for r in dict.fromkeys(c.move.config.runner for c in switches)}
        for runner, c in unmeasured.items():
            yield Candidate(c.move, c.predicted, f"{runner} not measured yet: the model predicts across "
                                                 f"runners least well")

    @staticmethod
    def _gil_says(best: Trial) -> bool:
        """The training thread (or, when its wait is unknown, the probe) waits for the GIL."""
        if best.config.runner != "thread":
            return False
        gil = best.train_gil_wait_frac
        return ((math.isfinite(gil) and gil >= GIL_SWITCH)
                or (not math.isfinite(gil) and best.gil_wait_frac >= PROBE_GIL_SWITCH))

    def _jump(self, config: Config, here: Prediction, one_rung: bool = False) -> Move | None:
        """Raise the limiting stage straight to the concurrency that lifts it to the next limit
        (None when that is one rung up, a neighbour, unless ``one_rung``)."""
        if here.limit not in dict(config.knobs):
            return None
        others = [v for k, v in here.bounds.items() if k != here.limit and math.isfinite(v)]
        if not others:
            return None
        # Past the next limit with room to spare: task times often grow with the workers.
        target = min(others) * JUMP_HEADROOM
        for rung in self.space.rungs(config, here.limit):
            if rung <= config.knob(here.limit):
                continue
            trial = config.with_knob(here.limit, rung)
            if self.model.predict(trial).bounds.get(here.limit, 0.0) >= target:
                move = Move("raise", trial, here.limit, config.knob(here.limit), rung)
                neighbours = {m.config for m in self.space.neighbours(config)}
                return move if one_rung or move.config not in neighbours else None
        return None

    def _switches(self, best: Trial) -> list[Move]:
        out = []
        for runner in self.space.runners:
            if runner == best.config.runner:
                continue
            known = self.best_by_runner.get(runner)
            configs = [known.config] if known is not None else self._translations(best.config, runner)
            out.extend(Move("switch", c) for c in configs)
            # And each of them with its limiting stage raised out of the way: a runner first measured
            # where that stage held it back (the same threads as the best) is not written off for it.
            out += [Move("switch", jump.config) for config in configs
                    if (jump := self._jump(config, self.model.predict(config), one_rung=True))]
        return out

    def _translations(self, config: Config, runner: str) -> list[Config]:
        """``config``'s way of loading under ``runner``: the same threads, or each worker count."""
        if runner == "process":
            start = self.space.start("process")
            return [start.with_knob(WORKERS, n) for n in self.space.rungs(start, WORKERS)]
        if config.runner == "process":
            return [self.space.start(runner)]
        return [Config(runner, config.knobs, self.space.start(runner).options)]


def _switch_rank(c: Candidate) -> tuple[int, int]:
    """Predicted rate in steps of MIN_GAIN, then more workers: among switches the model cannot tell
    apart (its CPU bound caps them alike), the one using the cores is the better first guess."""
    rate = _score(c.predicted.batches_per_s)
    step = math.floor(math.log(rate) / math.log1p(MIN_GAIN)) if rate > 0 and math.isfinite(rate) else -10**9
    return step, sum(n for _, n in c.move.config.knobs)  # threads or processes it starts


def _score(rate: float) -> float:
    return rate if math.isfinite(rate) else -math.inf


@dataclass(frozen=True)
class Step:
    """One measured configuration of a climb, and what the climb made of it."""

    trial: Trial
    move: Move
    predicted: float  # the model's batches/s before measuring (NaN for the start)
    limit: str  # what the model said limits this configuration
    kept: bool
    sentence: str  # the log line


def climb(search: Climb, first: Config, measure: Callable[[Config], Trial],
          affordable: Callable[[Config], bool] = lambda config: True) -> Iterator[Step]:
    """Measure ``first``, then one move at a time, yielding each step; it ends when nothing is left
    worth measuring or ``affordable`` (the caller's budget), or when the caller leaves the loop."""
    best = measure(first)
    search.record(best)
    here = search.model.predict(first)
    yield Step(best, Move("start", first), math.nan, here.limit, True,
               f"started from {first.describe()}: measured {_rate(best)} batches/s; {here.describe()}")
    while (candidate := search.next_move(best, affordable)) is not None:
        trial = measure(candidate.move.config)
        search.record(trial)
        verdict = decide(best, trial, search.space.cores)
        predicted = candidate.predicted.batches_per_s
        sentence = (f"{candidate.move.describe()}: predicted {predicted:.3g}, measured {_rate(trial)} batches/s; "
                    f"{'kept' if verdict.kept else 'reverted'} ({verdict.reason}). Why tried: {candidate.why}")
        if verdict.kept:
            best = trial
        yield Step(trial, candidate.move, predicted, candidate.predicted.limit, verdict.kept, sentence)


def _rate(trial: Trial) -> str:
    return f"{trial.batches_per_s:.3g} [{trial.lo:.3g}-{trial.hi:.3g}]"
