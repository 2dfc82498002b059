"""How big a published run's record grows: a DataLoader job's ticks (10 Hz, ``--series`` series:
its stages, per-worker meters, probes and the step's) and its steps (``--rate`` steps/s), written
through ``RecordWriter`` as the publisher writes them, in simulated time (no waiting). Frames keep
full rate for 10 minutes, steps for an hour; older ones are thinned.

Prints the file's size after each simulated hour, the growth per hour once thinning holds, and the
size a 24-hour run reaches at that growth (the issue's bar: under 200 MB at 60 steps/s).

    python benchmarks/record_size.py [--hours 3] [--rate 60] [--series 56]
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
from pathlib import Path

import numpy as np

from spdl_lab._telemetry.frames import FrameChunk
from spdl_lab._watch.records import RecordWriter

HZ = 10
#: One write per simulated minute, as the 2-s flushes would add up to.
CHUNK_S = 60
TARGET_MB = 200.0


def simulate(path: Path, hours: float, rate: float, series: int) -> list[tuple[float, float, int, int]]:
    """Write ``hours`` of a run to ``path``; (hour, MB, frame rows, step rows) after each hour."""
    rng = np.random.default_rng(0)
    keys = [(f"series{i}", f"stage{i % 7}") for i in range(series)]
    writer = RecordWriter(path, meta={"name": "size", "runner": "DataLoader"}, flush_every_s=1e9,
                          max_buffered_ticks=CHUNK_S * HZ * 2)
    sizes, tick, step = [], 0, 0
    try:
        for minute in range(int(hours * 60)):
            times = (tick + np.arange(CHUNK_S * HZ)) / HZ
            columns = {key: rng.random(len(times)) for key in keys}
            tick += len(times)
            writer.add(FrameChunk(tick, times, columns))
            n = int(rate * CHUNK_S)
            ends = ((minute * CHUNK_S + (np.arange(n) + 1) / rate) * 1e9).astype(np.int64)
            waits = rng.integers(100_000, 5_000_000, n)
            steps = rng.integers(10_000_000, 20_000_000, n)
            writer.add_steps([(step + i, int(ends[i]), int(waits[i]), int(steps[i]), None) for i in range(n)],
                             {"steps_first_ns": "0"})
            step += n
            writer.flush()
            if (minute + 1) % 60 == 0:
                sizes.append(((minute + 1) / 60, _mb(path), *_rows(path)))
    finally:
        writer.close()
    return sizes


def _mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*")) / 2**20


def _rows(path: Path) -> tuple[int, int]:
    with sqlite3.connect(path) as db:
        return (db.execute("SELECT count(*) FROM frames").fetchone()[0],
                db.execute("SELECT count(*) FROM steps").fetchone()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=3.0)
    parser.add_argument("--rate", type=float, default=60.0, help="training steps per second")
    parser.add_argument("--series", type=int, default=56, help="series per tick")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sizes = simulate(Path(tmp) / "run.sqlite", args.hours, args.rate, args.series)
    print(f"{args.rate:g} steps/s, {args.series} series at {HZ} Hz")
    print("hour      MB  frame rows   step rows")
    for hour, mb, frames, steps in sizes:
        print(f"{hour:4.0f}  {mb:6.1f}  {frames:10,}  {steps:10,}")
    if len(sizes) >= 3:
        growth = sizes[-1][1] - sizes[-2][1]
        day = sizes[-1][1] + growth * (24 - sizes[-1][0])
        print(f"growth once thinned: {growth:.1f} MB/hour; a 24-hour run: about {day:.0f} MB "
              f"({'under' if day < TARGET_MB else 'OVER'} the {TARGET_MB:.0f} MB bar)")


if __name__ == "__main__":
    main()
