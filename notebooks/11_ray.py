# %% [markdown]
# # When one host is not enough: the same pipeline on Ray Data
#
# When preprocessing needs more CPU than the training host has, teams move it to a cluster.
# `runner="ray"` runs the same `lab.Pipeline` on Ray Data: each map stage becomes a Ray
# Data operation at its concurrency (a function as tasks, a callable object as an actor
# pool), `batch` becomes Ray's batching, and the batches come back to the training loop in
# order. The lab's meters run inside the Ray workers, so `stats()`, `frames()` and the
# dashboard read as for the local runners.
#
# This notebook runs on a local Ray instance (`address=None`: started on 127.0.0.1 with
# this machine's cores, no dashboard, shut down on close). On one machine, Ray has the same
# cores as the local runners; what a cluster adds is cores this host does not have. So the
# numbers below show the machinery's start-up and its rate beside the local runners; the
# last section says what changes on a cluster.

# %%
import os
import time

import numpy as np

import spdl_lab as lab


def decode(i):
    a = np.random.default_rng(i).random((96, 96))
    for _ in range(12):          # numpy on a whole array: releases the GIL
        a = np.sqrt(a * a + 1.0)
    return a[:32, :32].astype(np.float32)

def collate(items):
    return np.stack(items)

pipeline = (lab.Pipeline(range(4_000))   # 250 batches: small, for CI
              .map(decode, concurrency=2, name="decode")
              .batch(16)
              .map(collate, name="collate"))
step = lab.SimulatedDevice(kernels=10)      # a 4 ms training step

# %% [markdown]
# ## One loader on Ray
#
# The first batch pays for starting Ray (its GCS and raylet) and its worker processes,
# which import this notebook's functions. A long-lived cluster pays that once.

# %%
t0 = time.perf_counter()
with lab.Loader(pipeline, runner="ray") as loader:
    batches = iter(loader)
    first = next(batches)
    startup_s = time.perf_counter() - t0
    for _ in zip(range(40), batches):
        pass
stats = loader.stats()   # after close: the workers' last counts are in
print(f"first batch {first.shape} after {startup_s:.1f} s; {stats.stages['decode'].tasks} decode tasks "
      f"counted inside the Ray workers while 41 batches were taken (Ray Data runs ahead)")
stats.table()[["tasks", "failures", "qps", "p50_ms"]]

# %% [markdown]
# ## Side by side with the local runners
#
# `lab.compare` takes `"ray"` by name (it is not in its default list: it starts a cluster).
# Each runner's loader stays open between rounds, so Ray's start-up is not in the rates.

# %%
cmp = lab.compare(pipeline, step, runners=("thread", "subprocess-threads", "ray"), steps=24, warmup=4,
                  repeats=2, progress=False)
cmp.table[["batches_per_s", "batches_per_s_lo", "batches_per_s_hi", "data_wait_frac", "cpu_percent"]].round(2)

# %%
table = cmp.table
local = table.loc[["thread", "subprocess-threads"], "batches_per_s"]
ratio = table.loc["ray", "batches_per_s"] / local.max()
overlap = table.loc["ray", "batches_per_s_lo"] <= table.loc[local.idxmax(), "batches_per_s_hi"] and           table.loc[local.idxmax(), "batches_per_s_lo"] <= table.loc["ray", "batches_per_s_hi"]
print(f"ray: {table.loc['ray', 'batches_per_s']:.1f} batches/s, {ratio:.2f}x the best local runner "
      f"({local.idxmax()}, {local.max():.1f}) on this {os.cpu_count()}-core machine"
      + ("; the rounds overlap: no difference beyond the noise" if overlap else "")
      + f". Its start-up, {startup_s:.0f} s, is not in these rates.")

# %% [markdown]
# ## On a real cluster
#
# 1. Start Ray on the cluster, the same version as here (`ray[data]==2.60.0`): `ray start --head`
#    on the head node, `ray start --address=<head>:6379` on each worker node.
# 2. Make the pipeline's functions importable on the workers: install the package that
#    defines them on every node, or pass a runtime environment,
#    `ray_init_kwargs={"runtime_env": {"py_modules": [my_package]}}`.
# 3. Point the loader at it; the lab joins the cluster and never shuts it down:
#
#    ```python
#    loader = lab.Loader(pipeline, runner="ray", address="ray://<head>:10001")   # or "auto" on a node
#    session = lab.run(pipeline, step, runner="ray", address="auto")             # the dashboard as here
#    ```
# 4. Give a stage the resources it needs per task if the default (one CPU) is wrong:
#    `resources={"decode": {"num_cpus": 2}}`.
#
# What to expect (the README's cost model): a CPU-bound pipeline's rate grows with the
# cluster's cores until the training step or the link into the training host limits it;
# every batch made on another node crosses that link once.
