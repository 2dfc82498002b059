"""``spdl-lab watch`` on a script that never imports spdl_lab: its DataLoader's workers are
metered from the first epoch (the hook makes the iterator), the record holds their stages and
queue, the script's own worker_init_fn runs, and no shared memory is left."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from spdl_lab._integrations.torch_dataloader import QUEUE
from spdl_lab._watch.records import read_record, record_meta

SCRIPT = '''
    import os, sys
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Numbers(Dataset):
        def __len__(self): return 24
        def __getitem__(self, i): return torch.tensor([i])

    def started(worker_id):
        print(f"worker {worker_id} started", flush=True)

    if __name__ == "__main__":
        print(f"pid {os.getpid()}", flush=True)
        dl = DataLoader(Numbers(), batch_size=4, num_workers=2, persistent_workers=True,
                        multiprocessing_context="spawn", worker_init_fn=started)
        seen = [int(x) for _ in range(3) for batch in dl for x in batch]
        assert seen == list(range(24)) * 3 and dl.worker_init_fn is started and len(dl) == 6
        assert "spdl_lab" in sys.modules
        print("trained", flush=True)
'''


@pytest.mark.timeout(180)
def test_a_watched_scripts_dataloader_is_metered_from_its_first_epoch(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "SPDL_LAB_RUNTIME_DIR": str(tmp_path / "rt")}
    before = set(os.listdir("/dev/shm"))  # a segment some other process left may share the pid
    done = subprocess.run([sys.executable, "-m", "spdl_lab", "watch", "--record", str(tmp_path / "run.sqlite"),
                           "--", sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "trained" and sorted(line for line in lines if "started" in line) == [
        "worker 0 started", "worker 1 started"]  # persistent: once each, the user's own function
    pid = next(line.split()[1] for line in lines if line.startswith("pid "))
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith(f"spdl_lab_{pid}_")]
    assert record_meta(tmp_path / "run.sqlite")["state"] == "finished"
    frames = read_record(tmp_path / "run.sqlite")

    def top(series: str, stage: str) -> float:
        return frames[(frames.series == series) & (frames.stage == stage)].value.max()

    assert top("tasks", "fetch") == 3 * 24 and top("tasks", "collate") == 3 * 6
    assert top("queue_capacity", QUEUE) == 2 * 2
