# %% [markdown]
# # spdl_lab quickstart
#
# Build a data pipeline, run it under the `thread` runner, and read what its
# meters say: per-stage throughput, task times, queue depths, and the sampler's
# time series.

# %%
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

# %% [markdown]
# `Pipeline` only describes the work. A `Loader` runs it; every stage gets a
# pool of threads and a bounded queue in front of it, so memory stays bounded
# whatever the speeds.

# %%
with lab.Loader(pipeline, runner="thread") as loader:
    shapes = [batch.shape for batch in loader]
    snap = loader.stats()
    frames = loader.frames()

assert len(shapes) == -(-N // 64) and shapes[0] == (64, 32, 32)
snap

# %% [markdown]
# `fetch` sleeps 2 ms per item, so with 8 workers it can do about 4,000 items/s;
# its p50 task time is the sleep, not the time items waited for a worker. The
# queue columns describe each stage's *input*: a full input queue marks the
# slower side.

# %%
fetch_stats = snap.stages["fetch"]
assert 1.5 <= fetch_stats.p50_ms <= 20
fetch_stats.tasks, round(fetch_stats.p50_ms, 2)

# %% [markdown]
# ## Changing concurrency while it runs
#
# `set_concurrency` resizes a stage's pool live, without losing or reordering
# items. Here `fetch` starts with 1 worker and gets 16 halfway through.

# %%
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

# %% [markdown]
# ## Frames
#
# `frames()` is one row per sampler tick per series (long format:
# `time_s, series, stage, value`), ready for pandas:

# %%
wide = frames.pivot_table(index="time_s", columns=["series", "stage"], values="value")
wide[[("qps", "fetch"), ("concurrency", "fetch"), ("queue_depth", "source→fetch")]].tail()

# %% [markdown]
# ## Bring your own loader
#
# An existing `torch.utils.data.DataLoader` becomes a Pipeline with
# `lab.from_dataloader` (sampler, `__getitem__` with `num_workers` threads,
# batch, collate), so the same loader can run under every runner. An SPDL
# pipeline comes in with `lab.from_spdl`, or runs as SPDL builds it with
# `lab.run(builder, ...)` while lab's hooks meter every stage.

# %%
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

# %%
from IPython.display import display

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
