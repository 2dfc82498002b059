"""``make gpu-check``: the StepClock's CUDA timing, proved on a real GPU.

A small conv net trains on synthetic images (uint8, 3 x SIZE x SIZE, batches of ``--batch``) fed
by ``lab.Loader`` under the ``thread`` runner and under the ``process`` runner, with pinned
batches (a pipeline stage pins them under threads; the DataLoader's pin thread under processes)
copied with ``non_blocking=True``. For each runner:

* the StepClock (``cuda=True``) times every step with a CUDA event pair, and the copy with
  ``clock.copy()``;
* the script records its own ``torch.cuda.Event`` pairs around the same step and the same copy;
* ``torch.profiler`` records the GPU's own kernel and memcpy time over ``--profiled`` steps;
* a ``lab.run`` Session over the same pipeline gives what its dashboard draws: ``device_util``
  and ``device_ms`` per tick (the Session's clock picks CUDA by itself).

Checks, each within TOLERANCE: the clock's device time against the script's events, and against
the profiler's GPU busy time over the same steps; the clock's copy time against the script's copy
events. Prints a table of the figures and exits 1 if a check fails. Without CUDA it says so and
exits 0.

    python benchmarks/gpu_check.py [--steps 80] [--profiled 30] [--batch 256]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table  # noqa: E402

import spdl_lab as lab  # noqa: E402

#: The largest relative difference a check allows.
TOLERANCE = 0.05
#: What a copy's event pair may add to the profiler's transfer times, in ms: the pair spans two
#: transfers (images, labels) and the DMA set-up between them, which per-transfer durations leave
#: out (about 15-20 us on an H100).
COPY_SLACK_MS = 0.025
SIZE = 128
CLASSES = 10
#: Steps not counted while cuDNN picks its kernels and the loader fills.
WARMUP = 10


def make_image(i: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(i)
    img = torch.randint(0, 256, (3, SIZE, SIZE), dtype=torch.uint8, generator=g)
    return (img.flip(-1) if i % 2 else img), i % CLASSES


def collate(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def pin(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[0].pin_memory(), batch[1].pin_memory()


def pipeline(items: int, batch: int, pinned: bool) -> lab.Pipeline:
    p = lab.Pipeline(range(items)).map(make_image, concurrency=8, name="decode").batch(batch)
    p = p.map(collate, name="collate")
    return p.map(pin, name="pin") if pinned else p


def conv_net() -> nn.Module:
    """About 6 GFLOP forward per image, most of it at full resolution: heavy enough per kernel
    launch that the GPU, not the host, sets the pace, as in the jobs the lab is for."""
    def conv(c_in: int, c_out: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True)]

    return nn.Sequential(*conv(3, 64), *conv(64, 64), *conv(64, 128, 2), *conv(128, 128),
                         *conv(128, 256, 2), *conv(256, 256), *conv(256, 256, 2), *conv(256, 256),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, CLASSES))


class Trainer:
    """The training step, with the script's own event pairs when ``events`` is on."""

    def __init__(self) -> None:
        self.model = conv_net().cuda().to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss = nn.CrossEntropyLoss()
        self.step_events: list[tuple[Any, Any]] = []
        self.copy_events: list[tuple[Any, Any]] = []

    def copy(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[0].cuda(non_blocking=True), batch[1].cuda(non_blocking=True)

    def compute(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.float().div_(255).contiguous(memory_format=torch.channels_last)
        loss = self.loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The step as ``lab.run`` calls it (the Session's clock times it)."""
        self.compute(*self.copy(batch))

    def timed_step(self, clock: lab.StepClock, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """One step under ``clock``, with the script's own pairs inside the clock's."""
        with clock.step():
            s0, s1 = _event(), _event()
            c0, c1 = _event(), _event()
            s0.record()
            with clock.copy():
                c0.record()
                x, y = self.copy(batch)
                c1.record()
            self.compute(x, y)
            s1.record()
        self.step_events.append((s0, s1))
        self.copy_events.append((c0, c1))


def _event() -> Any:
    return torch.cuda.Event(enable_timing=True)


def gpu_busy_ms(prof: Any) -> tuple[float, float, int]:
    """What the profiler saw the GPU do: the union of its activities' intervals (kernels, memcpy,
    memset) in ms, the host-to-device memcpy time in ms, and how many activities there were."""
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy_us, end = 0.0, -math.inf
    for start, stop in spans:
        if stop > end:
            busy_us += stop - max(start, end)
            end = stop
    h2d_us = sum(e.time_range.elapsed_us() for e in events if "HtoD" in e.name)
    return busy_us / 1e3, h2d_us / 1e3, len(spans)


@dataclass
class Figures:
    runner: str
    steps: int
    batches_per_s: float
    data_wait_p50_ms: float
    step_p50_ms: float
    clock_device_ms: float  # mean per step, every timed step
    events_device_ms: float
    clock_profiled_ms: float  # sum over the profiled steps
    profiler_busy_ms: float
    kernels: int
    clock_copy_ms: float  # mean per copy, every step
    clock_copy_profiled_ms: float  # the same over the profiled steps
    events_copy_profiled_ms: float
    profiler_copy_ms: float  # host-to-device memcpy per profiled step
    device_util: float
    copy_ms_series: float  # the clock's copy_ms rows, as the dashboard plots them
    session_device_util: float  # a lab.run Session: its stats().step
    dashboard_device_util: float  # the same Session's device_util ticks, median
    session_device: str


def check_runner(runner: str, args: argparse.Namespace) -> Figures:
    trainer = Trainer()
    steps = WARMUP + args.steps
    items = (steps + 2) * args.batch
    options: dict[str, Any] = {"num_workers": 8, "pin_memory": True} if runner == "process" else {}
    clock = lab.StepClock(cuda=True)
    first_profiled = WARMUP + (args.steps - args.profiled) // 2
    copy_rows: list[float] = []
    with lab.Loader(pipeline(items, args.batch, pinned=runner != "process"), runner=runner,
                    **options) as loader:
        batches = iter(clock.iterate(loader))
        for _ in range(first_profiled):
            trainer.timed_step(clock, next(batches))
        torch.cuda.synchronize()
        before = clock.summary()  # nothing pending: the window's copies are after - before
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.profiled):
                trainer.timed_step(clock, next(batches))
            torch.cuda.synchronize()
        after = clock.summary()
        clock.rows(1.0)  # a tick boundary: the next rows cover only what follows
        for _ in range(steps - first_profiled - args.profiled):
            trainer.timed_step(clock, next(batches))
            copy_rows += [v for s, stage, v in clock.rows(1.0) if s == "copy_ms"]
        summary = clock.summary()
    torch.cuda.synchronize()
    records = clock.records()
    timed = range(WARMUP, steps)
    clock_device = [records[i].device_s * 1e3 for i in timed]
    events_device = [trainer.step_events[i][0].elapsed_time(trainer.step_events[i][1]) for i in timed]
    profiled = range(first_profiled, first_profiled + args.profiled)
    copies = [c0.elapsed_time(c1) for c0, c1 in trainer.copy_events]
    # One copy a step: the clock's copy time over the profiled steps, from its running totals.
    window_copy_ms = (after.copy_mean_ms * after.steps - before.copy_mean_ms * before.steps) / args.profiled
    busy_ms, h2d_ms, kernels = gpu_busy_ms(prof)
    session = lab.run(pipeline(items, args.batch, pinned=runner != "process"), step=trainer,
                      runner=runner, steps=args.steps, **options)
    try:
        if not session.wait(timeout=300):
            raise RuntimeError(f"the lab.run session under {runner!r} did not end in 300 s")
        if session.error is not None:
            raise session.error
        stats = session.stats().step
        frames = session.frames()
    finally:
        session.stop()
    ticks = frames[(frames["series"] == "device_util") & (frames["stage"] == "step")]["value"]
    return Figures(
        runner=runner, steps=summary.steps, batches_per_s=summary.batches_per_s,
        data_wait_p50_ms=summary.data_wait_p50_ms, step_p50_ms=summary.step_p50_ms,
        clock_device_ms=statistics.fmean(clock_device), events_device_ms=statistics.fmean(events_device),
        clock_profiled_ms=sum(records[i].device_s * 1e3 for i in profiled), profiler_busy_ms=busy_ms,
        kernels=kernels, clock_copy_ms=summary.copy_mean_ms, clock_copy_profiled_ms=window_copy_ms,
        events_copy_profiled_ms=statistics.fmean(copies[i] for i in profiled),
        profiler_copy_ms=h2d_ms / args.profiled,
        device_util=summary.device_util,
        copy_ms_series=statistics.median(copy_rows) if copy_rows else math.nan,
        session_device_util=stats.device_util if stats is not None else math.nan,
        dashboard_device_util=float(ticks.median()) if len(ticks) else math.nan,
        session_device=stats.device if stats is not None else "")


def checks(f: Figures) -> list[tuple[str, float, float, float]]:
    """(what, the clock's figure, the independent one, the slack in ms) for each check of a runner."""
    return [("device ms/step: clock vs the script's events", f.clock_device_ms, f.events_device_ms, 0.0),
            ("device ms over the profiled steps: clock vs profiler GPU busy", f.clock_profiled_ms,
             f.profiler_busy_ms, 0.0),
            ("copy ms over the profiled steps: clock.copy() vs the script's events",
             f.clock_copy_profiled_ms, f.events_copy_profiled_ms, 0.0),
            ("copy ms over the profiled steps: clock.copy() vs profiler memcpy HtoD",
             f.clock_copy_profiled_ms, f.profiler_copy_ms, COPY_SLACK_MS)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="timed steps per runner (after warm-up)")
    parser.add_argument("--profiled", type=int, default=30, help="of which, under torch.profiler")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runners", nargs="+", default=["thread", "process"])
    args = parser.parse_args(argv)
    if not 0 < args.profiled <= args.steps:
        parser.error(f"--profiled must be between 1 and --steps ({args.steps}), got {args.profiled}")
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA on this machine (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none'}); nothing was checked. Run it on a machine with an NVIDIA GPU.")
        return 0
    torch.backends.cudnn.benchmark = True
    print(f"# {torch.cuda.get_device_name()} · torch {torch.__version__} · CUDA {torch.version.cuda} · "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    results = [check_runner(runner, args) for runner in args.runners]
    rows = [(name, *(getattr(f, name) for f in results)) for name in Figures.__dataclass_fields__]
    # Four significant digits: the checks below compare figures that differ in the third.
    print_table(["figure", *args.runners], [[row[0], *(v if isinstance(v, str) else f"{v:.4g}" for v in row[1:])]
                                           for row in rows[1:]])
    failed = 0
    print()
    for f in results:
        for what, mine, theirs, slack in checks(f):
            diff = mine / theirs - 1 if theirs > 0 else math.inf
            ok = theirs > 0 and (abs(diff) <= TOLERANCE or abs(mine - theirs) <= slack)
            failed += not ok
            within = f"within {TOLERANCE:.0%}" + (f" or {slack * 1e3:.0f} us" if slack else "")
            print(f"{'ok  ' if ok else 'FAIL'} {f.runner:8} {what}: {mine:.3f} vs {theirs:.3f} "
                  f"({diff:+.1%}; {within})")
    total = sum(len(checks(f)) for f in results)
    print(f"\ngpu-check: {total - failed} of {total} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
