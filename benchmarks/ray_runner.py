"""The ray runner beside the local ones, on this machine: batches/s, start-up, per-batch overhead.

Three pipelines, each under thread, subprocess-threads, process and ray, one after
the other in one process (each runner's figure is the median of --repeats runs,
the runners interleaved within each repeat):

  * empty   -- map(no-op) -> batch(32) -> map(len): the machinery alone; its time per
               batch is the runner's per-batch overhead (the floor is the thread runner's)
  * ipc     -- lab.workloads.ipc_overhead at a small size: 32 arrays of 0.6 MB per batch,
               a fetch that waits 1 ms; what moving batches between processes costs
  * cpu     -- a numpy decode that releases the GIL, 8 ms per item on one core, batches of 8

Start-up is the time from opening the Loader to its first batch: for ray with a local
instance it includes starting Ray (GCS, raylet) and its worker processes, which a
long-lived cluster pays once. The steady rate excludes it (batches after the first).

Then the lab against what a Ray user writes by hand, on one warm instance: load (a 64x64
float32 array) -> work (tanh of matmuls, the GIL released) -> batch(32) -> a sum in the
consumer; whole-run wall time, first batch included. The plain forms are
``ray.data.range(n).map(load).map(work)`` with ``iter_batches(batch_size=32)``, and one
``map_batches`` doing all of it; the lab's stages run at concurrency 2 (the cores, as Ray
Data's own default uses every CPU), ordered as by default and with ``ordered=False`` (as
plain Ray Data's default, ``preserve_order=False``). The ratio is the faster plain form's time
over the lab's (1.0 or more: the lab is as fast); the thread runner is the floor without Ray.

    python benchmarks/ray_runner.py [--repeats 2] [--batches 40] [--plain-repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, print_table  # noqa: E402

import spdl_lab as lab  # noqa: E402

RUNNERS = ("thread", "subprocess-threads", "process", "ray")
#: ray measured twice: "ray (cold)" starts and stops its own local instance, as
#: lab.Loader(p, runner="ray") does; "ray (warm)" joins an instance already up, as on a cluster.
COLD, WARM = "ray (cold)", "ray (warm)"


def noop(x):
    return x


def cpu_decode(i: int, *, ms: float) -> np.ndarray:
    """numpy work (the GIL released inside), about ``ms`` of one core."""
    rng = np.random.default_rng(i)
    a = rng.random((256, 256))
    deadline = time.thread_time() + ms / 1e3
    while time.thread_time() < deadline:
        a = np.sqrt(a * a + 1.0)
    return a[:64, :64].astype(np.float32)


def stack(items):
    return np.stack(items)


def pipelines(batches: int) -> dict[str, lab.Pipeline]:
    empty = lab.Pipeline(range(32 * batches)).map(noop, concurrency=2, name="noop").batch(32).map(len, name="len")
    ipc = lab.workloads.ipc_overhead(items=32 * batches, shape=(500, 150), fetch_s=0.001, batch_size=32,
                                     concurrency=8)
    cpu = (lab.Pipeline(range(8 * batches)).map(partial(cpu_decode, ms=8.0), concurrency=2, name="decode")
           .batch(8).map(stack, name="stack"))
    return {"empty": empty, "ipc": ipc, "cpu": cpu}


def load(i: int) -> np.ndarray:
    return np.random.default_rng(int(i)).random((64, 64), dtype=np.float32)


def work(a: np.ndarray, reps: int = 1) -> np.ndarray:
    for _ in range(reps):
        a = np.tanh(a @ a / 64)
    return a


def lab_form(n: int, reps: int, runner: str = "ray", ordered: bool = True) -> float:
    p = (lab.Pipeline(range(n)).map(load, concurrency=2, name="load", ordered=ordered)
         .map(partial(work, reps=reps), concurrency=2, name="work", ordered=ordered).batch(32))
    t0, total = time.perf_counter(), 0.0
    with lab.Loader(p, runner=runner) as loader:
        for batch in loader:
            total += float(np.sum(batch))
    return time.perf_counter() - t0


def plain_maps(n: int, reps: int) -> float:
    import ray.data

    t0, total = time.perf_counter(), 0.0
    ds = ray.data.range(n).map(lambda r: {"x": load(r["id"])}).map(lambda r: {"x": work(r["x"], reps)})
    for batch in ds.iter_batches(batch_size=32, batch_format="numpy"):
        total += float(batch["x"].sum())
    return time.perf_counter() - t0


def plain_map_batches(n: int, reps: int) -> float:
    import ray.data

    t0, total = time.perf_counter(), 0.0
    ds = ray.data.range(n).map_batches(lambda b: {"x": np.stack([work(load(i), reps) for i in b["id"]])},
                                       batch_size=32)
    for batch in ds.iter_batches(batch_size=32, batch_format="numpy"):
        total += float(batch["x"].sum())
    return time.perf_counter() - t0


#: (items, matmuls per item): the issue's two sizes, light and ten times heavier.
PLAIN_CASES = ((6000, 1), (3000, 10))


def versus_plain(repeats: int) -> None:
    """The lab's ray runner against plain Ray Data on one warm instance, interleaved per repeat."""
    import ray.data

    from spdl_lab._runners._ray_cluster import RayConnection

    held = RayConnection(None, None)
    held.open()
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        forms = {"lab ray": lab_form, "lab ray, ordered=False": partial(lab_form, ordered=False),
                 "plain map().map()": plain_maps, "plain map_batches": plain_map_batches,
                 "lab thread": partial(lab_form, runner="thread")}
        rows = []
        for n, reps in PLAIN_CASES:
            for form in forms.values():
                form(256, reps)  # workers started, functions exported: a warm instance
            times: dict[str, list[float]] = {name: [] for name in forms}
            for repeat in range(repeats):
                for name in list(forms)[repeat % len(forms):] + list(forms)[:repeat % len(forms)]:
                    times[name].append(forms[name](n, reps))
            med = {name: statistics.median(t) for name, t in times.items()}
            plain = min(med["plain map().map()"], med["plain map_batches"])
            rows += [(f"{n} x {reps}", name, m, plain / m) for name, m in med.items()]
            print(f"# {n} items x {reps}: " + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()), file=sys.stderr)
    finally:
        held.close()
    print()
    print_table(["items x matmuls", "form", "wall s (median)", "faster plain / this"], rows)
    print("\n'faster plain / this' at 1.0 or above: as fast as the faster plain Ray Data form. "
          "lab thread is the floor without Ray. The plain forms run with Ray Data's default, "
          "preserve_order=False; the lab's stages are ordered unless ordered=False.")


def run_once(pipeline: lab.Pipeline, runner: str) -> tuple[float, float, int]:
    """(start-up s, steady batches/s, batches) of one pass."""
    t0 = time.perf_counter()
    with lab.Loader(pipeline, runner=runner) as loader:
        it = iter(loader)
        next(it)
        t1 = time.perf_counter()
        n = sum(1 for _ in it)
        t2 = time.perf_counter()
    return t1 - t0, (n / (t2 - t1) if t2 > t1 and n else float("nan")), n + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--plain-repeats", type=int, default=5, help="repeats of the plain Ray Data rows")
    parser.add_argument("--only-plain", action="store_true", help="only the rows against plain Ray Data")
    args = parser.parse_args()
    print(machine_line())
    if args.only_plain:
        versus_plain(args.plain_repeats)
        return
    from spdl_lab._runners._ray_cluster import RayConnection

    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    names = (*RUNNERS[:-1], COLD, WARM)
    for name, pipeline in pipelines(args.batches).items():
        for repeat in range(args.repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for label in order:
                held = RayConnection(None, None) if label == WARM else None
                if held is not None:
                    held.open()
                    run_once(pipeline, "ray")  # its workers started: a cluster that is up
                try:
                    start, rate, n = run_once(pipeline, "ray" if label in (COLD, WARM) else label)
                finally:
                    if held is not None:
                        held.close()
                results.setdefault((name, label), []).append((start, rate))
                print(f"# {name} {label} repeat {repeat + 1}: start-up {start:.2f} s, {rate:.1f} batches/s "
                      f"over {n - 1} batches", file=sys.stderr)
    rows = []
    floor = {name: statistics.median(r for _, r in results[(name, "thread")]) for name in pipelines(1)}
    for (name, runner), runs in results.items():
        start = statistics.median(s for s, _ in runs)
        rate = statistics.median(r for _, r in runs)
        per_batch_ms = 1e3 / rate if rate > 0 else float("nan")
        rows.append((name, runner, start, rate, per_batch_ms, rate / floor[name]))
    print()
    print_table(["pipeline", "runner", "start-up s", "batches/s", "ms per batch", "vs thread"], rows)
    print("\nms per batch of 'empty' is each runner's per-batch overhead (no work in the stages). "
          "ray (cold) starts and stops a local Ray instance per Loader (address=None); ray (warm) joins "
          "one already up, as a Loader on a running cluster does.")
    versus_plain(args.plain_repeats)


if __name__ == "__main__":
    main()
