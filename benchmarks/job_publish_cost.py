"""What publishing costs each rank of a data-parallel job: the same 2-rank DDP job
(``lab.workloads.job_script("ddp")``, gloo on the CPU, balanced) run plain under ``torchrun`` and
under ``spdl-lab watch -- torchrun`` (every rank publishes its DataLoader: meters in its workers,
sampler, endpoint, record), alternating, ``--rounds`` times each. The figure is each rank's own
count (its script's steps over their time, the first tenth left out: the loader's start-up), so the
lab measures nothing of itself here.

    python benchmarks/job_publish_cost.py [--rounds 3] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import machine_line, print_table

import spdl_lab as lab

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def run_job(folder: Path, watched: bool, steps: int) -> dict[int, float]:
    """One run of the job; each rank's steps/s by its own count."""
    timing = folder / "timing"
    job = [TORCHRUN, "--nproc_per_node=2", "--standalone", str(lab.workloads.job_script("ddp")),
           "--steps", str(steps), "--timing", str(timing)]
    command = ([sys.executable, "-m", "spdl_lab", "watch", "--name", "cost", "--record", str(folder / "job"), "--",
                *job] if watched else job)
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"the job failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return {int(p.stem[4:]): json.loads(p.read_text())["warm_steps_per_s"] for p in sorted(timing.glob("rank*.json"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(machine_line())
    rates: dict[tuple[bool, int], list[float]] = {}
    for i in range(args.rounds):
        for watched in (False, True) if i % 2 == 0 else (True, False):  # alternate which goes first
            with tempfile.TemporaryDirectory(prefix="spdl_lab_cost_") as tmp:
                for rank, rate in run_job(Path(tmp), watched, args.steps).items():
                    rates.setdefault((watched, rank), []).append(rate)
    rows = []
    for rank in sorted({rank for _, rank in rates}):
        plain, watched = (statistics.median(rates[(w, rank)]) for w in (False, True))
        rows.append([f"rank {rank}", plain, watched, watched / plain,
                     " ".join(f"{r:.1f}" for r in rates[(False, rank)]),
                     " ".join(f"{r:.1f}" for r in rates[(True, rank)])])
    print(f"\n{args.rounds} rounds of {args.steps} steps each way, alternating; steps/s by each rank's own count")
    print_table(["rank", "plain", "watched", "watched/plain", "plain rounds", "watched rounds"], rows)


if __name__ == "__main__":
    main()
