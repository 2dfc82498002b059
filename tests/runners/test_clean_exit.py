"""Every child of ours exits cleanly, even with a daemon thread inside torch when it ends: no
"terminate called without an active exception" (a thread asking for the GIL back while the
interpreter finalizes is ended by pthread_exit, whose unwinding through torch's C++ aborts)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.timeout(300)]

#: A stage that leaves a daemon thread in torch code, as a stage with a background prefetcher does;
#: its inputs are tensors, dropped by whichever thread lets go of them last.
STAGE = '''
import threading
import torch

_churning = []


def churn():
    while True:
        torch.stack([torch.zeros(3, 32, 32)] * 16)


def stage(x):
    if not _churning:
        _churning.append(threading.Thread(target=churn, daemon=True, name="churn"))
        _churning[0].start()
    return torch.as_tensor(x).float().sum().item()
'''

SCENARIOS = {
    # DataLoader worker processes (spawn) and the subprocess-threads child.
    "process": '''
        p = lab.Pipeline(range(10**6)).map(stage, concurrency=2, name="stage").batch(4)
        with lab.Loader(p, runner="process", num_workers=2) as loader:
            it = iter(loader)
            for _ in range(8):
                next(it)
    ''',
    "subprocess-threads": '''
        p = lab.Pipeline(range(10**6)).map(stage, concurrency=2, name="stage").batch(4)
        with lab.Loader(p, runner="subprocess-threads") as loader:
            it = iter(loader)
            for _ in range(8):
                next(it)
    ''',
    # lab.diagnose's worker processes, fed tensors.
    "diagnose-workers": '''
        import torch
        from spdl_lab._diagnose._sweep_worker import StageFeed, WorkerPool
        feed = StageFeed("stage", stage, [torch.zeros(3, 32, 32) for _ in range(8)])
        pool = WorkerPool(feed, 2, lab.SweepSettings())
        pool.send(2, ("run",))
        pool.read(2, 30)
        pool.send(1, ("pause",), first=1)
        pool.read(1, 30)
        pool.close(kill=False)
    ''',
    # lab.diagnose's clean child interpreter, its stage run in threads there.
    "diagnose-isolated": '''
        quick = lab.SweepSettings(warmup_s=0.1, window_s=0.1, min_windows=2, max_windows=2, stage_budget_s=2)
        p = lab.Pipeline(range(100)).map(stage, name="stage").batch(4)
        lab.diagnose(p, concurrency=(1, 2), num_items=16, processes=False, settings=quick, progress=False)
    ''',
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_children_with_a_daemon_thread_in_torch_exit_without_a_native_crash(scenario, tmp_path):
    (tmp_path / "churn_stage.py").write_text(STAGE)
    script = tmp_path / "main.py"
    script.write_text("import spdl_lab as lab\nfrom churn_stage import stage\n\nif __name__ == '__main__':\n"
                      + textwrap.indent(textwrap.dedent(SCENARIOS[scenario]).strip(), "    ")
                      + "\n    print('done', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *(p for p in sys.path if p)])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]
    assert "terminate called" not in out.stderr, out.stderr[-3000:]
