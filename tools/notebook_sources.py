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
`compare` runs the same pipeline and step under each runner, one after
another, and measures after a warm-up (so spawning workers does not count).
Small step counts keep this notebook quick; `benchmarks/parallelism.py` and
`make demo` run longer.
"""),
    ("code", """
cmp = lab.compare(pipeline, step=device, steps=40, warmup=8,
                  runner_options={"process": {"num_workers": 2}})
assert list(cmp.table.index) == list(lab.RUNNERS)
cmp
"""),
    ("code", """
show(cmp.plot())
"""),
    ("md", """
## Reading the table

* `batches_per_s` and `vs_cache`: throughput against headspace (`cache`
  replays batches, so loading is free and only the step remains).
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
    ("code", """
session.stop()
dash.close()
session.state
"""),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_ipc_overhead.ipynb": IPC_OVERHEAD,
    "03_live_dashboard.ipynb": LIVE_DASHBOARD,
    "04_noisy_neighbour.ipynb": NOISY_NEIGHBOUR,
}
