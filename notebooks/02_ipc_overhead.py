# %% [markdown]
# # Why more `num_workers` stop helping when batches are large
#
# The field note (`shared/seeds/002`): a DataLoader whose items are
# `(1000, 150)` float64 arrays (1.2 MB) in batches of 128 barely speeds up from
# 2 to 8 workers, while the same loader with `(10, 150)` items scales. Each
# worker must pickle its 154 MB batch, push it through a pipe, and the main
# process must unpickle it: that cost grows with the batch, is paid by the
# training process, and does not shrink with more workers.
#
# Here the same pipeline runs under three runners, at sizes small enough for CI:
#
# * `process` — the real `torch.utils.data.DataLoader`, batches pickled through pipes;
# * `thread` — thread pools in this process, nothing crosses a process boundary;
# * `subprocess-threads` — threads in one child process, arrays through shared memory.

# %%
import time

import numpy as np

import spdl_lab as lab

SHAPE = (200, 150)      # 240 KB items; the question's are 1.2 MB
BATCH = 32              # 7.7 MB batches
STEP_S = 0.02           # the "training step"
WARMUP, STEPS = 3, 8

def seconds_per_batch(loader):
    times = []
    t0 = time.perf_counter()
    for i, _ in enumerate(loader):
        time.sleep(STEP_S)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if i + 1 >= WARMUP + STEPS:
            break
    return float(np.mean(times))  # the mean, as the question takes it

items = BATCH * (WARMUP + STEPS + 1)
pipeline = lab.workloads.ipc_overhead(items=items, shape=SHAPE, batch_size=BATCH, concurrency=8)
pipeline

# %%
configs = [("process", {"num_workers": 1}), ("process", {"num_workers": 2}),
           ("thread", {}), ("subprocess-threads", {})]
results = {}
for runner, options in configs:
    label = runner + "".join(f" {k}={v}" for k, v in options.items())
    with lab.Loader(pipeline, runner=runner, **options) as loader:
        results[label] = seconds_per_batch(loader)
{k: round(v, 3) for k, v in results.items()}

# %%
from bokeh.io import output_notebook, show
from bokeh.plotting import figure
from bokeh.resources import INLINE

output_notebook(INLINE, hide_banner=True)
labels = list(results)
fig = figure(y_range=labels[::-1], height=220, width=600, x_axis_label="seconds per batch (lower is better)",
             title=f"{BATCH} x {SHAPE} float64 per batch, {STEP_S * 1e3:.0f} ms step")
fig.hbar(y=labels, right=[results[k] for k in labels], height=0.6)
show(fig)

# %% [markdown]
# ## Where the time goes: pickling versus shared memory
#
# The cost the question ran into can be measured directly: a batch pickled,
# pushed through a pipe and unpickled (what a DataLoader worker and the main
# process do for every batch) against the same batch copied into shared memory
# and out again (the copies `subprocess-threads` makes). Both grow with the batch; the
# pipe moves it 64 KB at a time, waking reader and writer for each chunk.

# %%
import threading
from multiprocessing import Pipe, shared_memory

batch = [np.random.default_rng(i).random(SHAPE) for i in range(BATCH)]


def timed(fn, n=5):
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


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
    # What subprocess-threads does with arrays: only their shapes are pickled; the
    # data is copied once into shared memory (the child's side) and once out (the parent's).
    region = np.ndarray((len(batch), *SHAPE), dtype=batch[0].dtype, buffer=slot.buf)
    for k, array in enumerate(batch):
        region[k] = array
    return [region[k].copy() for k in range(len(batch))]


nbytes = sum(a.nbytes for a in batch)
slot = shared_memory.SharedMemory(create=True, size=nbytes)
try:
    assert all((a == b).all() for a, b in zip(shared_memory_round_trip(), batch))
    pickled, shared = timed(pickle_through_a_pipe), timed(shared_memory_round_trip)
finally:
    slot.close()
    slot.unlink()
print(f"{nbytes / 1e6:.1f} MB batch: pickled through a pipe {pickled * 1e3:.1f} ms, "
      f"through shared memory {shared * 1e3:.1f} ms")

# %% [markdown]
# `benchmarks/ipc_overhead.py` runs the question's exact code (1.2 MB items,
# batch 128, `num_workers` 0, 2, 4) next to the three runners and prints seconds
# per batch, ratios, bytes moved per second and a floor from the measured CPU
# time per item.
