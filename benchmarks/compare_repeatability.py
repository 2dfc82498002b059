"""Do two back-to-back compares of the same pipeline agree within their stated spread?

Runs ``lab.compare`` on the noisy-neighbour workload ``--runs`` times in a row (default 2),
in one process, and prints each runner's batches/s with its [lo-hi] range per run, the
ratio to cache with its range, and whether every pair of runs agrees: their ranges
overlap. ``--load N`` adds N busy processes for the whole benchmark (a loaded machine).
With ``--sequential`` each compare is one round per runner (``repeats=1``, the
measurement as it was before interleaving): the spread between runs is then all there
is to go by.

    python benchmarks/compare_repeatability.py [--runs 2] [--steps 200] [--load 1] [--sequential]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, print_table  # noqa: E402

import spdl_lab as lab  # noqa: E402
from spdl_lab._experiments.compare import DEFAULT_STEPS  # noqa: E402


def _burn(stop) -> None:
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i * i


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the benchmark")
    ap.add_argument("--sequential", action="store_true", help="repeats=1: one window per runner")
    args = ap.parse_args(argv)

    print(machine_line())
    repeats = 1 if args.sequential else None
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    burners = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    try:
        pipeline, device = lab.workloads.noisy_neighbour()
        runs = []
        for i in range(args.runs):
            t0 = time.perf_counter()
            cmp = lab.compare(pipeline, step=device, steps=args.steps, repeats=repeats,
                              runner_options={"process": {"num_workers": 2}}, progress=False)
            runs.append(cmp)
            print(f"# run {i + 1}: {time.perf_counter() - t0:.0f} s, {cmp.repeats} round(s), "
                  f"load {args.load}; warnings: {len(cmp.warnings)}")
            for w in cmp.warnings:
                print(f"#   - {w}")
    finally:
        stop.set()
        for b in burners:
            b.join(5)
    _report(runs)


def _report(runs: list[lab.Comparison]) -> None:
    runners = list(runs[0].table.index)
    rows = []
    for r in runners:
        cells: list[object] = [r]
        for cmp in runs:
            t = cmp.table.loc[r]
            cells.append(f"{t.batches_per_s:.2f} [{t.batches_per_s_lo:.2f}-{t.batches_per_s_hi:.2f}]")
            cells.append(f"{t.vs_cache:.2f} [{t.vs_cache_lo:.2f}-{t.vs_cache_hi:.2f}]")
        agree = all(_overlap(a.table.loc[r], b.table.loc[r]) for a in runs for b in runs if a is not b)
        cells.append("yes" if agree else "NO")
        rows.append(cells)
    headers = ["runner"]
    for i in range(len(runs)):
        headers += [f"run {i + 1} batches/s [lo-hi]", f"run {i + 1} vs cache"]
    print()
    print_table(headers + ["runs agree"], rows)
    spread = max(abs(a.table.loc[r, "vs_cache"] - b.table.loc[r, "vs_cache"])
                 for r in runners for a in runs for b in runs)
    print(f"\nlargest difference of a runner's vs-cache ratio between runs: {spread:.3f}")


def _overlap(a, b) -> bool:
    return a.batches_per_s_lo <= b.batches_per_s_hi and b.batches_per_s_lo <= a.batches_per_s_hi


if __name__ == "__main__":
    main()
