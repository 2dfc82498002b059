"""The parallelism study (shared/seeds/000) reproduced on this machine.

Runs ``lab.compare`` on ``lab.workloads.noisy_neighbour()`` under every
runner and prints the table with batches/s relative to ``cache`` (headspace),
then checks the seed's shape:

* subprocess-threads >= 0.85x cache   (the child keeps its GIL to itself)
* thread <= 0.75x process             (decoders take the training thread's GIL)
* process < subprocess-threads        (workers compete for the cores, batches pickled)
* the training thread's GIL wait under thread >= 3x that under subprocess-threads

    python benchmarks/parallelism.py [--steps 150] [--warmup 20] [--repeats 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line  # noqa: E402

import spdl_lab as lab  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10, help="warm-up steps per runner in each round")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the table shows medians")
    ap.add_argument("--num-workers", type=int, default=2, help="DataLoader workers for 'process'")
    args = ap.parse_args(argv)

    print(machine_line())
    pipeline, device = lab.workloads.noisy_neighbour()
    print(f"# {device!r}; {args.steps} measured steps after {args.warmup} warm-up; "
          f"process: num_workers={args.num_workers}; repeats={args.repeats}\n")
    cmp = lab.compare(
        pipeline, step=device, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
        runner_options={"process": {"num_workers": args.num_workers}},
    )
    table = cmp.table
    print(cmp)
    print()
    r = table["vs_cache"]
    gil = table["train_gil_wait_frac"]
    checks = [
        ("subprocess-threads >= 0.85x cache", r["subprocess-threads"], r["subprocess-threads"] >= 0.85),
        ("thread <= 0.75x process", r["thread"] / r["process"], r["thread"] / r["process"] <= 0.75),
        ("process < subprocess-threads", r["process"] / r["subprocess-threads"],
         r["process"] < r["subprocess-threads"]),
        ("training-thread GIL wait, thread / subprocess-threads >= 3",
         gil["thread"] / gil["subprocess-threads"], gil["thread"] >= 3 * gil["subprocess-threads"]),
    ]
    for label, value, ok in checks:
        print(f"{'PASS' if ok else 'MISS'}  {label}: {value:.2f}")


if __name__ == "__main__":
    main()
