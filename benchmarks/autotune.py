"""``lab.tune`` against an exhaustive grid over the same space, against torch's DataLoader, and against itself.

Issue 19. On pipelines the tuner has never seen, the tuned configuration should reach
>= 95% of the training batches/s of the best configuration an exhaustive grid finds
over the same space, in <= 25% of the grid's wall time.

Design. Everything runs side by side in one process, one pipeline at a time:

1. The grid: every runner the tuner chooses between (``thread``, ``subprocess-threads``,
   ``process``); for the thread engines, a ladder subset of the tuner's rungs for each
   stage the case names (other stages stay at the pipeline's own concurrency), and for
   ``process`` the tuner's own worker rungs (1 .. cores). Each point is measured by one
   ``Bench`` (the tuner's measurement: warm-up, then windows until the rate is sure) with
   the same ``window_s`` the tuning gets. The grid's wall time is the whole sweep.
2. The tuning: ``lab.tune`` from the pipeline as written (the ``thread`` runner at its
   declared concurrency), with a budget of 25% of that grid's wall time (or ``--budget``).
3. Side by side: a fresh ``Bench`` measures the grid's best and the tuned best in
   alternating rounds (``rate_once``), so both face the same spells of a shared machine;
   the ratio is the median of the per-round ratios.

Then, for ``--dataloader`` pipelines, torch's DataLoader (the ``process`` runner is one)
at ``num_workers`` = cores and at the best ``num_workers`` found by hand (1 .. cores + 2),
side by side with the tuned configuration; and ``--repeat``: the same pipeline tuned three
times, the three bests measured side by side, their spread (target <= 5%).

The cases, each with the answer a person who studied it would give:

* ``io``          sleep 15 ms per item (I/O), declared at 1 thread: many threads;
* ``gil-decode``  a pure-Python decode holding the GIL: out of this interpreter
                  (``subprocess-threads`` or ``process``), not more threads;
* ``noisy-neighbour``  ``lab.workloads.noisy_neighbour()`` with a SimulatedDevice whose
                  launches need the GIL: keep the decoders off the training thread's GIL;
* ``images``      ``lab.workloads.images`` (JPEG read, PIL decode, crop + flip, normalize;
                  a small conv net trained on CPU), declared at 1 thread a stage;
* ``io-numpy``    I/O then numpy work that mostly releases the GIL: threads on both.

    python benchmarks/autotune.py [--quick] [--pipelines io gil-decode ...] [--budget S]
                                  [--rounds 3] [--dataloader gil-decode images] [--repeat noisy-neighbour]

A full run takes about 15-25 minutes on 2 cores; ``--quick`` (small grids, short
windows) is a smoke run of a few minutes whose PASS/FAIL lines mean little.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, print_table  # noqa: E402

import spdl_lab as lab  # noqa: E402
from spdl_lab._tune.bench import Bench  # noqa: E402
from spdl_lab._tune.space import TUNABLE_RUNNERS, WORKERS, Config, Space  # noqa: E402
from spdl_lab.workloads import decode_iterations_per_us  # noqa: E402

#: Targets of issue 19.
RATE_TARGET = 0.95
TIME_TARGET = 0.25
REPEAT_TARGET = 0.05
#: Seconds a window may take before the Bench gives up on a configuration.
WINDOW_TIMEOUT_S = 60.0
#: An endless source: every runner's loader stays open across all its trials.
ENDLESS = 10**9


# -- the stages and steps (module level: every runner imports them by reference) ------------
def fetch(index: int, *, fetch_ms: float) -> np.ndarray:
    """I/O: waits without holding the GIL, then hands back a small array."""
    time.sleep(fetch_ms / 1000)
    return np.full((3, 16, 16), index % 251, dtype=np.uint8)


def normalize(image: np.ndarray) -> np.ndarray:
    """numpy work on a few hundred kB (most of it releases the GIL)."""
    out = np.repeat(np.repeat(image, 8, axis=1), 8, axis=2).astype(np.float32)
    out -= out.mean()
    out /= out.std() + 1.0
    return out


def simulated_step(ms: float) -> lab.SimulatedDevice:
    """A launch-bound GPU step of about ``ms`` (kernels of 400 us, launched holding the GIL)."""
    return lab.SimulatedDevice(kernels=max(1, round(ms / 0.4)))


# -- the cases ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """A pipeline to tune, its step, and the grid's ladder for each thread knob it varies."""

    name: str
    make: Callable[[], tuple[lab.Pipeline, Any]]
    grid: dict[str, tuple[int, ...]]
    answer: str


def io_case(quick: bool) -> Case:
    def make():
        p = lab.Pipeline(range(ENDLESS)).map(partial(fetch, fetch_ms=15.0), concurrency=1, name="fetch").batch(8)
        return p, simulated_step(10.0)
    return Case("io", make, {"fetch": (1, 16) if quick else (1, 2, 4, 8, 16)}, "many threads")


def gil_decode_case(quick: bool) -> Case:
    iterations = round(1500 * decode_iterations_per_us())

    def make():
        p = (lab.Pipeline(range(ENDLESS))
             .map(partial(lab.workloads.decode_sample, decode_iterations=iterations, shape=(3, 32, 32)),
                  concurrency=1, name="decode")
             .batch(8)
             .map(lab.workloads.collate_stack, name="collate"))
        return p, simulated_step(10.0)
    return Case("gil-decode", make, {"decode": (1, 2) if quick else (1, 2, 4, 8, 16)},
                "out of this interpreter")


def noisy_neighbour_case(quick: bool) -> Case:
    def make():
        device = lab.SimulatedDevice(kernels=50, gil_release_every=10)  # a ~20 ms step
        return lab.workloads.noisy_neighbour(items=ENDLESS, batch_size=16, shape=(3, 64, 64), read_ms=2.0,
                                             decode_us=1000.0, read_concurrency=1, decode_concurrency=1,
                                             device=device)
    grid = {"read": (8,), "decode": (1, 2)} if quick else {"read": (1, 2, 4, 8), "decode": (1, 2, 4)}
    return Case("noisy-neighbour", make, grid, "not more threads: decoders off the GIL")


def images_case(quick: bool) -> Case:
    def make():
        return lab.workloads.images(n=128, size=(96, 160), crop=64, batch_size=16, epochs=2000,
                                    concurrency={"read": 1, "decode": 1, "augment": 1, "normalize": 1})
    grid = ({"decode": (1, 2)} if quick
            else {"decode": (1, 2, 4, 8), "normalize": (1, 2, 4)})
    return Case("images", make, grid, "decode on both cores")


def io_numpy_case(quick: bool) -> Case:
    def make():
        p = (lab.Pipeline(range(ENDLESS))
             .map(partial(fetch, fetch_ms=8.0), concurrency=1, name="fetch")
             .map(normalize, concurrency=1, name="normalize")
             .batch(16)
             .map(lab.workloads.collate_stack, name="collate"))
        return p, simulated_step(10.0)
    grid = {"fetch": (2, 16), "normalize": (1, 2)} if quick else {"fetch": (1, 2, 4, 8, 16), "normalize": (1, 2, 4)}
    return Case("io-numpy", make, grid, "threads on both stages")


CASES = {"io": io_case, "gil-decode": gil_decode_case, "noisy-neighbour": noisy_neighbour_case,
         "images": images_case, "io-numpy": io_numpy_case}


# -- measuring ---------------------------------------------------------------------------
@dataclass
class Grid:
    points: int
    wall_s: float
    best: Config
    best_rate: float


@dataclass
class Tuned:
    config: Config
    rate: float  # the tuning's own figure for its best
    wall_s: float
    budget_s: float
    tuning: Any


def grid_configs(pipeline: lab.Pipeline, grid: dict[str, tuple[int, ...]], cores: int) -> list[Config]:
    """The tuner's space, with each named thread knob on ``grid``'s ladder and process on its own rungs."""
    space = Space(pipeline, TUNABLE_RUNNERS, cores)
    out = []
    for runner in TUNABLE_RUNNERS:
        start = space.start(runner)
        if runner == "process":
            out += [start.with_knob(WORKERS, n) for n in space.rungs(start, WORKERS)]
            continue
        for values in itertools.product(*grid.values()):
            config = start
            for knob, value in zip(grid, values):
                config = config.with_knob(knob, value)
            out.append(config)
    return out


def run_grid(case: Case, window_s: float) -> Grid:
    pipeline, step = case.make()
    t0 = time.perf_counter()
    bench = Bench(pipeline, step, window_s=window_s)
    try:
        configs = grid_configs(pipeline, case.grid, bench.machine.cores)
        rates: dict[Config, float] = {}
        for i, config in enumerate(configs, 1):
            trial = bench.measure(config, WINDOW_TIMEOUT_S)
            rates[config] = trial.batches_per_s
            log(f"{case.name} grid {i}/{len(configs)}: {config.describe()}: {trial.batches_per_s:.3g} "
                f"[{trial.lo:.3g}-{trial.hi:.3g}] batches/s, {trial.cpu_percent:.0f}% CPU, "
                f"{len(trial.rates)} windows in {trial.elapsed_s:.1f} s")
    finally:
        bench.close()
    best = max(rates, key=lambda c: rates[c] if math.isfinite(rates[c]) else -math.inf)
    return Grid(len(configs), time.perf_counter() - t0, best, rates[best])


def run_tune(case: Case, budget_s: float, window_s: float) -> Tuned:
    pipeline, step = case.make()
    t0 = time.perf_counter()
    tuning = lab.tune(pipeline, step, runners=TUNABLE_RUNNERS, budget_s=budget_s,
                      window_s=min(window_s, budget_s), progress=False)
    wall = time.perf_counter() - t0
    log(f"{case.name} tuned in {wall:.1f} s: {tuning.summary()}")
    for warning in tuning.warnings:
        log(f"  warning: {warning}")
    for line in tuning.log:
        log(f"  {line}")
    return Tuned(tuned_config(tuning), tuning.best_batches_per_s, wall, budget_s, tuning)


def tuned_config(tuning: Any) -> Config:
    best = tuning.best
    if best["runner"] == "process":
        return Config.of("process", {WORKERS: best["options"]["num_workers"]})
    return Config.of(best["runner"], best["concurrency"])


def side_by_side(case: Case, configs: list[Config], rounds: int, window_s: float,
                 search_workers: int = 0) -> tuple[dict[Config, list[float]], dict[int, float]]:
    """Rates of ``configs`` over ``rounds`` rounds, the order rotated each round; first, when
    ``search_workers``, the process runner at 1 .. that many workers measured (the hand search)."""
    pipeline, step = case.make()
    bench = Bench(pipeline, step, window_s=window_s)
    hand: dict[int, float] = {}
    try:
        for n in range(1, search_workers + 1):
            hand[n] = bench.measure(Config.of("process", {WORKERS: n}), WINDOW_TIMEOUT_S).batches_per_s
            log(f"{case.name} by hand: process num_workers={n}: {hand[n]:.3g} batches/s")
        if hand:
            best_n = max(hand, key=lambda n: hand[n])
            configs = [*configs, Config.of("process", {WORKERS: best_n})]
        configs = list(dict.fromkeys(configs))
        rates: dict[Config, list[float]] = {c: [] for c in configs}
        for r in range(rounds):
            for config in configs[r % len(configs):] + configs[:r % len(configs)]:
                rates[config].append(bench.rate_once(config, WINDOW_TIMEOUT_S).batches_per_s)
    finally:
        bench.close()
    return rates, hand


def ratio(rates: dict[Config, list[float]], a: Config, b: Config) -> float:
    """Median over rounds of a's rate over b's in the same round."""
    return statistics.median(x / y for x, y in zip(rates[a], rates[b]) if y > 0)


def log(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


# -- the three parts ---------------------------------------------------------------------
def versus_grid(case: Case, args: argparse.Namespace) -> tuple[list[Any], Tuned, Grid]:
    grid = run_grid(case, args.window)
    budget = args.budget if args.budget else TIME_TARGET * grid.wall_s
    tuned = run_tune(case, budget, args.window)
    rates, _ = side_by_side(case, [grid.best, tuned.config], args.rounds, args.window)
    rate_ratio = ratio(rates, tuned.config, grid.best)
    same = " (same)" if tuned.config == grid.best else ""
    time_ratio = tuned.wall_s / grid.wall_s
    row = [case.name, grid.points, f"{grid.wall_s:.0f}", f"{statistics.median(rates[grid.best]):.1f}",
           f"{tuned.wall_s:.0f}", f"{statistics.median(rates[tuned.config]):.1f}",
           f"{rate_ratio:.2f}{same}", f"{time_ratio:.2f}",
           "PASS" if rate_ratio >= RATE_TARGET else "FAIL", "PASS" if time_ratio <= TIME_TARGET else "FAIL"]
    return row, tuned, grid


def versus_dataloader(case: Case, tuned: Tuned, cores: int, args: argparse.Namespace) -> list[Any]:
    at_cores = Config.of("process", {WORKERS: cores})
    rates, hand = side_by_side(case, [tuned.config, at_cores], args.rounds, args.window,
                               search_workers=cores + 2)
    best_n = max(hand, key=lambda n: hand[n])
    by_hand = Config.of("process", {WORKERS: best_n})
    med = {c: statistics.median(r) for c, r in rates.items()}
    return [case.name, tuned.config.describe(), f"{med[tuned.config]:.1f}", f"{med[at_cores]:.1f}",
            best_n, f"{med[by_hand]:.1f}", f"{ratio(rates, tuned.config, at_cores):.2f}",
            f"{ratio(rates, tuned.config, by_hand):.2f}"]


def repeatability(case: Case, first: Tuned | None, budget_s: float, args: argparse.Namespace) -> None:
    tunings = [first] if first is not None else []
    while len(tunings) < 3:
        tunings.append(run_tune(case, budget_s, args.window))
    configs = list(dict.fromkeys(t.config for t in tunings))
    rates, _ = (side_by_side(case, configs, args.rounds, args.window) if len(configs) > 1
                else ({configs[0]: [tunings[0].rate]}, {}))
    med = {c: statistics.median(r) for c, r in rates.items()}
    rows = [[i, t.config.describe(), f"{t.wall_s:.0f}", f"{t.rate:.1f}", f"{med[t.config]:.1f}"]
            for i, t in enumerate(tunings, 1)]
    print(f"\nRepeatability: {case.name} tuned three times, {budget_s:.0f} s budget each "
          f"(its own figure, and the three bests side by side, {args.rounds} rounds)")
    print_table(["tuning", "best", "wall s", "own b/s", "side by side b/s"], rows)
    own = [t.rate for t in tunings]
    together = [med[t.config] for t in tunings]
    spread_own = max(own) / min(own) - 1
    spread = max(together) / min(together) - 1
    print(f"max/min - 1: own figures {spread_own:.1%}, side by side {spread:.1%} "
          f"{'PASS' if spread <= REPEAT_TARGET else 'FAIL'} (<= {REPEAT_TARGET:.0%})"
          + ("; all three chose the same configuration" if len(configs) == 1 else ""))


# -- main --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small grids, short windows: a smoke run")
    ap.add_argument("--pipelines", nargs="+", choices=list(CASES), default=None,
                    help="default: all; with --quick, all but io-numpy")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds for each tuning (default: 25%% of that pipeline's grid wall time)")
    ap.add_argument("--window", type=float, default=0.0, help="seconds per measured window (default 0.5, quick 0.3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating side-by-side rounds")
    ap.add_argument("--dataloader", nargs="*", choices=list(CASES), default=None,
                    help="pipelines also compared with torch's DataLoader (default gil-decode and images, "
                         "quick: gil-decode; none: skip)")
    ap.add_argument("--repeat", choices=[*CASES, "none"], default="noisy-neighbour",
                    help="the pipeline tuned three times")
    args = ap.parse_args(argv)
    # More DataLoader workers than cores is what the hand search is there to try.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    if args.pipelines is None:
        args.pipelines = [n for n in CASES if not (args.quick and n == "io-numpy")]
    if args.dataloader is None:
        args.dataloader = ["gil-decode"] if args.quick else ["gil-decode", "images"]
    args.window = args.window or (0.3 if args.quick else 0.5)
    if args.rounds < 1 or args.budget < 0:
        ap.error("--rounds >= 1 and --budget >= 0")
    cores = os.cpu_count() or 1
    print(machine_line())
    print(f"# {'quick: small grids, ' if args.quick else ''}windows of {args.window:g} s for grid and tuner; "
          f"tuning budget: {f'{args.budget:g} s' if args.budget else '25% of the grid wall time'}; "
          f"{args.rounds} side-by-side rounds; load average at start {os.getloadavg()[0]:.1f}")
    print("# other load on this machine (it may be shared) makes every figure noisy: "
          "read ratios, not absolute rates\n")
    cases = {name: CASES[name](args.quick) for name in args.pipelines}
    if args.repeat != "none" and args.repeat not in cases:
        cases_extra = {args.repeat: CASES[args.repeat](args.quick)}
    else:
        cases_extra = {}

    rows, configs, tuned_by_name, budgets = [], [], {}, {}
    for name, case in cases.items():
        try:
            row, tuned, grid = versus_grid(case, args)
        except Exception:
            log(f"{name} failed:\n{traceback.format_exc()}")
            rows.append([name, *["ERROR"] * 9])
            continue
        rows.append(row)
        configs.append([name, case.answer, grid.best.describe(), tuned.config.describe()])
        tuned_by_name[name], budgets[name] = tuned, tuned.budget_s
    print(f"Tuned against the grid (>= {RATE_TARGET:.0%} of the grid best's batches/s, side by side, "
          f"in <= {TIME_TARGET:.0%} of its wall time)")
    print_table(["pipeline", "grid points", "grid s", "grid b/s", "tune s", "tuned b/s",
                 "tuned/grid", "time tune/grid", "rate", "time"], rows)
    for name, answer, grid_best, tuned_best in configs:
        print(f"\n{name} (expected: {answer})\n  grid best:  {grid_best}\n  tuned best: {tuned_best}")

    dl_rows = []
    for name in args.dataloader:
        if name not in tuned_by_name:
            continue
        try:
            dl_rows.append(versus_dataloader(cases[name], tuned_by_name[name], cores, args))
        except Exception:
            log(f"{name} vs DataLoader failed:\n{traceback.format_exc()}")
    if dl_rows:
        print(f"\nAgainst torch's DataLoader (the process runner), side by side, {args.rounds} rounds; "
              f"num_workers by hand: the best of 1..{cores + 2}")
        print_table(["pipeline", "tuned", "tuned b/s", f"DL nw={cores} b/s", "nw by hand", "DL by hand b/s",
                     f"tuned/nw={cores}", "tuned/by hand"], dl_rows)

    if args.repeat != "none":
        case = cases.get(args.repeat) or cases_extra[args.repeat]
        budget = args.budget or budgets.get(args.repeat) or 30.0
        try:
            repeatability(case, tuned_by_name.get(args.repeat), budget, args)
        except Exception:
            log(f"repeatability failed:\n{traceback.format_exc()}")
    print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
