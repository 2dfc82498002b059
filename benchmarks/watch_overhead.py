"""What publishing a run (``lab.publish``) with a viewer attached costs the training loop.

Issue 17's target: training steps/s with publishing on >= 0.97x off. Two cases, each a
training loop whose step is ~20 ms of numpy work (calibrated at start):

* ``lab.Loader``: the ``lab.workloads.noisy_neighbour()`` pipeline (read, a Python
  decode that holds the GIL, numpy augment, batches of 16) under the ``thread`` runner,
  iterated by a plain ``for batch in loader: step(batch)`` loop on a thread; the Loader
  is what gets published;
* torch ``DataLoader``: a map-style Dataset (a 1 ms read, numpy decode and augment per
  item), ``batch_size=16``, ``num_workers=2``, published as it is: ``lab.publish(dataloader)``
  times each ``next()`` and step and reads the workers' CPU.

Design. One process, one training thread per case (``Trainer``), cut into ``--windows``
windows of ``--seconds`` in the order off, on, on, off, off, on, ... so that a slow spell
of the shared machine hits "off" and "on" alike. Each window starts a fresh epoch; in an
"on" window the loop iterates what ``lab.publish`` returned, with a fresh record file, and a viewer in a second process (spawned once per benchmark, as a notebook would be) calls
``lab.attach(name)``: its RemoteSession polls frames, state and controls every 0.25 s,
and it asks for ``stats()`` once a second, as a dashboard does. At the end of the window
the viewer detaches and ``unpublish`` (``spdl_lab._watch.publish``) closes the record and
the endpoint. Every window, off or on, begins with
``SETTLE_S`` of steps that are not counted: the switch itself (publisher start,
attach; detach, close) is not what is measured, and a fresh publisher starts at cursor 0,
so its first flush (2 s in) writes the run's backlog, which a script publishing from its
start does not have.

Printed per case: steps/s off and on (median over windows, min-max), the ratio of the
medians (target >= 0.97), the publisher's CPU (the ``spdl_lab:publish``,
``spdl_lab:record`` and ``spdl_lab:endpoint`` threads, read per thread from their CPU
clocks, as % of one core over the "on" windows), and the record's growth per hour at
full rate (each "on" window's record, less the size of an empty one, over the time it
covers; the median over windows; ticks older than 10 minutes are thinned, so a long run
grows slower after that). ``SPDL_LAB_RUNTIME_DIR`` and ``SPDL_LAB_RECORD`` point into a
temporary directory, removed at the end.

    python benchmarks/watch_overhead.py [--seconds 5] [--windows 8] [--cases loader dataloader]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, print_table  # noqa: E402

#: Uncounted steps at the start of every window (covers the first flush, at 2 s).
SETTLE_S = 2.5
#: The threads that exist only while a run is published.
PUBLISHER_THREADS = ("spdl_lab:publish", "spdl_lab:record", "spdl_lab:endpoint")
CASES = ("loader", "dataloader")


# -- the training step and the DataLoader's dataset (module level: spawn imports them) ----
class TrainStep:
    """~20 ms of numpy work per batch; ``steps`` counts the steps taken."""

    def __init__(self, target_ms: float = 20.0) -> None:
        self.steps = 0
        self._buf = np.random.default_rng(0).random(200_000).astype(np.float32)
        self._repeats = 1
        t0 = time.perf_counter()
        for _ in range(20):
            self._work()
        per_repeat = (time.perf_counter() - t0) / 20
        self._repeats = max(1, round(target_ms / 1000 / per_repeat))

    def _work(self) -> None:
        buf = self._buf
        for _ in range(self._repeats):
            np.tanh(buf, out=buf)
            buf *= 1.0001

    def __call__(self, batch: object) -> None:
        self._work()
        self.steps += 1


class SyntheticImages:
    """A map-style Dataset: each item waits 1 ms (a read), then decodes and augments in numpy."""

    def __len__(self) -> int:
        return 10_000_000

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(0.001)
        image = np.random.default_rng(index).integers(0, 256, size=(3, 96, 96), dtype=np.uint8)
        out = image[:, :, ::-1].astype(np.float32)
        out -= 127.5
        out *= 1 / 127.5
        return out


def _viewer(commands, replies) -> None:
    """A notebook stand-in in its own process: attach to a name, poll, detach on request."""
    import spdl_lab as lab

    replies.put("ready")
    remote = None
    while True:
        try:
            command = commands.get(timeout=1.0)
        except Empty:
            if remote is not None:
                remote.stats()  # a dashboard's once-a-second table
            continue
        if command is None:
            break
        if command == "detach":
            remote.close()
            remote = None
            replies.put("detached")
        else:
            remote = lab.attach(command, timeout=10)
            replies.put("attached")
    if remote is not None:
        remote.close()


# -- measuring -------------------------------------------------------------------------
@dataclass
class CaseResult:
    case: str
    off: list[float] = field(default_factory=list)
    on: list[float] = field(default_factory=list)
    publisher_cpu_s: float = 0.0
    on_s: float = 0.0
    records: list[tuple[float, int]] = field(default_factory=list)  # (recorded span s, bytes)


def _publisher_cpu_s() -> dict[int, float]:
    """CPU seconds of each live publisher thread, by thread id."""
    cpu = {}
    for t in threading.enumerate():
        if t.name.startswith(PUBLISHER_THREADS) and t.ident is not None:
            try:
                cpu[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):
                pass  # ended between enumerate and the read
    return cpu


def _record_span_s(path: Path) -> float:
    from spdl_lab._watch.records import read_record

    times = read_record(path)["time_s"]
    return float(times.max() - times.min()) if len(times) else 0.0


class Trainer:
    """The training loop, on a thread: ``for batch in current: step(batch)``, where ``current``
    is the loader as it is ("off") or what ``lab.publish`` returned ("on"). ``switch``
    ends the epoch in progress and starts the next one over the new iterable, so "on"
    windows time every step through the published loop, as a script publishing from its
    start does, and both kinds of window begin with a fresh epoch (workers or threads
    started anew)."""

    def __init__(self, loader, step: TrainStep) -> None:
        self.step = step
        self._current = loader
        self._switch = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="train", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._switch.clear()
            for batch in self._current:
                self.step(batch)
                if self._switch.is_set() or self._stop.is_set():
                    break

    def switch(self, iterable) -> None:
        self._current = iterable
        self._switch.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def measure(case: str, loader, step: TrainStep, args, viewer, tmp: Path) -> CaseResult:
    """Alternate off/on windows over ``loader`` (a lab.Loader or a torch DataLoader)."""
    import spdl_lab as lab
    from spdl_lab._watch.publish import unpublish

    commands, replies = viewer
    result = CaseResult(case)
    trainer = Trainer(loader, step)
    try:
        for i in range(args.windows):
            on = i % 4 in (1, 2)
            if on:
                record = tmp / f"{case.split()[0]}-{i}.sqlite"
                os.environ["SPDL_LAB_RECORD"] = str(record)
                name = f"bench-{case.split()[0]}-{i}"
                trainer.switch(lab.publish(loader, name=name))
                commands.put(name)
                if replies.get(timeout=30) != "attached":
                    raise RuntimeError("the viewer did not attach")
            else:
                trainer.switch(loader)
            time.sleep(SETTLE_S)
            cpu0 = _publisher_cpu_s()
            n0, t0 = step.steps, time.perf_counter()
            time.sleep(args.seconds)
            n1, t1 = step.steps, time.perf_counter()
            cpu1 = _publisher_cpu_s()
            rate = (n1 - n0) / (t1 - t0)
            if on:
                result.on.append(rate)
                result.on_s += t1 - t0
                result.publisher_cpu_s += sum(v - cpu0.get(k, 0.0) for k, v in cpu1.items())
                commands.put("detach")
                replies.get(timeout=30)
                trainer.switch(loader)  # off the published loop before it closes
                unpublish(loader)
                result.records.append((_record_span_s(record), record.stat().st_size))
            else:
                result.off.append(rate)
            print(f"# {case} window {i + 1}/{args.windows} {'on ' if on else 'off'}: {rate:.2f} steps/s",
                  flush=True)
    finally:
        trainer.stop()
    return result


def run_loader_case(args, viewer, tmp: Path) -> CaseResult:
    import spdl_lab as lab

    pipeline, _ = lab.workloads.noisy_neighbour()
    loader = lab.Loader(pipeline, runner="thread")
    try:
        return measure("lab.Loader", loader, TrainStep(), args, viewer, tmp)
    finally:
        loader.close()


def run_dataloader_case(args, viewer, tmp: Path) -> CaseResult:
    import torch.utils.data

    dataloader = torch.utils.data.DataLoader(SyntheticImages(), batch_size=16, num_workers=2)
    return measure("torch DataLoader", dataloader, TrainStep(), args, viewer, tmp)


def _empty_record_bytes(tmp: Path) -> int:
    """The size of a record with its meta and no frames: what every record starts with."""
    from spdl_lab._watch.records import RecordWriter

    path = tmp / "empty.sqlite"
    RecordWriter(path, meta={"name": "empty", "pid": "0", "state": "running"}).close(state="finished")
    return path.stat().st_size


def _report(results: list[CaseResult], empty_bytes: int) -> None:
    rows = []
    for r in results:
        off, on = statistics.median(r.off), statistics.median(r.on)
        cpu = f"{100 * r.publisher_cpu_s / r.on_s:.1f}%" if r.on_s else "-"
        growth = statistics.median((size - empty_bytes) / span * 3600 / 1e6
                                   for span, size in r.records if span > 0)
        rows.append([
            r.case,
            f"{off:.2f} [{min(r.off):.2f}-{max(r.off):.2f}]",
            f"{on:.2f} [{min(r.on):.2f}-{max(r.on):.2f}]",
            f"{on / off:.3f}" + ("" if on / off >= 0.97 else " (< 0.97)"),
            cpu,
            f"{growth:.1f}",
        ])
    print()
    print_table(["case", "steps/s off [min-max]", "steps/s on [min-max]", "on/off",
                 "publisher CPU", "record MB/h"], rows)
    print("\non/off: ratio of the medians (target >= 0.97). publisher CPU: its threads, % of one "
          "core over the 'on' windows.\nrecord MB/h: full-rate growth; after 10 min older ticks "
          "are thinned to one per 10 s.")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="counted length of a window")
    ap.add_argument("--windows", type=int, default=8, help="windows per case (off, on, on, off, ...)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = ap.parse_args(argv)
    if args.windows < 3:
        ap.error("--windows must be >= 3 (at least one off and two on windows)")

    print(machine_line())
    print(f"# {args.windows} windows of {args.seconds:g} s per case (+{SETTLE_S:g} s uncounted each)")
    with tempfile.TemporaryDirectory(prefix="spdl_watch_") as tmp:
        runtime = Path(tmp) / "run"
        os.environ["SPDL_LAB_RUNTIME_DIR"] = str(runtime)  # inherited by the viewer
        os.environ["SPDL_LAB_RECORD"] = str(Path(tmp) / "unused.sqlite")
        ctx = multiprocessing.get_context("spawn")
        commands, replies = ctx.Queue(), ctx.Queue()
        viewer = ctx.Process(target=_viewer, args=(commands, replies), daemon=True)
        viewer.start()
        try:
            replies.get(timeout=60)
            runs = {"loader": run_loader_case, "dataloader": run_dataloader_case}
            results = [runs[c](args, (commands, replies), Path(tmp)) for c in args.cases]
            empty_bytes = _empty_record_bytes(Path(tmp))
        finally:
            commands.put(None)
            viewer.join(10)
            if viewer.is_alive():
                viewer.kill()
    _report(results, empty_bytes)


if __name__ == "__main__":
    main()
