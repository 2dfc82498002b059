"""Cell sources of the tutorial notebooks. Keep them short and executable in CI."""

QUICKSTART = [
    ("md", """
# spdl_lab quickstart

Build a data pipeline, run it under the `thread` runner, and read what its
meters say: per-stage throughput, task times, queue depths, and the sampler's
time series.
"""),
    ("code", """
import time
import numpy as np
import spdl_lab as lab

N = 2_000  # small, so the notebook runs in seconds

def fetch(i):
    time.sleep(0.002)          # I/O-like wait: releases the GIL
    return i

def decode(i):
    rng = np.random.default_rng(i)
    return rng.standard_normal((32, 32)).astype(np.float32)

def collate(items):
    return np.stack(items)

pipeline = (lab.Pipeline(range(N))
              .map(fetch, concurrency=8, name="fetch")
              .map(decode, concurrency=2, name="decode")
              .batch(64)
              .map(collate, name="collate"))
pipeline
"""),
    ("md", """
`Pipeline` only describes the work. A `Loader` runs it; every stage gets a
pool of threads and a bounded queue in front of it, so memory stays bounded
whatever the speeds.
"""),
    ("code", """
with lab.Loader(pipeline, runner="thread") as loader:
    shapes = [batch.shape for batch in loader]
    snap = loader.stats()
    frames = loader.frames()

assert len(shapes) == -(-N // 64) and shapes[0] == (64, 32, 32)
snap
"""),
    ("md", """
`fetch` sleeps 2 ms per item, so with 8 workers it can do about 4,000 items/s;
its p50 task time is the sleep, not the time items waited for a worker. The
queue columns describe each stage's *input*: a full input queue marks the
slower side.
"""),
    ("code", """
fetch_stats = snap.stages["fetch"]
assert 1.5 <= fetch_stats.p50_ms <= 20
fetch_stats.tasks, round(fetch_stats.p50_ms, 2)
"""),
    ("md", """
## Changing concurrency while it runs

`set_concurrency` resizes a stage's pool live, without losing or reordering
items. Here `fetch` starts with 1 worker and gets 16 halfway through.
"""),
    ("code", """
slow_start = lab.Pipeline(range(N)).map(fetch, concurrency=1, name="fetch")
with lab.Loader(slow_start, sample_hz=20) as loader:
    out = []
    for i, item in enumerate(loader):
        out.append(item)
        if i == 300:
            loader.set_concurrency("fetch", 16)
    frames = loader.frames()

assert out == list(range(N))
qps = frames[(frames.series == "qps") & (frames.stage == "fetch")]
qps.value.describe()[["min", "max"]]
"""),
    ("md", """
## Frames

`frames()` is one row per sampler tick per series (long format:
`time_s, series, stage, value`), ready for pandas:
"""),
    ("code", """
wide = frames.pivot_table(index="time_s", columns=["series", "stage"], values="value")
wide[[("qps", "fetch"), ("concurrency", "fetch"), ("queue_depth", "source→fetch")]].tail()
"""),
    ("md", """
## Bring your own loader

An existing `torch.utils.data.DataLoader` becomes a Pipeline with
`lab.from_dataloader` (sampler, `__getitem__` with `num_workers` threads,
batch, collate), so the same loader can run under every runner. An SPDL
pipeline comes in with `lab.from_spdl`, or runs as SPDL builds it with
`lab.run(builder, ...)` while lab's hooks meter every stage.
"""),
    ("code", """
import torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 256
    def __getitem__(self, i):
        return torch.full((4,), float(i * i))

dl = DataLoader(Squares(), batch_size=32, num_workers=2)
converted = lab.from_dataloader(dl)
with lab.Loader(converted, runner="thread") as loader:
    assert all(torch.equal(a, b) for a, b in zip(loader, dl))
converted
"""),
    ("code", """
try:
    from spdl.pipeline import PipelineBuilder
except ImportError:
    print("spdl_core is not installed (pip install spdl_core); skipping the SPDL example")
else:
    builder = (PipelineBuilder().add_source(range(N))
               .pipe(fetch, concurrency=8, name="fetch")
               .pipe(decode, concurrency=2, name="decode")
               .aggregate(64)
               .pipe(collate, name="collate")
               .add_sink(4))
    session = lab.run(builder, step=lambda batch: time.sleep(0.01), steps=20)
    assert session.wait(timeout=60)
    print(session.runner, "ran", session.stats().step.steps, "steps")
    display(session.summary()[["tasks", "qps", "p50_ms"]])
"""),
]

IPC_OVERHEAD = [
    ("md", """
# Why more `num_workers` stop helping when batches are large

The field note (`shared/seeds/002`): a DataLoader whose items are
`(1000, 150)` float64 arrays (1.2 MB) in batches of 128 barely speeds up from
2 to 8 workers, while the same loader with `(10, 150)` items scales. Each
worker must pickle its 154 MB batch, push it through a pipe, and the main
process must unpickle it: that cost grows with the batch, is paid by the
training process, and does not shrink with more workers.

Here the same pipeline runs under three runners, at sizes small enough for CI:

* `process` — the real `torch.utils.data.DataLoader`, batches pickled through pipes;
* `thread` — thread pools in this process, nothing crosses a process boundary;
* `subprocess-threads` — threads in one child process, arrays through shared memory.
"""),
    ("code", """
import time
import numpy as np
import spdl_lab as lab
from spdl_lab.workloads import ipc_overhead

SHAPE = (200, 150)      # 240 KB items; the question's are 1.2 MB
BATCH = 32              # 7.7 MB batches
STEP_S = 0.02           # the "training step"
WARMUP, STEPS = 3, 8

def seconds_per_batch(loader):
    times = []
    t0 = time.perf_counter()
    for i, batch in enumerate(loader):
        time.sleep(STEP_S)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if i + 1 >= WARMUP + STEPS:
            break
    return float(np.mean(times))  # the mean, as the question takes it

items = BATCH * (WARMUP + STEPS + 1)
pipeline = ipc_overhead(items=items, shape=SHAPE, batch_size=BATCH, concurrency=8)
pipeline
"""),
    ("code", """
configs = [("process", {"num_workers": 1}), ("process", {"num_workers": 2}),
           ("thread", {}), ("subprocess-threads", {})]
results = {}
for runner, options in configs:
    label = runner + "".join(f" {k}={v}" for k, v in options.items())
    with lab.Loader(pipeline, runner=runner, **options) as loader:
        results[label] = seconds_per_batch(loader)
{k: round(v, 3) for k, v in results.items()}
"""),
    ("code", """
from bokeh.io import output_notebook, show
from bokeh.plotting import figure
from bokeh.resources import INLINE

output_notebook(INLINE, hide_banner=True)
labels = list(results)
fig = figure(y_range=labels[::-1], height=220, width=600, x_axis_label="seconds per batch (lower is better)",
             title=f"{BATCH} x {SHAPE} float64 per batch, {STEP_S * 1e3:.0f} ms step")
fig.hbar(y=labels, right=[results[k] for k in labels], height=0.6)
show(fig)
"""),
    ("md", """
## Where the time goes: pickling versus shared memory

The cost the question ran into can be measured directly: a batch pickled,
pushed through a pipe and unpickled (what a DataLoader worker and the main
process do for every batch) against the same batch copied into shared memory
and out again (what `subprocess-threads` does). Both grow with the batch; the
pipe moves it 64 KB at a time, waking reader and writer for each chunk.
"""),
    ("code", """
import pickle
from spdl_lab.runners._shm import ShmFile, new_prefix
from spdl_lab.runners._transport import decode, encode, write_arrays

batch = [np.random.default_rng(i).random(SHAPE) for i in range(BATCH)]

def timed(fn, n=5):
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t0)
    return best

import threading
from multiprocessing import Pipe

receiver, sender = Pipe(duplex=False)

def pickle_through_a_pipe():
    # What a DataLoader worker and the main process do: pickle, write to a
    # pipe, read, unpickle. Here the "worker" is a thread of this process.
    worker = threading.Thread(target=sender.send, args=(batch,))
    worker.start()
    out = receiver.recv()
    worker.join()
    return out

def shared_memory_round_trip():
    encoded = encode(batch)            # arrays leave the pickle stream
    write_arrays(encoded, slot)        # one copy in (the child's side)
    return decode(encoded.meta, slot)  # one copy out (the parent's side)

slot = ShmFile(new_prefix() + "demo", encode(batch).nbytes, create=True)
try:
    assert all((a == b).all() for a, b in zip(shared_memory_round_trip(), batch))
    pickled, shared = timed(pickle_through_a_pipe), timed(shared_memory_round_trip)
finally:
    slot.close(); slot.unlink()
mb = sum(a.nbytes for a in batch) / 1e6
print(f"{mb:.1f} MB batch: pickled through a pipe {pickled * 1e3:.1f} ms, "
      f"through shared memory {shared * 1e3:.1f} ms")
"""),
    ("md", """
`benchmarks/ipc_overhead.py` runs the question's exact code (1.2 MB items,
batch 128, `num_workers` 0, 2, 4) next to the three runners and prints seconds
per batch, ratios, bytes moved per second and a floor from the measured CPU
time per item.
"""),
]

NOISY_NEIGHBOUR = [
    ("md", """
# The noisy neighbour: why threads made training slower

The field note (`shared/seeds/000`): a training job's loader was swapped from
the DataLoader baseline (2.4 batches/s) to threads (1.2 batches/s: slower!),
then to threads inside one subprocess (about 3.8), against a headspace of 4.2
when loading is free. The model code did not change; the training thread did
not get the GIL when it needed it to launch GPU kernels, so the GPU idled.

This notebook reproduces the shape of that study on a CPU-only machine.
`lab.workloads.noisy_neighbour()` returns a pipeline that reads (I/O wait),
decodes in Python (holding the GIL) and augments with numpy, and a
`SimulatedDevice` step: a GPU stream whose kernel launches are Python work
that needs the GIL, while the kernels themselves run without it.
"""),
    ("code", """
import spdl_lab as lab
from bokeh.io import output_notebook, show
from bokeh.resources import INLINE

output_notebook(INLINE, hide_banner=True)
pipeline, device = lab.workloads.noisy_neighbour()
print(pipeline)
device
"""),
    ("md", """
`compare` runs the same pipeline and step under each runner in interleaved
rounds: every round gives each runner one short window (a few warm-up steps,
then measured steps), so a slow spell of the machine hits all runners alike.
A runner's batches/s is the median of its rounds, `[lo-hi]` the slowest and
fastest round; ratios to `cache` pair rounds measured seconds apart.
`cmp.warnings` says what makes the comparison less than trustworthy, such as
runners within noise of each other. Small step counts keep this notebook
quick; `benchmarks/parallelism.py` and `make demo` run longer.
"""),
    ("code", """
cmp = lab.compare(pipeline, step=device, steps=40, warmup=4, repeats=4,
                  runner_options={"process": {"num_workers": 2}})
assert list(cmp.table.index) == list(lab.LOCAL_RUNNERS)
cmp
"""),
    ("code", """
for warning in cmp.warnings:
    print("-", warning)
"""),
    ("code", """
show(cmp.plot())
"""),
    ("md", """
## Reading the table

* `batches_per_s` (with `_lo`/`_hi`) and `vs_cache` (with `_lo`/`_hi`):
  throughput against headspace (`cache` replays batches, so loading is free
  and only the step remains). No runner can beat the headspace: if one does
  beyond the noise, `cmp.warnings` says the comparison is not trustworthy.
* `train_gil_wait_frac`: the share of the training thread's step spent
  waiting for the GIL while it was trying to launch kernels (its wall time
  minus its CPU time minus its run-queue wait). This is the noisy neighbour:
  under `thread` the decoders hold the GIL, launches come late, the device
  idles (`device_util` drops) and the step stretches (`step_p50_ms`).
* `train_runqueue_wait_frac`: the same for waiting for a CPU core. DataLoader
  workers (`process`) are separate processes, so they do not take the GIL,
  but they compete with the training thread for the two cores.
* Under `subprocess-threads` the decoders run in one child process: they
  cannot take the training thread's GIL, and being GIL-bound there they use
  about one core, leaving the other to training.
"""),
    ("code", """
cmp.table[["batches_per_s", "step_p50_ms", "device_util",
           "train_gil_wait_frac", "train_runqueue_wait_frac", "cpu_percent"]].round(3)
"""),
]

LIVE_DASHBOARD = [
    ("md", """
# The live dashboard

Start a training session in the background, watch it live, and move a
stage's concurrency while it runs. The workload is the noisy neighbour
(`lab.workloads.noisy_neighbour()`): a read → decode → augment → collate
pipeline and a `SimulatedDevice` step whose kernel launches need the GIL.
"""),
    ("code", """
%load_ext spdl_lab
%spdl_info
"""),
    ("code", """
import time
import spdl_lab as lab
from bokeh.io import output_notebook
from bokeh.resources import INLINE

output_notebook(INLINE, hide_banner=True)   # BokehJS from the package: no CDN

def wait_for(condition, timeout=60.0):
    # Polls a condition the way a reader watches the plots: never a fixed sleep.
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)

pipeline, step = lab.workloads.noisy_neighbour()
# `duration` caps the session in case this notebook is left open; the last cell stops it.
session = lab.run(pipeline, step, runner="thread", duration=300)
dash = session.dashboard()
dash
"""),
    ("md", """
The cell returned at once; the dashboard updates four times a second from the
session's telemetry frames. From the top: the header (runner, state,
interpreter and GIL, elapsed time, batches/s), the runner selector and
start/stop, one slider per map stage, the verdict, five plots (throughput per
stage, queue depth against capacity, step timings, CPU, and GIL wait against
run-queue wait), and the stage table.

Moving a slider calls `session.set_concurrency` live. Setting the slider's
value from code does exactly what dragging it does:
"""),
    ("code", """
dash.sliders["decode"].value = 3
wait_for(lambda: session.stats().stages["decode"].concurrency == 3)
wait_for(lambda: session.stats().step.steps >= 10)
session.stats().stages["decode"].concurrency
"""),
    ("md", """
The verdict reads the last five seconds of frames. Under `thread`, the
decoders share the GIL with the training thread, so the verdict points at
the training thread's GIL wait and suggests `subprocess-threads`. The runner
selector restarts the session under another runner; `dash.session` is the
new one.
"""),
    ("code", """
print(dash.last_verdict)
dash.runner.value = "subprocess-threads"
session = dash.session
assert session.runner == "subprocess-threads"
wait_for(lambda: session.stats().step.steps >= 10)
wait_for(lambda: dash.plots is not None and len(dash.plots.source.data["time_s"]) > 20)
print(dash.last_verdict)
"""),
    ("md", """
The session runs on until its `duration` (five minutes) is up, and the
dashboard below stays live: move a slider, pick the time window (last 1, 5
or 30 minutes), zoom with the wheel, hover a line for its value. Rates are
drawn as a 2 s moving average; `session.frames()` keeps every raw tick.
`session.stop()` ends it sooner, `dash.close()` closes the display.
"""),
    ("code", """
assert session.running and dash.plots is not None
dash
"""),
]

DIAGNOSTIC_MODE = [
    ("md", """
# Diagnostic mode: what limits each stage?

The SPDL RFC (`shared/seeds/001`): to know whether a stage holds the GIL,
waits on a lock, or fills the cores, run its function alone, fed cached
inputs, at one concurrency after another, and read the trend. `lab.diagnose`
does that for every map stage and gives each a verdict:

* `scales`: throughput keeps rising with threads (sleeps, I/O);
* `cpu-bound`: it releases the GIL and rises until the cores are busy;
* `gil-bound`: it does not rise, and the GIL probe shows the GIL is the wait
  (or, part I/O and part Python, it rises until its Python parts queue for the GIL);
* `contended`: it does not rise, yet neither the GIL nor the cores are full;
  a lock or another shared resource serializes it.

The pipeline below has three kinds: pure Python (`parse`), hashing a 1 MB
buffer (`checksum`; hashlib releases the GIL), and a sleep under a
module-level lock (`shared`).
"""),
    ("code", """
import hashlib
import threading
import time

import spdl_lab as lab

def parse(i):
    total = 0                          # pure Python: holds the GIL
    for k in range(20_000):
        total += k * k % 7
    return i

BLOB = bytes(range(256)) * 4096        # 1 MB

def checksum(i):
    return hashlib.sha256(BLOB).digest()[:4], i   # hashlib releases the GIL

LOCK = threading.Lock()

def shared(item):
    with LOCK:                         # one worker at a time, whatever the concurrency
        time.sleep(0.002)
    return item

pipeline = (lab.Pipeline(range(1_000))
              .map(parse, concurrency=4, name="parse")
              .map(checksum, concurrency=4, name="checksum")
              .map(shared, concurrency=4, name="shared"))
"""),
    ("md", """
The defaults (`concurrency=(1, 2, 4, 8, 16)`, 100 inputs, 0.3 s windows until
four or more agree within 5%, else ten) take one to four seconds per point.
CI runs this notebook on two cores, so the sweep here is shorter.
"""),
    ("code", """
QUICK = lab.SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=4)
diag = lab.diagnose(pipeline, concurrency=(1, 2, 4), num_items=32, settings=QUICK)
diag
"""),
    ("md", """
Each verdict comes with its evidence (the numbers behind it) and what to
change. Stages that do not rise with threads are also run by worker
processes: `parse` gets faster there, since each process has its own GIL.
`shared` could not be sent to a process because its function captures a
lock; the thread verdict stands, and the evidence says why processes were
not tried.

Only the verdicts that do not depend on how busy the machine is are checked:
a pure-Python loop is `gil-bound` and a lock is `contended` even when other
programs share the cores, while how far `checksum` rises depends on them.
"""),
    ("code", """
assert diag.stages["parse"].verdict == "gil-bound"
shared = diag.stages["shared"]
# contended, unless other processes kept the cores busy: then it says so, and that is the limit
assert shared.verdict == "contended" or "other processes" in shared.evidence, shared.evidence
# checksum releases the GIL: cpu-bound on a quiet machine. Not asserted: on a busy
# machine its verdict moves (see the evidence), and this notebook runs in CI.
diag.stages["checksum"].verdict
diag.verdicts()[["verdict", "best_concurrency"]]
"""),
    ("md", """
`diag.table` has one row per measured point: QPS with threads and with
processes, the CPU used (a share of all cores), and the GIL probe's wait.
"""),
    ("code", """
diag.table.round(3)
"""),
    ("code", """
from bokeh.io import output_notebook, show
from bokeh.resources import INLINE

output_notebook(INLINE, hide_banner=True)
show(diag.plot())
"""),
    ("md", """
## Without changing the code: `SPDL_PIPELINE_DIAGNOSTIC_MODE=1`

A training script that iterates a `lab.Loader` (or calls `lab.run`) needs no
edit. With `SPDL_PIPELINE_DIAGNOSTIC_MODE=1` in its environment, the first
iteration diagnoses the pipeline instead of running it, writes an HTML and a
JSON report, prints a summary and where the reports are, and exits with
status 1. `SPDL_PIPELINE_DIAGNOSTIC_MODE_CONCURRENCY` sets the sweep (default
`1,2,4,8,16`); `SPDL_PIPELINE_DIAGNOSTIC_MODE_NUM_ITEMS` sets how many inputs are
cached from the source, and `SPDL_LAB_REPORT_DIR` where the reports go (here
`spdl_lab_reports/` beside this notebook, which git ignores). This cell sweeps
only 1, 2 and 4 threads to stay quick.
"""),
    ("code", """
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = '''
import time
import numpy as np
import spdl_lab as lab

def read(i):
    time.sleep(0.002)                      # stands for storage or network I/O
    return i

def decode(i):
    return np.sort(np.random.default_rng(i).standard_normal(50_000))

def main():
    pipeline = (lab.Pipeline(range(10_000))
                  .map(read, concurrency=4, name="read")
                  .map(decode, concurrency=2, name="decode")
                  .batch(8))
    with lab.Loader(pipeline, runner="thread") as loader:
        for batch in loader:
            pass                           # the training step
    print("trained")

if __name__ == "__main__":
    main()
'''

workdir = Path(tempfile.mkdtemp(prefix="spdl_lab_demo_"))
script = workdir / "train.py"
script.write_text(SCRIPT)
reports = Path("spdl_lab_reports") / "05_diagnostic_mode"
shutil.rmtree(reports, ignore_errors=True)   # keep only this run's reports

env = {**os.environ, "SPDL_PIPELINE_DIAGNOSTIC_MODE": "1",
       "SPDL_PIPELINE_DIAGNOSTIC_MODE_NUM_ITEMS": "24",
       "SPDL_PIPELINE_DIAGNOSTIC_MODE_CONCURRENCY": "1,2,4",   # default 1,2,4,8,16; small for CI
       "SPDL_LAB_REPORT_DIR": str(reports.resolve())}
done = subprocess.run([sys.executable, str(script)], env=env, cwd=workdir,
                      capture_output=True, text=True, timeout=300)
print(done.stdout)
assert done.returncode == 1, done.stderr[-2000:]
assert "trained" not in done.stdout
"""),
    ("md", """
The script never trained: it printed the summary and the two report paths
(`report:` and `data:`), then stopped. The JSON report reads back into a
`Diagnosis`; the HTML report opens in a browser without a network (Bokeh is
inlined).
"""),
    ("code", """
from IPython.display import FileLink, display

paths = dict(line.split(":", 1) for line in done.stdout.splitlines() if line.startswith(("report:", "data:")))
html_report, json_report = (Path(paths[key].strip()) for key in ("report", "data"))
from_script = lab.Diagnosis.from_json(json_report)
assert list(from_script.stages) == ["read", "decode", "batch"]
assert from_script.stages["read"].verdict == "scales"
display(FileLink(os.path.relpath(html_report)))
from_script.verdicts()[["verdict", "best_concurrency", "recommendation"]]
"""),
    ("code", """
shutil.rmtree(workdir)   # the script; the reports stay for the link above
"""),
]

THREADS_OR_PROCESSES = [
    ("md", """
# Threads or processes?

The field note (`shared/seeds/003`): threads are lighter than processes (less
memory, nothing pickled between processes) and do well whenever the work
releases the GIL, as I/O waits and numpy, torch or GPU work do; for
pure-Python work the GIL serializes threads, and processes win.

Two small pipelines, one of each kind, are diagnosed first, then run under
three runners while items per second and memory are measured.
"""),
    ("code", """
import threading
import time

import numpy as np
import pandas as pd
import psutil
import spdl_lab as lab

N, BATCH = 480, 8              # small, for CI; a larger N gives steadier numbers
BASE = np.random.default_rng(0).standard_normal(100_000)

def load(i):
    time.sleep(0.004)          # stands for reading a file: releases the GIL
    return i

def augment(i):
    return np.sort(BASE + i)[::1_000].copy()     # numpy on a whole array: releases the GIL

def parse(i):
    total = 0                  # pure Python: holds the GIL
    for k in range(20_000):
        total += k * k % 7
    return np.full(100, total, dtype=np.float64)

releasing = (lab.Pipeline(range(N))
               .map(load, concurrency=8, name="load")
               .map(augment, concurrency=2, name="augment")
               .batch(BATCH))
holding = lab.Pipeline(range(N)).map(parse, concurrency=2, name="parse").batch(BATCH)
"""),
    ("md", """
## What the diagnosis says

A short sweep; the defaults go up to 16 threads and take longer.
"""),
    ("code", """
QUICK = lab.SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=4)
diagnoses = {
    name: lab.diagnose(p, concurrency=(1, 2, 4), num_items=32, settings=QUICK, progress=False)
    for name, p in {"GIL-releasing": releasing, "GIL-holding": holding}.items()
}
assert diagnoses["GIL-holding"].stages["parse"].verdict == "gil-bound"
pd.concat({name: d.verdicts().drop(index="batch")[["verdict", "best_concurrency", "recommendation"]]
           for name, d in diagnoses.items()})
"""),
    ("md", """
## Throughput and memory under each runner

* `thread`: thread pools in this process;
* `subprocess-threads`: the same thread pools inside one child process;
* `process`: `torch.utils.data.DataLoader` with 2 worker processes, each
  running the whole per-item chain one item at a time.

Items per second are counted from the fourth batch to the last, so starting
and stopping processes is not held against them. Memory is the peak resident memory (RSS)
of this process and its children, sampled every 50 ms while the loader runs;
`added_mb` is that peak less what this process held before. Each child is a
fresh Python with numpy and torch loaded, and RSS counts shared libraries
once per process.
"""),
    ("code", """
class PeakMemory:
    # Peak RSS of this process plus its children, sampled by a thread.

    def __init__(self, every_s=0.05):
        self.every_s, self.peak = every_s, 0
        self._me, self._stop = psutil.Process(), threading.Event()

    def total(self):
        rss = self._me.memory_info().rss
        for child in self._me.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except psutil.Error:       # a worker that has just exited
                pass
        return rss

    def _sample(self):
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self.total())

    def __enter__(self):
        self.peak = self.total()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

WARMUP = 4   # batches not timed

def measure(pipeline, runner):
    before = psutil.Process().memory_info().rss
    with PeakMemory() as memory, lab.Loader(pipeline, runner=runner) as loader:
        batches = iter(loader)
        items = sum(len(next(batches)) for _ in range(WARMUP))
        t0 = last = time.perf_counter()
        timed = 0
        for batch in batches:
            timed, last = timed + len(batch), time.perf_counter()
    # Up to the last batch: shutting workers down after it is not throughput.
    return {"items": items + timed, "items_per_s": timed / (last - t0),
            "peak_mb": memory.peak / 2**20, "added_mb": (memory.peak - before) / 2**20}

RUNNERS = ["thread", "subprocess-threads", "process"]
pipelines = {"GIL-releasing": releasing, "GIL-holding": holding}
results = pd.DataFrame({(name, runner): measure(p, runner)
                        for name, p in pipelines.items() for runner in RUNNERS}).T
results.index.names = ["pipeline", "runner"]
assert (results["items"] == N).all()
assert (results["peak_mb"] > 0).all()
added = results["added_mb"]
assert (added.xs("process", level="runner") > added.xs("thread", level="runner")).all()
results.round(1)
"""),
    ("code", """
results["items_per_s"].unstack("runner")[RUNNERS].round(0)
"""),
    ("md", """
## What the numbers say

* **GIL-releasing** (a sleep standing for I/O, numpy on whole arrays):
  threads overlap the waits and run numpy on both cores, for a few MB. The
  DataLoader's two workers each wait for their own reads, one at a time; to
  catch up they need more workers, and every worker costs hundreds of MB.
  Threads match or beat processes here, with far less memory.
* **GIL-holding** (a pure-Python loop): threads take turns holding the GIL,
  so `thread` and `subprocess-threads` get about one core whatever their
  concurrency, while each DataLoader worker has its own GIL and the two use
  both cores. Processes win, as the diagnosis said before anything ran
  (`gil-bound`, "processes help").
* `subprocess-threads` costs one child's memory. What it buys is not measured
  here: the training loop keeps its GIL to itself (notebook 04).

On a busy 2-core machine the timings move from run to run; the memory figures
and the verdicts do not.
"""),
]

WATCH_A_SCRIPT = [
    ("md", """
# Watch and steer a training script from the notebook

Real training runs as a script (`python train.py`, `torchrun ...`), not in a
notebook kernel. `spdl-lab watch -- python train.py` runs the script unchanged
and publishes every torch DataLoader, `lab.Loader`, SPDL pipeline and `lab.run`
session it iterates (the script need not import spdl_lab): a record file,
written as it goes, and a local endpoint (a Unix socket in a folder only you
can read). Here we start a small script in the background, attach to it,
watch its dashboard, move a slider in it, and read its record once it ends.
"""),
    ("code", """
import subprocess, sys, tempfile, time
from pathlib import Path

import spdl_lab as lab
from bokeh.io import output_notebook
from bokeh.resources import INLINE

output_notebook(INLINE, hide_banner=True)

SCRIPT = '''
import time
import numpy as np
import spdl_lab as lab

def decode(i):
    return np.sort(np.random.default_rng(i).standard_normal(20_000))

def main():
    pipeline = lab.Pipeline(range(6_000)).map(decode, concurrency=1, name="decode").batch(16)
    for batch in lab.Loader(pipeline, runner="thread"):   # no lab.publish: spdl-lab watch does it
        time.sleep(0.02)                                    # the training step
    print("trained")

if __name__ == "__main__":
    main()
'''

workdir = Path(tempfile.mkdtemp(prefix="spdl_lab_watch_"))
(workdir / "train.py").write_text(SCRIPT)
record = workdir / "tutorial.sqlite"
job = subprocess.Popen([sys.executable, "-m", "spdl_lab", "watch", "--name", "tutorial",
                        "--record", str(record), "--", sys.executable, "train.py"], cwd=workdir)

def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
"""),
    ("md", """
`lab.attach()` lists the published runs on this host; `lab.attach(name)` (or a pid)
returns a `RemoteSession` with the read API of a local Session. Its dashboard is the
same one `lab.run` gives.
"""),
    ("code", """
remote = lab.attach("tutorial", timeout=60)
wait_for(lambda: "qps" in set(remote.frames()["series"]))
lab.attach()[["name", "pid", "state", "runner"]]
"""),
    ("code", """
dashboard = remote.dashboard()
dashboard
"""),
    ("md", """
Moving a slider sends `set_concurrency` to the script, which applies it live
(the thread and subprocess-threads runners can). Here the code moves it, as a
user would.
"""),
    ("code", """
moved_at = remote.elapsed_s
dashboard.sliders["decode"].value = 2
wait_for(lambda: remote.controls()["decode"] == 2)
print(f"decode concurrency is now {remote.controls()['decode']} in pid {remote.pid}, {moved_at:.1f} s into the run")
"""),
    ("md", """
When the script ends, the RemoteSession says so, and the record stays: `lab.open`
reads it as a read-only RemoteSession (pandas could read it too: it is SQLite).
"""),
    ("code", """
assert job.wait(180) == 0
wait_for(lambda: remote.state != "running")
remote.close()
dashboard.close()
run = lab.open(record)
frames = run.frames()
qps = frames[(frames["series"] == "qps") & (frames["stage"] == "decode")]
before = qps[qps["time_s"] < moved_at]["value"].median()
after = qps[qps["time_s"] > moved_at + 1.0]["value"].median()
print(f"the script ended: {run.state}; the record holds {len(frames):,} values over {frames['time_s'].max():.1f} s")
print(f"decode: {before:,.0f} items/s at concurrency 1, {after:,.0f} at 2 ({after / before:.2f}x)")
"""),
    ("md", """
The same works for the loader most scripts have: a plain torch DataLoader, in a
script that never imports spdl_lab. Each `next()` on it is timed as data wait,
the time the loop holds a batch as the step, and its worker processes' CPU is read.
A DataLoader cannot change its workers while it runs, so its run has no sliders:
`set_concurrency` says why and what to do instead.
"""),
    ("code", """
DATALOADER_SCRIPT = '''
import time
import torch
from torch.utils.data import DataLoader, Dataset

class Decode(Dataset):
    def __len__(self):
        return 256
    def __getitem__(self, i):
        return torch.sort(torch.randn(20_000, generator=torch.Generator().manual_seed(i))).values

if __name__ == "__main__":
    loader = DataLoader(Decode(), batch_size=16, num_workers=2)
    for epoch in range(2):
        for batch in loader:
            time.sleep(0.02)   # the training step
'''
(workdir / "train_dl.py").write_text(DATALOADER_SCRIPT)
dl_record = workdir / "dataloader.sqlite"
done = subprocess.run([sys.executable, "-m", "spdl_lab", "watch", "--name", "dataloader", "--record",
                       str(dl_record), "--", sys.executable, "train_dl.py"], cwd=workdir, timeout=180)
assert done.returncode == 0
dl_run = lab.open(dl_record)
f = dl_run.frames()

def median(series, stage):
    return f[(f["series"] == series) & (f["stage"] == stage)]["value"].median()

print(f"{dl_run.runner} run, {dl_run.state}: {int(f[f['series'] == 'steps']['value'].max())} steps, "
      f"{median('batches_per_s', 'step'):.1f} batches/s, data wait {median('data_wait_frac', 'step'):.0%} "
      f"of the loop, workers at {median('cpu_percent', 'workers'):.0f}% CPU")
"""),
    ("code", """
import shutil
run.close()
dl_run.close()
shutil.rmtree(workdir)  # the scripts and their records: this tutorial leaves nothing behind
"""),
]

REAL_IMAGES = [
    ("md", """
# A real image pipeline: from a plain DataLoader to the fastest configuration

JPEG files (made on this machine by `lab.workloads`, photo-like, 20-80 KB each),
read, decoded with PIL, randomly cropped and flipped, normalized, stacked: the
input pipeline of an image classifier. The training step is a small real model
(three convolutions and a linear layer, forward, backward, SGD) on the CPU. The
journey: measure the loader as it is, find the stage that limits it, compare the
runners, and take the fastest configuration away as code. Every number below is
measured by the notebook as it runs; on another machine they will differ.
"""),
    ("code", """
import spdl_lab as lab

N, BATCH, CROP = 384, 16, 112   # small for CI; raise N and CROP=224 on a real machine

dl = lab.workloads.image_dataloader(n=N, batch_size=BATCH, num_workers=2, crop=CROP)
pipeline, step = lab.workloads.images(n=N, crop=CROP, batch_size=BATCH, epochs=6)
print(step)
"""),
    ("md", """
First the loader as a user has it: a map-style Dataset in a torch DataLoader with two
workers. `lab.run` times the training loop: how long each step waits for its batch.
"""),
    ("code", """
def steady_rate(session, skip=4):
    # batches/s after the first steps, so the workers' start-up is not counted
    done = session.clock.records()[skip:]
    return (len(done) - 1) / (done[-1].end_s - done[0].end_s)

session = lab.run(dl, step=step, steps=20)
assert session.wait(timeout=180)
plain = session.stats().step
plain_rate = steady_rate(session)
print(f"plain DataLoader, num_workers=2: {plain_rate:.1f} batches/s after start-up, "
      f"the step waited for data {plain.data_wait_frac:.0%} of the loop "
      f"(step p50 {plain.step_p50_ms:.0f} ms, wait p50 {plain.data_wait_p50_ms:.1f} ms)")
"""),
    ("md", """
`lab.workloads.images` is the same work split into stages (read, decode, augment,
normalize, collate), so `lab.diagnose` can measure each alone, in threads and in
processes, and say what limits it. PIL releases the GIL while it decodes, so decode
should not read gil-bound; what it reads on this machine is printed below.
"""),
    ("code", """
QUICK = lab.SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=5)
diag = lab.diagnose(pipeline, concurrency=(1, 2, 4), num_items=96, settings=QUICK, progress=False)
print(diag.headline())
diag.verdicts()
"""),
    ("md", """
Now the same pipeline and step under every runner, in interleaved rounds
(`thread`; `subprocess-threads`, the thread engine in a child process; `process`, a
torch DataLoader with worker processes; `cache`, the headspace where loading is free).
"""),
    ("code", """
cmp = lab.compare(pipeline, step=step, steps=36, warmup=4, repeats=3, progress=False)
cmp.table[["batches_per_s", "batches_per_s_lo", "batches_per_s_hi", "vs_cache", "data_wait_frac",
           "step_p50_ms", "cpu_percent"]].round(3)
"""),
    ("code", """
for warning in cmp.warnings:
    print("-", warning)
"""),
    ("md", """
The fastest runner that really loads (not `cache`), with each stage at the smallest
concurrency diagnose found within 5% of its best, as code to paste into a training
script. When the comparison could not tell runners apart (see the warnings), the
choice among them is a coin toss, and the printout says so.
"""),
    ("code", """
table = cmp.table.drop(index="cache")
best = table["batches_per_s"].idxmax()
concurrency = {name: s.best_concurrency for name, s in diag.stages.items() if s.best_concurrency}
chain = "".join(f'.with_concurrency("{name}", {n})' for name, n in concurrency.items())
print(f"loader = lab.Loader(pipeline{chain}, runner={best!r})")
tied = [r for r in table.index if r != best and table.loc[r, "batches_per_s_hi"] >= table.loc[best, "batches_per_s_lo"]]
ratio = table.loc[best, "batches_per_s"] / table.loc["process", "batches_per_s"]
print(f"{best}: {table.loc[best, 'batches_per_s']:.1f} batches/s, {ratio:.2f}x the process runner "
      f"(torch DataLoader workers running the same chain) in the same rounds; {table.loc[best, 'vs_cache']:.2f}x the headspace")
print("within noise of it: " + (", ".join(tied) if tied else "none"))
"""),
    ("md", """
Last, that configuration as a training loop, beside the plain DataLoader the notebook
started with (two runs one after the other, so the machine's noise applies).
"""),
    ("code", """
tuned_pipeline = pipeline
for name, n in concurrency.items():
    tuned_pipeline = tuned_pipeline.with_concurrency(name, n)
tuned = lab.run(tuned_pipeline, step=step, runner=best, steps=20)
assert tuned.wait(timeout=180)
fast, fast_rate = tuned.stats().step, steady_rate(tuned)
print(f"{best} with {concurrency}: {fast_rate:.1f} batches/s, data wait {fast.data_wait_frac:.0%}; "
      f"the plain DataLoader: {plain_rate:.1f} batches/s, data wait {plain.data_wait_frac:.0%} "
      f"({fast_rate / plain_rate:.2f}x)")
"""),
]

TEXT_TOKENIZERS = [
    ("md", """
# Two tokenizers and the GIL

Text pipelines tokenize. `lab.workloads.text` makes a corpus on this machine (made-up
words, Zipf-distributed), trains a WordPiece tokenizer on it with Hugging Face
`tokenizers` (Rust), and offers the same algorithm in pure Python over the same
vocabulary. The Python one holds the GIL for every character it looks at. The Rust one
is often assumed not to; this notebook measures it, one document per call
(`tokenizer="rust"`) and a batch per call (`"rust-batch"`, `encode_batch`).
"""),
    ("code", """
import spdl_lab as lab
from spdl_lab.workloads.text import Documents, PythonTokenize, RustTokenize, corpus, tokenizer_file

N = 1024
vocab = tokenizer_file(None, 8_000)   # trained once, then cached beside the corpus
documents = list(Documents(corpus(N, None), 200))
same = sum(RustTokenize(vocab)(d) == PythonTokenize(vocab)(d) for d in documents)
print(f"identical token ids on {same} of {len(documents)} documents; the first begins: {documents[0][:70]}...")
"""),
    ("md", """
`lab.diagnose` runs each tokenizer alone in 1, 2 and 4 threads, with a probe that
measures how long a thread waits for the GIL (`processes=False` leaves out the process
sweep: whether processes help is notebook 06's question).
"""),
    ("code", """
QUICK = lab.SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=5)
rows = {}
for name in ("python", "rust", "rust-batch"):
    pipeline, _ = lab.workloads.text(n=N, tokenizer=name)
    stage = lab.diagnose(pipeline, concurrency=(1, 2, 4), num_items=256, settings=QUICK,
                         processes=False, progress=False).stages["tokenize"]
    rows[name] = stage
    print(f"{name:10s} {stage.verdict:10s} best concurrency {stage.best_concurrency}: {stage.evidence}")
"""),
    ("code", """
held = [name for name, stage in rows.items() if stage.verdict == "gil-bound"]
free = [name for name in rows if name not in held]
print(f"hold the GIL (threads do not help): {', '.join(held) or 'none'}; "
      f"do not: {', '.join(free) or 'none'}")
"""),
    ("md", """
Why can a Rust tokenizer hold the GIL? A call from Python converts its input and builds
its result (`Encoding` objects, offsets, ids) as Python objects, under the GIL, and a
per-document call is short enough that this is most of it. `encode_batch` converts a
batch once and tokenizes it with the GIL released, spread over all the cores by its own
Rust threads (`TOKENIZERS_PARALLELISM`), which is why one Python thread of it can fill
the machine. Whether your tokenizer does one or the other is an implementation detail:
measure it, as above.

What it means for training: beside a GPU stream whose kernel launches need the GIL
(`device="simulated"`), a GIL-holding tokenizer under the `thread` runner delays the
launches. `train_gil_wait_frac` is the training thread's wait for the GIL.
"""),
    ("code", """
import pandas as pd

tables = {}
for name in ("python", "rust-batch"):
    pipeline, device = lab.workloads.text(n=N, tokenizer=name, device="simulated")
    cmp = lab.compare(pipeline, step=device, runners=("thread", "subprocess-threads"), steps=24,
                      warmup=4, repeats=2, progress=False)
    tables[name] = cmp.table[["batches_per_s", "train_gil_wait_frac", "data_wait_frac", "cpu_percent"]]
pd.concat(tables, names=["tokenizer", "runner"]).round(3)
"""),
    ("code", """
for name, table in tables.items():
    wait = table["train_gil_wait_frac"]
    print(f"{name}: the training thread waited for the GIL {wait['thread']:.0%} of its time under thread, "
          f"{wait['subprocess-threads']:.0%} under subprocess-threads")
"""),
]

from notebook_autotune import AUTOTUNE  # noqa: E402 - tutorial 10 lives in its own module
from notebook_ray import RAY  # noqa: E402 - tutorial 11 too

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_ipc_overhead.ipynb": IPC_OVERHEAD,
    "03_live_dashboard.ipynb": LIVE_DASHBOARD,
    "04_noisy_neighbour.ipynb": NOISY_NEIGHBOUR,
    "05_diagnostic_mode.ipynb": DIAGNOSTIC_MODE,
    "06_threads_or_processes.ipynb": THREADS_OR_PROCESSES,
    "07_watch_a_script.ipynb": WATCH_A_SCRIPT,
    "08_real_images.ipynb": REAL_IMAGES,
    "09_text_tokenizers.ipynb": TEXT_TOKENIZERS,
    "10_autotune.ipynb": AUTOTUNE,
    "11_ray.ipynb": RAY,
}
