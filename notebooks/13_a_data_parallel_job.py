# %% [markdown]
# # A data-parallel job: find the straggler rank, fix it, see it balanced
#
# In data-parallel training (`torchrun --nproc_per_node=N`) each rank loads its own batches,
# and every rank waits for the slowest at each step's all-reduce. One rank that loads slowly
# therefore holds back the whole job: it waits for data itself, and every other rank waits for
# it in the collective, so their steps look long while their loaders idle.
#
# Here a real 2-rank DDP job (`lab.workloads.job_script("ddp")`: gloo on the CPU, a small conv
# net) runs under `spdl-lab watch -- torchrun`. Rank 1's loading is made slower (9 ms more per
# item, as a slower disk would). The lab sees the job as one: a row per rank, every rank's lines
# side by side, and a verdict that names the rank holding the job back. Then we raise that
# rank's concurrency, live, and see the job balanced.

# %%
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bokeh.io import output_notebook
from bokeh.resources import INLINE

import spdl_lab as lab

output_notebook(INLINE, hide_banner=True)

workdir = Path(tempfile.mkdtemp(prefix="spdl_lab_ddp_"))
torchrun = str(Path(sys.executable).with_name("torchrun"))
job_process = subprocess.Popen(
    [sys.executable, "-m", "spdl_lab", "watch", "--name", "ddp-tutorial", "--record", str(workdir / "job"),
     "--", torchrun, "--nproc_per_node=2", "--standalone", str(lab.workloads.job_script("ddp")),
     "--loader", "lab", "--workers", "2", "--slow-rank", "1", "--slow-ms", "9", "--seconds", "40"],
    cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for(condition, timeout=90.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.25)
    return value


# %% [markdown]
# `lab.attach("ddp-tutorial")` finds the job's ranks (each published with its rank and the
# job's id) and returns one `JobSession`. Its dashboard draws a line per rank: steps/s, the
# share of the loop spent waiting for data, the step time, and each loader stage's items/s.

# %%
job = lab.attach("ddp-tutorial", timeout=120)
wait_for(lambda: len(job.ranks) == 2)
dashboard = job.dashboard()
dashboard

# %% [markdown]
# The verdict compares the ranks over their last 10 seconds. Rank 1 waits for data most of its
# loop; rank 0's step is long, because it waits for rank 1 in the all-reduce; and rank 1's
# `load` stage can make far fewer items/s than rank 0's.

# %%
wait_for(lambda: job.straggler is not None)
print(job.verdict())
assert job.straggler == 1
job.summary()[["state", "steps", "batches_per_s", "step_p50_ms", "data_wait_frac"]]

# %% [markdown]
# ## The fix: more concurrency where the loading is slow
#
# The job's loader is a `lab.Loader`, whose stage concurrency changes while it runs. Raising it
# on rank 1 alone (`rank=1`) gives that rank's loads the overlap they need: a batch is 16 items
# of 9.5 ms each, so with 32 threads rank 1 loads one in about 5 ms, less than a step takes.
# The verdict then reads the new window.

# %%
job.set_concurrency("load", 32, rank=1)
fixed = wait_for(lambda: (v := job.judge()).kind == "balanced" and v)
print(fixed.text)
print("concurrency per rank:", {rank: c["load"] for rank, c in job.controls().items()})
assert job.straggler is None

# %% [markdown]
# Each rank recorded into one folder (`rank0.sqlite`, `rank1.sqlite`): `lab.open(folder)`
# reads the job back, and `spdl-lab report FOLDER` makes one page of it.

# %%
assert job_process.wait(120) == 0
wait_for(lambda: not job.running)
dashboard.close()
job.close()
recorded = lab.open(workdir / "job")
recorded.summary()[["state", "steps", "batches_per_s", "data_wait_frac"]]

# %%
recorded.close()
shutil.rmtree(workdir)  # the records: the tutorial leaves nothing behind
