"""Fork with the lab's threads running: a watched DataLoader whose workers fork every epoch
(``multiprocessing_context="fork"``, ``persistent_workers=False``) while the sampler, the probes,
the publisher, the record writer and the endpoint run, with a viewer attached. No epoch may stall:
a watchdog takes a ``py-spy dump`` of every process of the job when no step completes for 5 s,
and fails with it. Short in ``make test`` (30 epochs); ``make soak`` (``SPDL_LAB_SOAK=full``) runs
500; ``SPDL_LAB_SOAK_EPOCHS`` sets any number."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest
from test_soak import _size

import spdl_lab as lab

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(sys.platform != "linux", reason="fork with threads: Linux")]
STALL_S = 5.0

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Items(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.full((16,), float(i))

    if __name__ == "__main__":
        loader = DataLoader(Items(), batch_size=4, num_workers=2, multiprocessing_context="fork",
                            persistent_workers=False)
        for epoch in range(int(sys.argv[1])):
            for batch in loader:
                pass
        print("done", flush=True)
''')


def _latest_steps(remote) -> float:
    values = remote.recent(2.0).columns.get(("steps", "step"), np.empty(0))
    finite = values[np.isfinite(values)]
    return float(finite[-1]) if finite.size else 0.0


def _dumps(root: int) -> str:
    """``py-spy dump`` of ``root`` and every process under it."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        return "(no py-spy to dump the stacks with: it comes with the dev extra)"
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return "(the job is gone)"
    out = []
    for proc in procs:  # a DataLoader worker may end while the others are dumped
        try:
            line = " ".join(proc.cmdline()[:4])
        except psutil.Error:
            continue
        done = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60)
        out.append(f"--- pid {proc.pid} {line}\n{done.stdout}{done.stderr}")
    return "\n".join(out)


def test_a_watched_dataloader_forking_every_epoch_never_stalls(tmp_path):
    epochs = _size("SPDL_LAB_SOAK_EPOCHS", 30, 500)
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "SPDL_LAB_RUNTIME_DIR": str(tmp_path / "rt")}
    job = subprocess.Popen([sys.executable, "-m", "spdl_lab", "watch", "--name", "fork-soak", "--record",
                            str(tmp_path / "run.sqlite"), "--", sys.executable, "train.py", str(epochs)],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    os.environ["SPDL_LAB_RUNTIME_DIR"], saved = str(tmp_path / "rt"), os.environ.get("SPDL_LAB_RUNTIME_DIR")
    remote = None
    try:
        remote = lab.attach("fork-soak", timeout=60)  # the viewer
        seen, at, started = 0.0, time.monotonic(), time.monotonic()
        while job.poll() is None:
            steps = _latest_steps(remote)
            if steps > seen:
                seen, at = steps, time.monotonic()
            elif remote.running and seen < 2 * epochs and time.monotonic() - at > STALL_S:
                # (after the last step the script ends: its close is not a stall)
                pytest.fail(f"no step for {STALL_S:g} s after {seen:.0f} steps:\n{_dumps(job.pid)}")
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        out = job.stdout.read()
        assert job.returncode == 0, out[-3000:]
    finally:
        if saved is None:
            os.environ.pop("SPDL_LAB_RUNTIME_DIR", None)
        else:
            os.environ["SPDL_LAB_RUNTIME_DIR"] = saved
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        job.stdout.close()
        if remote is not None:
            remote.close()
    step = lab.open(tmp_path / "run.sqlite").stats().step
    print(f"\n{epochs} epochs, {step.steps} steps, {elapsed:.1f} s, no stall over {STALL_S:g} s")
    assert step.steps == 2 * epochs and not math.isnan(step.batches_per_s)
