# %% [markdown]
# # Watch and steer a training script from the notebook
#
# Real training runs as a script (`python train.py`, `torchrun ...`), not in a
# notebook kernel. `spdl-lab watch -- python train.py` runs the script unchanged
# and publishes every torch DataLoader, `lab.Loader`, SPDL pipeline and `lab.run`
# session it iterates (the script need not import spdl_lab): a record file,
# written as it goes, and a local endpoint (a Unix socket in a folder only you
# can read). Here we start a small script in the background, attach to it,
# watch its dashboard, move a slider in it, and read its record once it ends.

# %%
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bokeh.io import output_notebook
from bokeh.resources import INLINE

import spdl_lab as lab

output_notebook(INLINE, hide_banner=True)

SCRIPT = '''
import time
import numpy as np
import spdl_lab as lab

def decode(i):
    return np.sort(np.random.default_rng(i).standard_normal(20_000))

def main():
    pipeline = lab.Pipeline(range(6_000)).map(decode, concurrency=1, name="decode").batch(16)
    for batch in lab.Loader(pipeline, runner="thread"):   # no lab.publish: spdl-lab watch does it
        time.sleep(0.02)                                    # the training step
    print("trained")

if __name__ == "__main__":
    main()
'''

workdir = Path(tempfile.mkdtemp(prefix="spdl_lab_watch_"))
(workdir / "train.py").write_text(SCRIPT)
record = workdir / "tutorial.sqlite"
job = subprocess.Popen([sys.executable, "-m", "spdl_lab", "watch", "--name", "tutorial",
                        "--record", str(record), "--", sys.executable, "train.py"], cwd=workdir)

def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


# %% [markdown]
# `lab.attach()` lists the published runs on this host; `lab.attach(name)` (or a pid)
# returns a `RemoteSession` with the read API of a local Session. Its dashboard is the
# same one `lab.run` gives.

# %%
remote = lab.attach("tutorial", timeout=60)
wait_for(lambda: "qps" in set(remote.frames()["series"]))
lab.attach()[["name", "pid", "state", "steps", "runner"]]  # steps: those its record has so far

# %%
dashboard = remote.dashboard()
dashboard

# %% [markdown]
# Moving a slider sends `set_concurrency` to the script, which applies it live
# (the thread and subprocess-threads runners can). Here the code moves it, as a
# user would.

# %%
moved_at = remote.elapsed_s
dashboard.sliders["decode"].value = 2
wait_for(lambda: remote.controls()["decode"] == 2)
print(f"decode concurrency is now {remote.controls()['decode']} in pid {remote.pid}, {moved_at:.1f} s into the run")

# %% [markdown]
# When the script ends, the RemoteSession says so, and the record stays: `lab.open`
# reads it as a read-only RemoteSession (pandas could read it too: it is SQLite).

# %%
assert job.wait(180) == 0
wait_for(lambda: remote.state != "running")
remote.close()
dashboard.close()
run = lab.open(record)
frames = run.frames()
qps = frames[(frames["series"] == "qps") & (frames["stage"] == "decode")]
before = qps[qps["time_s"] < moved_at]["value"].median()
after = qps[qps["time_s"] > moved_at + 1.0]["value"].median()
print(f"the script ended: {run.state}; the record holds {len(frames):,} values over {frames['time_s'].max():.1f} s")
print(f"decode: {before:,.0f} items/s at concurrency 1, {after:,.0f} at 2 ({after / before:.2f}x)")

# %% [markdown]
# The same works for the loader most scripts have: a plain torch DataLoader, in a
# script that never imports spdl_lab. Each `next()` on it is timed as data wait,
# the time the loop holds a batch as the step, and its worker processes' CPU is read.
# A DataLoader cannot change its workers while it runs, so its run has no sliders:
# `set_concurrency` says why and what to do instead.

# %%
DATALOADER_SCRIPT = '''
import time
import torch
from torch.utils.data import DataLoader, Dataset

class Decode(Dataset):
    def __len__(self):
        return 256
    def __getitem__(self, i):
        return torch.sort(torch.randn(20_000, generator=torch.Generator().manual_seed(i))).values

if __name__ == "__main__":
    loader = DataLoader(Decode(), batch_size=16, num_workers=2)
    for epoch in range(2):
        for batch in loader:
            time.sleep(0.02)   # the training step
'''
(workdir / "train_dl.py").write_text(DATALOADER_SCRIPT)
dl_record = workdir / "dataloader.sqlite"
done = subprocess.run([sys.executable, "-m", "spdl_lab", "watch", "--name", "dataloader", "--record",
                       str(dl_record), "--", sys.executable, "train_dl.py"], cwd=workdir, timeout=180)
assert done.returncode == 0
dl_run = lab.open(dl_record)
step = dl_run.stats().step  # per step, from every step the record holds
f = dl_run.frames()
workers_cpu = f[(f["series"] == "cpu_percent") & (f["stage"] == "workers")]["value"].median()
print(f"{dl_run.runner} run, {dl_run.state}: {step.steps} steps, {step.batches_per_s:.1f} steps/s, "
      f"data wait {step.data_wait_frac:.0%} of the loop, workers at {workers_cpu:.0f}% CPU (median tick)")
dl_run.summary()

# %%
import shutil

run.close()
dl_run.close()
shutil.rmtree(workdir)  # the scripts and their records: this tutorial leaves nothing behind
