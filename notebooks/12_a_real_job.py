# %% [markdown]
# # A real job, end to end: watch it, read it, tune it, check the advice in it
#
# Your training runs as a script that knows nothing of spdl_lab. Here it is a real one
# (`lab.workloads.job_script("images")`): JPEGs decoded with PIL, random crop and flip,
# a torch DataLoader with 2 workers, a small conv net, under PyTorch Lightning. The
# script counts its own figures per step and writes them to a file, so every number
# the lab shows below is held against what the job itself counted.
#
# 1. `spdl-lab watch` runs it unchanged; the notebook attaches and shows its dashboard,
#    with the DataLoader's inside (its `fetch` and `collate` stages, its queue).
# 2. After the run, its record reads the same figures, step by step, and makes a report.
# 3. `lab.tune` searches the DataLoader's knobs, epoch after epoch as the job runs it.
# 4. `spdl-lab tune --script` checks that advice in the job itself (a plain loop this
#    time), alternating with the job's own settings.

# %%
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bokeh.io import output_notebook
from bokeh.resources import INLINE

import spdl_lab as lab

output_notebook(INLINE, hide_banner=True)

SCRIPT = lab.workloads.job_script("images")
workdir = Path(tempfile.mkdtemp(prefix="spdl_lab_job_"))
images = workdir / "jpegs"
record, timing = workdir / "lightning.sqlite", workdir / "timing.json"
STEPS = 60

job = subprocess.Popen(
    [sys.executable, "-m", "spdl_lab", "watch", "--name", "lightning-job", "--record", str(record), "--",
     sys.executable, str(SCRIPT), "--images", str(images), "--n", "320", "--steps", str(STEPS),
     "--trainer", "lightning", "--workers", "2", "--timing", str(timing)],
    cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for(condition, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


# %% [markdown]
# The job publishes its DataLoader the first time it iterates it. The dashboard is the one a
# `lab.run` session has: the training step's timings, and here the DataLoader's own stages,
# measured inside its worker processes (shared memory, no message per item).

# %%
remote = lab.attach("lightning-job", timeout=120)
wait_for(lambda: "fetch" in set(remote.frames().query("series == 'qps'")["stage"]))
dashboard = remote.dashboard()
dashboard

# %% [markdown]
# When the job ends, the live view and the record say the same. The figures are per step:
# steps/s is the steps over their wall time, the p50s are over steps, not over the
# dashboard's ticks. Held against the job's own count:

# %%
assert job.wait(300) == 0
wait_for(lambda: remote.state != "running")
dashboard.close()
live = remote.summary()
remote.close()

own = json.loads(timing.read_text())
run = lab.open(record)
step = run.stats().step
# The record is SQLite: its steps table has each step's end on the machine's monotonic clock,
# which the job's own timing uses too, so the lab's steps/s can be taken over the job's window.
with sqlite3.connect(record) as db:
    origin = float(db.execute("SELECT value FROM meta WHERE key = 'steps_origin_s'").fetchone()[0])
    ends = [origin + e / 1e9 for (e,) in db.execute("SELECT end_ns FROM steps ORDER BY idx")]
in_window = sum(own["started"] < t <= own["ended"] + 1e-3 for t in ends) / own["wall_s"]
print(f"steps:          job {own['steps']}, lab {step.steps}")
print(f"steps/s:        job {own['steps_per_s']:.2f}, lab {in_window:.2f} over the job's wall time")
print(f"step p50:       job {own['step_p50_ms']:.1f} ms, lab {step.step_p50_ms:.1f} ms")
print(f"data wait p50:  job {own['data_wait_p50_ms']:.1f} ms, lab {step.data_wait_p50_ms:.1f} ms")
assert step.steps == own["steps"] == STEPS  # every step of the loop is in the record
assert live.loc["step"].equals(run.summary().loc["step"])  # the live view at its end = the record
run.summary()

# %% [markdown]
# The record makes a self-contained report page (also `spdl-lab report lightning.sqlite`):

# %%
page = run.to_html(workdir / "lightning.html")
print(f"report: {page.name}, {page.stat().st_size / 1e6:.1f} MB, opens with no network")

# %% [markdown]
# ## Tune the DataLoader, epoch after epoch
#
# `lab.tune` takes the job's DataLoader as it is. It runs epochs of it as the job does
# (a 10-batch epoch here), tries its knobs (`num_workers`, `prefetch_factor`,
# `persistent_workers`) and the lab's runners, and keeps a move only beyond the noise, on
# a machine whose other processes leave the cores alone; otherwise it says "keep what you
# have" and why.

# %%
sys.path.insert(0, str(SCRIPT.parent))
import torch  # noqa: E402
import train_images  # noqa: E402  (the job's own module: its Dataset and model)

dataset = train_images.Jpegs(train_images.make_images(images, 320))
dataloader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2, drop_last=True)
model = train_images.conv_net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(batch):
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


tuning = lab.tune(dataloader, step=train_step, runners=["process"], budget_s=15, progress=False)
print(tuning.advice)
for warning in tuning.warnings:
    print("warning:", warning)
advice = {k: v for k, v in tuning.best["options"].items() if k in ("num_workers", "prefetch_factor")}
if not tuning.moved:  # nothing to check beyond the noise: check one more worker instead
    advice = {"num_workers": dataloader.num_workers + 1}
advice

# %% [markdown]
# ## Check the advice in the job itself
#
# What the tuner measured is the lab's model of the job. `spdl-lab tune --script` runs the
# unchanged script (a plain loop this time), alternately with its own DataLoader arguments
# and with the advice, which the watch hook gives the DataLoader where the script builds it
# (`$SPDL_LAB_DATALOADER_KWARGS`). It reports the job's own steps/s both ways.

# %%
settings = [arg for k, v in advice.items() for arg in ("--set", f"{k}={json.dumps(v)}")]
check = subprocess.run(
    [sys.executable, "-m", "spdl_lab", "tune", *settings, "--steps", "12", "--warmup", "2", "--script",
     str(SCRIPT), "--images", str(images), "--n", "320", "--steps", "200", "--trainer", "plain",
     "--workers", "2"], capture_output=True, text=True, timeout=600)
assert check.returncode == 0, check.stderr[-2000:]
print(check.stdout.split("\n\n", 1)[1])

# %%
run.close()
shutil.rmtree(workdir)  # the images, the records, the report: the tutorial leaves nothing behind
