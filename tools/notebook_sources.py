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

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_ipc_overhead.ipynb": IPC_OVERHEAD,
}
