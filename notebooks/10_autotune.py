# %% [markdown]
# # Autotune: let the lab set the concurrency, for the training step
#
# `lab.diagnose` says what limits each stage. `lab.tune` goes on from there: it measures
# training batches per second (the StepClock's figure, not the loader's), predicts each
# move with a model of the stages' rates, keeps a move only when it helps beyond the
# noise, and hands back the configuration as code. Every move is logged, prediction next
# to measurement.
#
# The pipeline below is set up badly on purpose: one reader for a stage that waits on I/O,
# and four threads for a pure-Python decode that holds the GIL. The step is a simulated GPU
# stream whose kernel launches need the GIL, so a GIL-holding loader in the same
# interpreter slows the step down (the noisy neighbour).

# %%
import time

import spdl_lab as lab


def read(i):
    time.sleep(0.004)            # I/O: waits without the GIL
    return i

def decode(i):
    total = 0
    for k in range(6_000):       # pure Python: holds the GIL
        total += k * i % 7
    return total

pipeline = (lab.Pipeline(range(10**7))
            .map(read, concurrency=1, name="read")
            .map(decode, concurrency=4, name="decode")
            .batch(8))
device = lab.SimulatedDevice(kernels=40, launch_us=200, kernel_us=500, gil_release_every=10)
print(pipeline.stages)

# %% [markdown]
# `lab.tune` starts from the pipeline as written, under the first runner it is given, and
# spends at most `budget_s` seconds (the final side-by-side check included). It is short
# here so the notebook runs in CI; a real tuning takes a minute.

# %%
tuning = lab.tune(pipeline, step=device, runners=("thread", "subprocess-threads", "process"),
                  budget_s=15, progress=False)
print(tuning.summary())
for line in tuning.log:
    print("-", line)

# %%
tuning.trials[["runner", "concurrency", "batches_per_s", "predicted_batches_per_s", "limit",
               "step_p50_ms", "data_wait_frac", "cpu_percent", "kept"]].round(2)

# %%
from bokeh.io import output_notebook, show
from bokeh.resources import INLINE

output_notebook(INLINE, hide_banner=True)
show(tuning.plot())

# %% [markdown]
# The result is data, and the claims below are computed from it: where it started, where it
# ended, and the speedup measured side by side (alternating rounds of the two). The tuner
# never returns a configuration measurably worse than the start.

# %%
start, best = tuning.trials.iloc[0], tuning.best
print(f"start: {tuning.start['runner']} {tuning.start['concurrency']}: {start['batches_per_s']:.1f} batches/s")
print(f"best:  {best['runner']} {best['concurrency']} {best['options'] or ''}: "
      f"{tuning.best_batches_per_s:.1f} batches/s, {tuning.speedup:.2f}x the start side by side")
assert tuning.speedup >= 0.97, "a configuration measurably worse than the start is never returned"
print(tuning.code)

# %%
with tuning.loader() as loader:
    batches = iter(loader)
    first = next(batches)
print(f"tuning.loader() runs the best: runner {loader.runner}, first batch of {len(first)} items")
tuning.to_json("spdl_lab_reports/tuning.json")
print(lab.Tuning.from_json("spdl_lab_reports/tuning.json").best == tuning.best)

# %% [markdown]
# ## Live: the dashboard's "auto" toggle
#
# `session.autotune()` runs the same climb on a running session through the same
# `set_concurrency` the sliders use, so the sliders move by themselves and each move, with
# its reason, appears under the verdict. Moving a slider yourself takes over. Switching
# the toggle on from code does what clicking it does.

# %%
session = lab.run(pipeline, step=device, runner="thread", duration=120)
dash = session.dashboard()
dash.auto_budget_s = 15
dash.auto.value = True
dash

# %%
assert dash.autotuner.wait(timeout=90)
for line in dash.autotuner.log:
    print("-", line)
print("the session now runs", session.controls(), "; the sliders show",
      {name: s.value for name, s in dash.sliders.items()})
session.stop()
dash.close()
