"""The real workloads under every runner and under plain torch DataLoaders, side by side.

Issue 18: ``lab.workloads.images`` (JPEG read, PIL decode, random-resized-crop + flip,
normalize; a small conv net step on CPU) and ``lab.workloads.text`` (a Rust or a
pure-Python WordPiece tokenizer; a small embedding model step), each run

* as a ``lab.Pipeline`` under ``thread``, ``subprocess-threads``, ``process`` and ``cache``
  (the headspace: loading made free), through ``lab.compare``;
* as a plain map-style Dataset in a ``torch.utils.data.DataLoader`` with ``num_workers``
  in (0, 1, 2, 4), what users have today (``image_dataloader``, ``text_dataloader``),
  through ``lab.run``.

Design. ``--rounds`` rounds; each round runs every configuration once, in the same
order (one ``lab.compare`` with one repeat over the four runners, then the four
DataLoaders), so a slow spell of the shared machine falls on every configuration
alike. In each run the first ``--warmup`` steps (start-up: threads, a child process,
DataLoader workers) are not counted: a runner's rate is what ``compare`` measures after
its warm-up, a DataLoader's is the steady rate from the StepClock's per-step records
after the same number of steps. Printed per workload: batches/s median [min-max] over
the rounds, the ratio to the best configuration that really loads (``cache`` aside),
the share of the loop spent waiting for data and the CPU; then the best runner, the
best ``num_workers`` and their ratio.

    python benchmarks/real_workloads.py [--workloads images text-rust text-python] [--rounds 3]
                                        [--steps 60] [--warmup 10] [--step model|simulated]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, print_table  # noqa: E402

RUNNERS = ("thread", "subprocess-threads", "process", "cache")
NUM_WORKERS = (0, 1, 2, 4)
WORKLOADS = ("images", "text-rust", "text-python")
IMAGE_BATCH, IMAGE_CROP, IMAGE_FILES = 16, 128, 512
TEXT_BATCH = 32


def make(workload: str, batches: int, step_kind: str):
    """(pipeline, step, dataloader factory) for ``workload``, each long enough for ``batches``."""
    import spdl_lab as lab

    device = "simulated" if step_kind == "simulated" else None
    if workload == "images":
        epochs = -(-batches * IMAGE_BATCH // IMAGE_FILES)
        pipeline, step = lab.workloads.images(n=IMAGE_FILES, crop=IMAGE_CROP, batch_size=IMAGE_BATCH,
                                              epochs=epochs, device=device)

        def dataloader(num_workers: int):
            return lab.workloads.image_dataloader(n=batches * IMAGE_BATCH, batch_size=IMAGE_BATCH,
                                                  num_workers=num_workers, crop=IMAGE_CROP)
        return pipeline, step, dataloader
    tokenizer = workload.split("-", 1)[1]
    n = batches * TEXT_BATCH
    pipeline, step = lab.workloads.text(n=n, tokenizer=tokenizer, batch_size=TEXT_BATCH, device=device)

    def dataloader(num_workers: int):
        return lab.workloads.text_dataloader(n=n, batch_size=TEXT_BATCH, num_workers=num_workers,
                                             tokenizer=tokenizer)
    return pipeline, step, dataloader


def run_dataloader(dl, step, steps: int, warmup: int) -> dict[str, float]:
    """One lab.run over ``dl``: the steady batches/s after ``warmup`` steps, data wait, CPU."""
    import spdl_lab as lab

    session = lab.run(dl, step=step, steps=warmup + steps)
    if not session.wait(timeout=600):
        session.stop()
        raise RuntimeError("a DataLoader run did not finish in 600 s")
    done = session.clock.records()[warmup:]
    rate = (len(done) - 1) / (done[-1].end_s - done[0].end_s)
    frames = session.frames()
    cpu = frames[(frames.series == "cpu_percent") & (frames.stage == "total")].value
    wait = sum(r.data_wait_s for r in done) / sum(r.data_wait_s + r.step_s for r in done)
    return {"batches_per_s": rate, "data_wait_frac": wait, "cpu_percent": float(cpu.median())}


def measure(workload: str, args) -> dict[str, list[dict[str, float]]]:
    import spdl_lab as lab

    pipeline, step, dataloader = make(workload, args.warmup + args.steps, args.step)
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    for r in range(args.rounds):
        cmp = lab.compare(pipeline, step=step, runners=RUNNERS, steps=args.steps, warmup=args.warmup,
                          repeats=1, progress=False)
        for runner in RUNNERS:
            row = cmp.table.loc[runner]
            results[runner].append({k: float(row[k]) for k in ("batches_per_s", "data_wait_frac",
                                                                 "cpu_percent")})
        for workers in NUM_WORKERS:
            results[f"DataLoader num_workers={workers}"].append(
                run_dataloader(dataloader(workers), step, args.steps, args.warmup))
        print(f"# {workload}: round {r + 1}/{args.rounds} done", flush=True)
    return results


def report(workload: str, results: dict[str, list[dict[str, float]]]) -> None:
    medians = {name: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for name, runs in results.items()}
    loading = {name: m for name, m in medians.items() if name != "cache"}
    best_name = max(loading, key=lambda name: loading[name]["batches_per_s"])
    best = loading[best_name]["batches_per_s"]
    rows = []
    for name, runs in results.items():
        rates = [x["batches_per_s"] for x in runs]
        m = medians[name]
        label = "cache (headspace)" if name == "cache" else name
        rows.append([label, f"{m['batches_per_s']:.2f} [{min(rates):.2f}-{max(rates):.2f}]",
                     f"{m['batches_per_s'] / best:.2f}", f"{m['data_wait_frac']:.0%}", f"{m['cpu_percent']:.0f}"])
    print(f"\n{workload}")
    print_table(["configuration", "batches/s [min-max]", "vs best", "data wait", "CPU %"], rows)
    runner = max((n for n in loading if n in RUNNERS), key=lambda n: loading[n]["batches_per_s"])
    plain = max((n for n in loading if n.startswith("DataLoader")), key=lambda n: loading[n]["batches_per_s"])
    ratio = loading[runner]["batches_per_s"] / loading[plain]["batches_per_s"]
    print(f"best runner: {runner}; best plain {plain}; {runner} / that DataLoader = {ratio:.2f}x; "
          f"the headspace (cache) is {medians['cache']['batches_per_s'] / best:.2f}x the best")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="counted steps per configuration and round")
    ap.add_argument("--warmup", type=int, default=10, help="steps not counted at the start of each run")
    ap.add_argument("--step", choices=("model", "simulated"), default="model",
                    help="the training step: the small real model on CPU, or a SimulatedDevice")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 3 or args.warmup < 1:
        ap.error("--rounds >= 1, --steps >= 3 and --warmup >= 1")
    print(machine_line())
    print(f"# {args.rounds} rounds x ({len(RUNNERS)} runners + {len(NUM_WORKERS)} DataLoaders), "
          f"{args.steps} counted steps after {args.warmup} each; step: {args.step}")
    t0 = time.perf_counter()
    for workload in args.workloads:
        report(workload, measure(workload, args))
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
