# %% [markdown]
# # The noisy neighbour: why threads made training slower
#
# The field note (`shared/seeds/000`): a training job's loader was swapped from
# the DataLoader baseline (2.4 batches/s) to threads (1.2 batches/s: slower!),
# then to threads inside one subprocess (about 3.8), against a headspace of 4.2
# when loading is free. The model code did not change; the training thread did
# not get the GIL when it needed it to launch GPU kernels, so the GPU idled.
#
# This notebook reproduces the shape of that study on a CPU-only machine.
# `lab.workloads.noisy_neighbour()` returns a pipeline that reads (I/O wait),
# decodes in Python (holding the GIL) and augments with numpy, and a
# `SimulatedDevice` step: a GPU stream whose kernel launches are Python work
# that needs the GIL, while the kernels themselves run without it.

# %%
from bokeh.io import output_notebook, show
from bokeh.resources import INLINE

import spdl_lab as lab

output_notebook(INLINE, hide_banner=True)
pipeline, device = lab.workloads.noisy_neighbour()
print(pipeline)
device

# %% [markdown]
# `compare` runs the same pipeline and step under each runner in interleaved
# rounds: every round gives each runner one short window (a few warm-up steps,
# then measured steps), so a slow spell of the machine hits all runners alike.
# A runner's batches/s is the median of its rounds, `[lo-hi]` the slowest and
# fastest round; ratios to `cache` pair rounds measured seconds apart.
# `cmp.warnings` says what makes the comparison less than trustworthy, such as
# runners within noise of each other. Small step counts keep this notebook
# quick; `benchmarks/parallelism.py` and `make demo` run longer.

# %%
cmp = lab.compare(pipeline, step=device, steps=30, warmup=4, repeats=3,
                  runner_options={"process": {"num_workers": 2}})
assert list(cmp.table.index) == list(lab.LOCAL_RUNNERS)
cmp

# %%
for warning in cmp.warnings:
    print("-", warning)

# %%
show(cmp.plot())

# %% [markdown]
# ## Reading the table
#
# * `batches_per_s` (with `_lo`/`_hi`) and `vs_cache` (with `_lo`/`_hi`):
#   throughput against headspace (`cache` replays batches, so loading is free
#   and only the step remains). No runner can beat the headspace: if one does
#   beyond the noise, `cmp.warnings` says the comparison is not trustworthy.
# * `train_gil_wait_frac`: the share of the training thread's step spent
#   waiting for the GIL while it was trying to launch kernels (its wall time
#   minus its CPU time minus its run-queue wait). This is the noisy neighbour:
#   under `thread` the decoders hold the GIL, launches come late, the device
#   idles (`device_util` drops) and the step stretches (`step_p50_ms`).
# * `train_runqueue_wait_frac`: the same for waiting for a CPU core. DataLoader
#   workers (`process`) are separate processes, so they do not take the GIL,
#   but they compete with the training thread for the two cores.
# * Under `subprocess-threads` the decoders run in one child process: they
#   cannot take the training thread's GIL, and being GIL-bound there they use
#   about one core, leaving the other to training.

# %%
cmp.table[["batches_per_s", "step_p50_ms", "device_util",
           "train_gil_wait_frac", "train_runqueue_wait_frac", "cpu_percent"]].round(3)
