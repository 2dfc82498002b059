"""How repeatable is ``lab.diagnose``? The same pipeline, diagnosed several times, side by side with SPDL.

One 3-stage pipeline (``read``: a 2 ms sleep; ``parse``: pure Python;
``checksum``: sha256 of 1 MB, which releases the GIL) is diagnosed ``--runs``
times with the default concurrency (1, 2, 4, 8, 16) and settings. Printed:

* QPS at each (stage, executor, concurrency) per run, its spread
  ((max - min) / median) and its largest deviation from the median (target:
  within +-10%);
* the verdict and best concurrency per run (target: the same every run);
* the wall time of each diagnose (target: <= 60 s).

When SPDL (``spdl_core``) is installed, the pipeline is an SPDL
``PipelineConfig``: lab diagnoses ``lab.from_spdl(config)``, and the very same
config goes through ``spdl.pipeline.profile_pipeline`` ``--runs`` times (its
fixed concurrencies 32, 16, 8, 4, 1; one pass over ``--spdl-inputs`` items
each). The same figures are printed for both, with the best concurrency by
lab's rule (the smallest within 5% of the best QPS).

    python benchmarks/diagnose_repeatability.py [--runs 3] [--num-items 100] [--spdl-inputs 1000]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, print_table  # noqa: E402

import spdl_lab as lab  # noqa: E402
from spdl_lab._diagnose.result import BEST_WITHIN  # noqa: E402

#: Largest deviation from the median QPS, over runs, that counts as repeatable.
TARGET_DEVIATION = 0.10
#: Longest acceptable wall time of one diagnose with the defaults.
TARGET_WALL_S = 60.0

BLOB = bytes(range(256)) * 4096  # 1 MB


def read(i: int) -> int:
    time.sleep(0.002)  # stands for storage or network I/O: releases the GIL
    return i


def parse(i: int) -> int:
    total = 0  # pure Python: holds the GIL
    for k in range(20_000):
        total += k * k % 7
    return i


def checksum(i: int) -> bytes:
    return hashlib.sha256(BLOB).digest()  # releases the GIL for buffers over 2 KB


STAGES = (("read", read), ("parse", parse), ("checksum", checksum))


def spdl_config(items: int):
    """The pipeline as an SPDL PipelineConfig, or None without spdl_core."""
    try:
        from spdl.pipeline.defs import Pipe, PipelineConfig, SinkConfig, SourceConfig
    except ImportError:
        return None
    return PipelineConfig(src=SourceConfig(range(items)),
                          pipes=[Pipe(fn, concurrency=4, name=name) for name, fn in STAGES],
                          sink=SinkConfig(2))


def lab_pipeline(items: int) -> lab.Pipeline:
    """The same pipeline for lab: converted from SPDL's config when spdl_core is installed."""
    config = spdl_config(items)
    if config is not None:
        return lab.from_spdl(config)
    pipeline = lab.Pipeline(range(items))
    for name, fn in STAGES:
        pipeline = pipeline.map(fn, concurrency=4, name=name)
    return pipeline


# -- lab.diagnose ------------------------------------------------------------------

def run_lab(runs: int, num_items: int) -> None:
    source = "lab.from_spdl(the SPDL config below)" if spdl_config(1) is not None else "a lab.Pipeline"
    print(f"## lab.diagnose x {runs} of {source}: default concurrency and settings, "
          f"num_items={num_items}\n")
    diagnoses, walls = [], []
    for r in range(runs):
        before = _bytecode_rate()
        t0 = time.perf_counter()
        diagnoses.append(lab.diagnose(lab_pipeline(10 * num_items), num_items=num_items, progress=False))
        walls.append(time.perf_counter() - t0)
        print(f"run {r + 1}: {walls[-1]:.1f} s  (load average {_load()}; this core ran the same Python "
              f"loop at {before:.1f} then {_bytecode_rate():.1f} M iterations/s)", flush=True)
    print()

    qps: dict[tuple[str, str, int], list[float]] = {}
    for r, diag in enumerate(diagnoses):
        for stage in diag.stages.values():
            for p in stage.points:
                qps.setdefault((p.stage, p.executor, p.concurrency), [math.nan] * runs)[r] = p.qps
    order = {name: i for i, (name, _) in enumerate(STAGES)}
    keys = sorted(qps, key=lambda k: (order[k[0]], k[1] != "thread", k[2]))
    print_spread(["stage", "executor", "concurrency"], [(list(k), qps[k]) for k in keys], runs)

    rows = []
    for name, _ in STAGES:
        verdicts = [d.stages[name].verdict or "-" for d in diagnoses]
        bests = [d.stages[name].best_concurrency for d in diagnoses]
        same = len(set(verdicts)) == 1 and len(set(bests)) == 1
        rows.append([name, *(f"{v} @ {b}" for v, b in zip(verdicts, bests)), "yes" if same else "NO"])
    print_table(["stage", *(f"run {r + 1}" for r in range(runs)), "same"], rows)
    print()
    over = [w for w in walls if w > TARGET_WALL_S]
    print(f"{'PASS' if not over else 'MISS'}  wall time per diagnose <= {TARGET_WALL_S:.0f} s: "
          + ", ".join(f"{w:.1f} s" for w in walls) + "\n")


# -- SPDL's profile_pipeline ---------------------------------------------------------

def run_spdl(runs: int, num_inputs: int) -> None:
    try:
        from spdl.pipeline import profile_pipeline
    except ImportError:
        print("## SPDL: spdl_core is not installed; skipped")
        return
    from importlib.metadata import version

    print(f"## SPDL {version('spdl_core')} profile_pipeline x {runs}: num_inputs={num_inputs}\n")
    config = spdl_config(10 * num_inputs)
    qps: dict[tuple[str, int], list[float]] = {}
    walls = []
    for r in range(runs):
        t0 = time.perf_counter()
        results = profile_pipeline(config, num_inputs=num_inputs)
        walls.append(time.perf_counter() - t0)
        print(f"run {r + 1}: {walls[-1]:.1f} s  (load average {_load()})", flush=True)
        for result in results:
            for stat in result.stats:
                qps.setdefault((result.name, stat.concurrency), [math.nan] * runs)[r] = stat.qps
    print()
    order = {name: i for i, (name, _) in enumerate(STAGES)}
    keys = sorted(qps, key=lambda k: (order[k[0]], k[1]))
    print_spread(["stage", "concurrency"], [(list(k), qps[k]) for k in keys], runs)

    rows = []
    for name, _ in STAGES:
        per_run = [{c: v[r] for (s, c), v in qps.items() if s == name} for r in range(runs)]
        bests = [_best(levels) for levels in per_run]
        rows.append([name, *bests, "yes" if len(set(bests)) == 1 else "NO"])
    print_table(["stage", *(f"best c, run {r + 1}" for r in range(runs)), "same"], rows)
    print("\nwall time per profile_pipeline: " + ", ".join(f"{w:.1f} s" for w in walls))


# -- shared --------------------------------------------------------------------------

def print_spread(key_headers: list[str], rows: Sequence[tuple[list[object], list[float]]], runs: int) -> None:
    """QPS per run, the median, (max - min) / median, and the largest deviation from the median."""
    table, deviations = [], []
    for key, values in rows:
        seen = [v for v in values if not math.isnan(v)]
        mid = statistics.median(seen) if seen else math.nan
        spread = (max(seen) - min(seen)) / mid if len(seen) > 1 and mid > 0 else math.nan
        dev = max(abs(v - mid) for v in seen) / mid if len(seen) > 1 and mid > 0 else math.nan
        if len(seen) == runs and not math.isnan(dev):
            deviations.append(dev)
        flag = "" if math.isnan(dev) or dev <= TARGET_DEVIATION else " *"
        table.append([*key, *(v if not math.isnan(v) else "-" for v in values), mid,
                      _pct(spread), _pct(dev) + flag])
    headers = [*key_headers, *(f"qps run {r + 1}" for r in range(runs)), "median", "spread", "max dev"]
    print_table(headers, table)
    within = sum(d <= TARGET_DEVIATION for d in deviations)
    worst = max(deviations) if deviations else math.nan
    print(f"\n{within} of {len(deviations)} points measured in every run are within "
          f"+-{TARGET_DEVIATION:.0%} of their median (* marks the others); the worst is {_pct(worst)}\n")


def _best(levels: dict[int, float]) -> int | str:
    ok = {c: q for c, q in levels.items() if not math.isnan(q)}
    if not ok:
        return "-"
    top = max(ok.values())
    return min(c for c, q in ok.items() if q >= (1 - BEST_WITHIN) * top)


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1%}"


def _bytecode_rate() -> float:
    """Million iterations/s of a fixed Python loop, best of 5: the VM's CPU speed
    drifts, and single-core Python stages drift with it."""
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i
        best = min(best, time.perf_counter() - t0)
    return 0.2 / best


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="diagnoses (and SPDL profiles) to compare")
    ap.add_argument("--num-items", type=int, default=100, help="inputs lab.diagnose caches per stage")
    ap.add_argument("--spdl-inputs", type=int, default=1000,
                    help="items per pass of SPDL's profile_pipeline (its own default is 1000)")
    ap.add_argument("--no-spdl", action="store_true", help="skip SPDL's profile_pipeline")
    args = ap.parse_args(argv)

    print(machine_line())
    print(f"# stages: read (sleep 2 ms), parse (pure Python), checksum (sha256 of 1 MB); "
          f"load average at start {_load()}\n")
    run_lab(args.runs, args.num_items)
    if not args.no_spdl:
        run_spdl(args.runs, args.spdl_inputs)


if __name__ == "__main__":
    main()
