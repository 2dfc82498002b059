"""Engine overhead: spdl_lab's thread engine against the anchors, side by side.

Two pipelines over N integers, at concurrency 1 and 4:
  * noop2   -- map(no-op) -> map(no-op)
  * batched -- map(no-op) -> batch(32) -> map(len)
through (a) spdl_lab with meters on, (b) meters off, (c) torchdata.nodes
ParallelMapper(method="thread") chains, (d) SPDL's PipelineBuilder, and (e) a
bare queue.Queue thread chain (the floor: no ordering, no meters, no stop path).
Every runner keeps input order and buffers 32 items ahead of the consumer
(3 batches for the batched pipeline), so the numbers compare the machinery.

Prints median items/s over --repeats runs and ratios to spdl_lab (meters on).

    python benchmarks/engine_overhead.py [--items 200000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, median_rate, print_table  # noqa: E402

import spdl_lab as lab  # noqa: E402

BATCH = 32


def noop(x):
    return x


# -- the runners under test ------------------------------------------------------
def spdl_lab_run(n: int, conc: int, batched: bool, meters: bool) -> int:
    p = lab.Pipeline(range(n)).map(noop, concurrency=conc, name="a")
    p = p.batch(BATCH).map(len, concurrency=conc, name="b") if batched else p.map(noop, concurrency=conc, name="b")
    with lab.Loader(p, meters=meters) as loader:
        return sum(1 for _ in loader)


def torchdata_run(n: int, conc: int, batched: bool) -> int:
    from torchdata.nodes import Batcher, IterableWrapper, Loader, ParallelMapper

    node = ParallelMapper(IterableWrapper(range(n)), map_fn=noop, num_workers=conc, method="thread")
    if batched:
        node = ParallelMapper(Batcher(node, BATCH, drop_last=False), map_fn=len, num_workers=conc, method="thread")
    else:
        node = ParallelMapper(node, map_fn=noop, num_workers=conc, method="thread")
    return sum(1 for _ in Loader(node))


def spdl_run(n: int, conc: int, batched: bool) -> int:
    from spdl.pipeline import PipelineBuilder

    b = PipelineBuilder().add_source(range(n)).pipe(noop, concurrency=conc, output_order="input")
    if batched:
        b = b.aggregate(BATCH).pipe(len, concurrency=conc, output_order="input")
    else:
        b = b.pipe(noop, concurrency=conc, output_order="input")
    pipeline = b.add_sink(3 if batched else 32).build(num_threads=2 * conc)
    with pipeline.auto_stop():
        return sum(1 for _ in pipeline)


def floor_run(n: int, conc: int, batched: bool) -> int:
    """Bare queue.Queue chain: unordered, unmetered, no failure handling or stop path.

    Batching happens inline as stage-one workers put items (under a lock), as
    spdl_lab does, so both pipelines have the same number of thread hand-offs.
    """
    end = object()
    q0, q1, q2 = (queue.Queue(32) for _ in range(3))
    pending: list[int] = []
    pending_lock = threading.Lock()

    def put_item(x):
        if not batched:
            q1.put(x)
            return
        with pending_lock:
            pending.append(x)
            if len(pending) == BATCH:
                q1.put(pending.copy())
                pending.clear()

    def source():
        for i in range(n):
            q0.put(i)
        for _ in range(conc):
            q0.put(end)

    def first():
        while (x := q0.get()) is not end:
            put_item(noop(x))

    def second(fn):
        while (x := q1.get()) is not end:
            q2.put(fn(x))
        q2.put(end)

    firsts = [threading.Thread(target=first, daemon=True) for _ in range(conc)]
    seconds = [threading.Thread(target=second, args=(len if batched else noop,), daemon=True)
               for _ in range(conc)]
    threads = [threading.Thread(target=source, daemon=True), *firsts, *seconds]
    for t in threads:
        t.start()

    def close_first():
        for t in firsts:
            t.join()
        if pending:
            q1.put(pending.copy())
        for _ in range(conc):
            q1.put(end)

    closer = threading.Thread(target=close_first, daemon=True)
    closer.start()
    got = ends = 0
    while ends < conc:
        if q2.get() is end:
            ends += 1
        else:
            got += 1
    for t in (*threads, closer):
        t.join()
    return got


ANCHORS: dict[str, Callable[[int, int, bool], int]] = {
    "spdl_lab (meters on)": lambda n, c, b: spdl_lab_run(n, c, b, True),
    "spdl_lab (meters off)": lambda n, c, b: spdl_lab_run(n, c, b, False),
    "torchdata.nodes": torchdata_run,
    "SPDL PipelineBuilder": spdl_run,
    "bare queue.Queue chain": floor_run,
}


def available(name: str) -> bool:
    module = {"torchdata.nodes": "torchdata.nodes", "SPDL PipelineBuilder": "spdl.pipeline"}.get(name)
    if module is None:
        return True
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=200_000)
    ap.add_argument("--slow-items", type=int, default=20_000,
                    help="items for SPDL, whose asyncio engine runs ~100x slower on this workload")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args(argv)

    print(machine_line())
    print(f"# items={args.items:,} (SPDL: {args.slow_items:,}) repeats={args.repeats}, median items/s\n")
    rows = []
    for pipeline in ("noop2", "batched"):
        for conc in args.concurrency:
            # Interleave the anchors round by round so drift on a shared
            # machine hits all of them alike; report each one's median.
            names = [name for name in ANCHORS if available(name)]
            rates: dict[str, list[float]] = {name: [] for name in names}
            batched = pipeline == "batched"
            for _ in range(args.repeats):
                for name in names:
                    n = args.slow_items if name == "SPDL PipelineBuilder" else args.items
                    rate, _ = median_rate(
                        lambda fn=ANCHORS[name], n=n, c=conc, b=batched: _checked(fn, n, c, b), 1
                    )
                    rates[name].append(rate)
            results = {name: (statistics.median(rates[name]) if name in rates else None) for name in ANCHORS}
            ours = results["spdl_lab (meters on)"]
            for name, rate in results.items():
                if rate is None:
                    rows.append((pipeline, conc, name, "not installed", "-"))
                else:
                    rows.append((pipeline, conc, name, rate, f"{rate / ours:.2f}x"))
    print_table(["pipeline", "conc", "runner", "items/s", "vs spdl_lab"], rows)
    print()
    for pipeline in ("noop2", "batched"):
        for conc in args.concurrency:
            r = {row[2]: row[3] for row in rows if row[0] == pipeline and row[1] == conc}
            on, off = r["spdl_lab (meters on)"], r["spdl_lab (meters off)"]
            print(f"{pipeline} conc={conc}: meters on/off = {on / off:.2f} "
                  f"(target >= 0.90); meters on = {on:,.0f} items/s (target >= 50,000)")


def _checked(fn: Callable[[int, int, bool], int], n: int, conc: int, batched: bool) -> int:
    got = fn(n, conc, batched)
    expected = -(-n // BATCH) if batched else n
    if got != expected:
        raise SystemExit(f"{fn}: produced {got} outputs, expected {expected}")
    return n  # rates are in source items per second


if __name__ == "__main__":
    main()
