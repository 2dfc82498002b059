# %% [markdown]
# # Threads or processes?
#
# The field note (`shared/seeds/003`): threads are lighter than processes (less
# memory, nothing pickled between processes) and do well whenever the work
# releases the GIL, as I/O waits and numpy, torch or GPU work do; for
# pure-Python work the GIL serializes threads, and processes win.
#
# Two small pipelines, one of each kind, are diagnosed first, then run under
# three runners while items per second and memory are measured.

# %%
import threading
import time

import numpy as np
import pandas as pd
import psutil

import spdl_lab as lab

N, BATCH = 320, 8              # small, for CI; a larger N gives steadier numbers
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

# %% [markdown]
# ## What the diagnosis says
#
# A short sweep; the defaults go up to 16 threads and take longer.

# %%
QUICK = lab.SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=4)
diagnoses = {
    name: lab.diagnose(p, concurrency=(1, 2, 4), num_items=32, settings=QUICK, progress=False)
    for name, p in {"GIL-releasing": releasing, "GIL-holding": holding}.items()
}
assert diagnoses["GIL-holding"].stages["parse"].verdict == "gil-bound"
pd.concat({name: d.verdicts().drop(index="batch")[["verdict", "best_concurrency", "recommendation"]]
           for name, d in diagnoses.items()})


# %% [markdown]
# ## Throughput and memory under each runner
#
# * `thread`: thread pools in this process;
# * `subprocess-threads`: the same thread pools inside one child process;
# * `process`: `torch.utils.data.DataLoader` with 2 worker processes, each
#   running the whole per-item chain one item at a time.
#
# Items per second are counted from the fourth batch to the last, so starting
# and stopping processes is not held against them. Memory is the peak resident memory (RSS)
# of this process and its children, sampled every 50 ms while the loader runs;
# `added_mb` is that peak less what this process held before. Each child is a
# fresh Python with numpy and torch loaded, and RSS counts shared libraries
# once per process.

# %%
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

# %%
results["items_per_s"].unstack("runner")[RUNNERS].round(0)

# %% [markdown]
# ## What the numbers say
#
# * **GIL-releasing** (a sleep standing for I/O, numpy on whole arrays):
#   threads overlap the waits and run numpy on both cores, for a few MB. The
#   DataLoader's two workers each wait for their own reads, one at a time; to
#   catch up they need more workers, and every worker costs hundreds of MB.
#   Threads match or beat processes here, with far less memory.
# * **GIL-holding** (a pure-Python loop): threads take turns holding the GIL,
#   so `thread` and `subprocess-threads` get about one core whatever their
#   concurrency, while each DataLoader worker has its own GIL and the two use
#   both cores. Processes win, as the diagnosis said before anything ran
#   (`gil-bound`, "processes help").
# * `subprocess-threads` costs one child's memory. What it buys is not measured
#   here: the training loop keeps its GIL to itself (notebook 04).
#
# On a busy 2-core machine the timings move from run to run; the memory figures
# and the verdicts do not.
