# %% [markdown]
# # The live dashboard
#
# Start a training session in the background, watch it live, and move a
# stage's concurrency while it runs. The workload is the noisy neighbour
# (`lab.workloads.noisy_neighbour()`): a read → decode → augment → collate
# pipeline and a `SimulatedDevice` step whose kernel launches need the GIL.

# %%
# %load_ext spdl_lab
# %spdl_info

# %%
import time

from bokeh.io import output_notebook
from bokeh.resources import INLINE

import spdl_lab as lab

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

# %% [markdown]
# The cell returned at once; the dashboard updates four times a second from the
# session's telemetry frames. From the top: the header (runner, state,
# interpreter and GIL, elapsed time, batches/s), the runner selector and
# start/stop, one slider per map stage, the verdict, five plots (throughput per
# stage, queue depth against capacity, step timings, CPU, and GIL wait against
# run-queue wait), and the stage table.
#
# Moving a slider calls `session.set_concurrency` live. Setting the slider's
# value from code does exactly what dragging it does:

# %%
dash.sliders["decode"].value = 3
wait_for(lambda: session.stats().stages["decode"].concurrency == 3)
wait_for(lambda: session.stats().step.steps >= 10)
session.stats().stages["decode"].concurrency

# %% [markdown]
# The verdict reads the last five seconds of frames. Under `thread`, the
# decoders share the GIL with the training thread, so the verdict points at
# the training thread's GIL wait and suggests `subprocess-threads`. The runner
# selector restarts the session under another runner; `dash.session` is the
# new one.

# %%
print(dash.last_verdict)
dash.runner.value = "subprocess-threads"
session = dash.session
assert session.runner == "subprocess-threads"
wait_for(lambda: session.stats().step.steps >= 10)
wait_for(lambda: dash.plots is not None and len(dash.plots.source.data["time_s"]) > 20)
print(dash.last_verdict)

# %% [markdown]
# The session runs on until its `duration` (five minutes) is up, and the
# dashboard below stays live: move a slider, pick the time window (last 1, 5
# or 30 minutes), zoom with the wheel, hover a line for its value. Rates are
# drawn as a 2 s moving average; `session.frames()` keeps every raw tick.
# `session.stop()` ends it sooner, `dash.close()` closes the display.

# %%
assert session.running and dash.plots is not None
dash
