"""Soak: many items through the thread engines, many open/close cycles of every runner.

Short by default (``make test``). ``make soak`` sets ``SPDL_LAB_SOAK=full``
(1,000,000 items, 100 cycles) and shows the printed numbers (RSS before and
after, items/s, cycles) with ``-s``; ``SPDL_LAB_SOAK_ITEMS`` and
``SPDL_LAB_SOAK_CYCLES`` override either size.
"""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np
import psutil
import pytest
from hygiene import GRACE_S, Snapshot

import spdl_lab as lab

SHORT_ITEMS, FULL_ITEMS = 50_000, 1_000_000
SHORT_CYCLES, FULL_CYCLES = 4, 100


def _size(variable: str, short: int, full: int) -> int:
    mode = os.environ.get("SPDL_LAB_SOAK", "short").strip().lower()
    if mode not in ("short", "full"):
        raise pytest.UsageError(f"SPDL_LAB_SOAK={mode!r}: expected 'short' or 'full'")
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return full if mode == "full" else short
    try:
        value = int(raw.replace("_", ""))
    except ValueError:
        raise pytest.UsageError(f"{variable}={raw!r}: expected a whole number") from None
    if value < 1:
        raise pytest.UsageError(f"{variable}={raw!r}: expected a number >= 1")
    return value


ITEMS = _size("SPDL_LAB_SOAK_ITEMS", SHORT_ITEMS, FULL_ITEMS)
CYCLES = _size("SPDL_LAB_SOAK_CYCLES", SHORT_CYCLES, FULL_CYCLES)

#: Allocator warm-up (arenas, the ring's columns, slot buffers) is not a leak:
#: RSS growth is measured from the point this share of the items has passed.
WARMUP_SHARE = 0.1
RSS_LIMIT_MB = 50.0
#: A small ring sampled fast, so that even the short soak wraps it many times.
RING_TICKS, SAMPLE_HZ = 8, 100.0
#: How often the consumer looks at the ring and RSS, as a dashboard would.
CHECK_S = 0.25
BATCH = 64

pytestmark = pytest.mark.slow


# -- the pipeline: module-level functions, so the child imports them by name ----------
def add_one(x: int) -> int:
    return x + 1


def to_array(batch: list[int]) -> np.ndarray:
    return np.asarray(batch, dtype=np.int64)  # arrays travel through shared-memory slots


def soak_pipeline(n: int) -> lab.Pipeline:
    return lab.Pipeline(range(n)).map(add_one, concurrency=2, name="add_one").batch(BATCH).map(
        to_array, name="to_array"
    )


def _rss_mb(process: psutil.Process | None) -> float:
    if process is None:
        return float("nan")
    try:
        return process.memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


def _engine_child() -> psutil.Process | None:
    """The subprocess-threads child: the one child running the runner's entry module."""
    found = []
    for child in psutil.Process().children():
        try:
            if "spdl_lab._runners.subprocess_threads" in child.cmdline():
                found.append(child)
        except psutil.Error:
            pass
    assert len(found) <= 1, f"more than one subprocess-threads child is running: {found}"
    return found[0] if found else None


# -- 1. many items ----------------------------------------------------------------------
class _Memory:
    """RSS of this process and of the engine's child, from the end of warm-up to the end."""

    def __init__(self) -> None:
        self.processes: dict[str, psutil.Process] = {"parent": psutil.Process()}
        self.baseline: dict[str, float] = {}
        self.after: dict[str, float] = {}
        self.peak: dict[str, float] = {}

    def now(self) -> dict[str, float]:
        return {who: _rss_mb(p) for who, p in self.processes.items()}

    def start(self) -> None:
        self.baseline = self.now()
        self.peak = dict(self.baseline)

    def sample(self) -> None:
        if self.baseline:
            self.peak = {who: max(self.peak[who], mb) for who, mb in self.now().items()}

    def end(self) -> None:
        self.after = self.now()
        self.sample()

    def growth(self) -> dict[str, float]:
        return {who: self.after[who] - self.baseline[who] for who in self.baseline}


@pytest.mark.parametrize("runner", ["thread", "subprocess-threads"])
@pytest.mark.timeout(120 + ITEMS // 2_000)
def test_many_items_keep_memory_and_frames_bounded(runner):
    """``ITEMS`` items, meters on, a fast sampler over a small ring, a live frames reader.

    RSS (this process, and the child under subprocess-threads) may not grow more
    than RSS_LIMIT_MB from the end of warm-up to the last batch, the ring never
    holds more than its capacity however often it wraps, and every item arrives once.
    """
    n = ITEMS
    expected_batches = -(-n // BATCH)
    warmup_batches = max(1, int(n * WARMUP_SHARE) // BATCH)
    memory = _Memory()
    total = batches = ticks_held_max = cursor = 0
    next_check = t_warm = 0.0
    t0 = time.perf_counter()
    with lab.Loader(soak_pipeline(n), runner=runner, sample_hz=SAMPLE_HZ, sample_ticks=RING_TICKS) as loader:
        for batch in loader:
            total += int(batch.sum())
            batches += 1
            if batches == 1 and runner == "subprocess-threads":
                # The run, and so the child, starts with the iteration.
                child = _engine_child()
                assert child is not None, "could not find the subprocess-threads child"
                memory.processes["child"] = child
            if batches == warmup_batches:
                memory.start()
                t_warm = time.perf_counter()
            if batches == expected_batches:  # the last one: the run is still up, the child alive
                memory.end()
            if (now := time.perf_counter()) >= next_check:
                next_check = now + CHECK_S
                chunk = loader.frames_since(cursor)  # a live reader, as the dashboard is
                cursor = chunk.cursor
                held = len(loader.frames_since(0))  # every tick the ring still holds
                ticks_held_max = max(ticks_held_max, held)
                assert len(chunk) <= RING_TICKS and held <= RING_TICKS, (
                    f"{runner}: the frames ring holds {held} ticks (a reader got {len(chunk)}); "
                    f"its capacity is {RING_TICKS}"
                )
                memory.sample()
        t_end = time.perf_counter()
        frames = loader.frames()
        ticks_ever = loader.frames_since(0).cursor
        stats = loader.stats()

    elapsed = t_end - t0
    growth = memory.growth()
    print(
        f"\nsoak {runner}: {n:,} items in {elapsed:.1f} s ({n / elapsed:,.0f} items/s, "
        f"{(n - warmup_batches * BATCH) / (t_end - t_warm):,.0f} after warm-up); "
        f"ring {ticks_ever:,} ticks sampled, at most {ticks_held_max} held (capacity {RING_TICKS})"
    )
    for who, mb in growth.items():
        print(
            f"  RSS {who}: {memory.baseline[who]:.1f} MB after warm-up ({warmup_batches * BATCH:,} items), "
            f"{memory.after[who]:.1f} MB at the end, peak {memory.peak[who]:.1f} MB: growth {mb:+.1f} MB"
        )
    assert batches == expected_batches and stats.items_out == expected_batches
    assert total == n * (n + 1) // 2, f"{runner}: the sum of every item + 1 is wrong: data was lost or repeated"
    assert stats.stages["add_one"].tasks == n and stats.stages["add_one"].failures == 0
    assert frames["time_s"].nunique() <= RING_TICKS
    assert ticks_ever > RING_TICKS, (
        f"{runner}: only {ticks_ever} ticks were sampled, too few to show the ring stays bounded "
        f"while it wraps; the run took {elapsed:.2f} s"
    )
    for who, mb in growth.items():
        assert math.isfinite(mb), f"{runner}: could not read the {who}'s RSS ({memory.baseline}, {memory.after})"
        assert mb <= RSS_LIMIT_MB, (
            f"{runner}: {who} RSS grew {mb:.1f} MB over {n:,} items after warm-up "
            f"({memory.baseline[who]:.1f} -> {memory.after[who]:.1f} MB); the limit is {RSS_LIMIT_MB:g} MB"
        )


# -- 2. many open/close cycles --------------------------------------------------------
CYCLE_OPTIONS = {
    "thread": {},
    "subprocess-threads": {},
    "process": {"num_workers": 1},  # each worker imports torch: seconds per cycle
    "cache": {"num_caches": 2},
    "ray": {},  # on the session's shared local instance (see conftest.py)
}


def cycle_pipeline() -> lab.Pipeline:
    return lab.Pipeline(range(64)).map(add_one, concurrency=2, name="add_one").batch(8).map(
        to_array, name="to_array"
    )


def _ours(name: str) -> bool:
    # Others (a benchmark beside the tests) make /dev/shm entries too; count those naming us.
    return f"_{os.getpid()}_" in name


def _growth(baseline: Snapshot, now: Snapshot) -> list[str]:
    grown = []
    threads = sorted(t.name for t in now.threads - baseline.threads)
    if threads:
        grown.append(f"threads {threads}")
    children = sorted(now.children - baseline.children)
    if children:
        grown.append(f"child processes {children}")
    shm = sorted(n for n in now.shm - baseline.shm if _ours(n))
    if shm:
        grown.append(f"/dev/shm entries {shm}")
    if now.num_fds > baseline.num_fds:
        grown.append(
            f"file descriptors {baseline.num_fds} -> {now.num_fds}, new targets "
            f"{sorted((now.fds - baseline.fds).elements())}"
        )
    return grown


def _wait_for(baseline: Snapshot, shared_ray: bool) -> list[str]:
    """What grew since ``baseline``, after giving it GRACE_S to go away."""
    deadline = time.monotonic() + GRACE_S
    while True:
        grown = _growth(baseline, Snapshot.take(shared_ray))
        if not grown or time.monotonic() >= deadline:
            return grown
        time.sleep(0.02)


@pytest.mark.parametrize("runner", lab.RUNNERS)
@pytest.mark.timeout(120 + 15 * CYCLES)
def test_open_close_cycles_leak_nothing(runner):
    """Each cycle opens a Loader, iterates (all of it, or one batch then close), closes it.

    After the first cycle and every few after it, the process must be back to the
    threads, children, /dev/shm entries and descriptors it had before the first,
    so a slow leak fails naming the cycle (the hygiene fixture checks only the end).
    """
    every = max(1, min(10, CYCLES // 10))
    options = CYCLE_OPTIONS[runner]
    sums = [sum(range(1 + 8 * b, 9 + 8 * b)) for b in range(8)]
    replayed = options.get("num_caches", 8)  # cache replays its first batches
    expected = [sums[b % replayed] for b in range(8)]
    shared_ray = runner == "ray"  # the instance's processes and connections are its own
    baseline = Snapshot.take(shared_ray)
    t0 = time.perf_counter()
    threads_peak = 0
    for cycle in range(1, CYCLES + 1):
        with lab.Loader(cycle_pipeline(), runner=runner, **options) as loader:
            it = iter(loader)
            if cycle % 2:
                got = [int(b.sum()) for b in it]
                assert got == expected, f"{runner} cycle {cycle}: got batch sums {got}, expected {expected}"
            else:
                next(it)  # close with the run still going
            threads_peak = max(threads_peak, threading.active_count())
        if cycle == 1 or cycle % every == 0 or cycle == CYCLES:
            grown = _wait_for(baseline, shared_ray)
            assert not grown, f"{runner}: after {cycle} open/close cycles the process holds more: " + "; ".join(grown)
    elapsed = time.perf_counter() - t0
    print(
        f"\ncycles {runner}: {CYCLES} open/close cycles in {elapsed:.1f} s "
        f"({elapsed / CYCLES * 1000:.0f} ms each), checked every {every}; "
        f"at most {threads_peak} threads alive, {threading.active_count()} after"
    )
