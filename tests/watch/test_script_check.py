"""``spdl-lab tune --script``: DataLoader advice applied where an unchanged script builds its
DataLoader ($SPDL_LAB_DATALOADER_KWARGS), checked in the job, and what bad input says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import psutil
import pytest
from test_cli_interrupt import semaphore_unlinked

from spdl_lab._watch.command import _group, _run_until, check_script, kill_all
from spdl_lab.cli import main
from spdl_lab.errors import SpdlLabError

SCRIPT = '''
    import sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self): return 128
        def __getitem__(self, i):
            t = time.perf_counter()
            while time.perf_counter() - t < 0.004: pass
            return torch.full((8,), float(i))

    if __name__ == "__main__":
        dl = DataLoader(Slow(), batch_size=4, num_workers=0)
        print("num_workers", dl.num_workers, "prefetch_factor", dl.prefetch_factor, flush=True)
        for epoch in range(100):
            for batch in dl:
                time.sleep(0.005)
'''

NO_DATALOADER = '''
    print("no DataLoader here")
'''


def _script(tmp_path, code: str):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(code))
    return path


def test_the_hook_gives_the_advice_to_the_scripts_dataloader(tmp_path):
    script = _script(tmp_path, SCRIPT.replace("for epoch in range(100)", "for epoch in range(0)"))
    env_cmd = [sys.executable, "-m", "spdl_lab", "watch", "--", sys.executable, str(script)]
    done = subprocess.run(env_cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**_env(tmp_path), "SPDL_LAB_DATALOADER_KWARGS": '{"num_workers": 2, "prefetch_factor": 3}'})
    assert done.returncode == 0, done.stderr
    assert "num_workers 2 prefetch_factor 3" in done.stdout


@pytest.mark.parametrize("kwargs, says", [
    ('{"prefetch_factor": 4}', "the DataLoader rejects $SPDL_LAB_DATALOADER_KWARGS"),
    ('{"no_such_option": 1}', "names no_such_option, which DataLoader does not take"),
    ('[4]', "must be a JSON object of DataLoader keyword arguments"),
])
def test_advice_the_dataloader_rejects_says_so(tmp_path, kwargs, says):
    script = _script(tmp_path, SCRIPT)
    done = subprocess.run([sys.executable, "-m", "spdl_lab", "watch", "--", sys.executable, str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**_env(tmp_path), "SPDL_LAB_DATALOADER_KWARGS": kwargs})
    assert done.returncode != 0 and says in done.stderr


@pytest.mark.timeout(120)
def test_tune_script_stops_at_advice_the_dataloader_rejects(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    script = _script(tmp_path, SCRIPT)
    code = main(["tune", "--set", "prefetch_factor=4", "--steps", "5", "--warmup", "1", "--script", str(script)])
    err = capsys.readouterr().err
    assert code != 0 and "the DataLoader rejects $SPDL_LAB_DATALOADER_KWARGS" in err


@pytest.mark.timeout(120)
def test_tune_script_on_a_script_without_a_dataloader_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    script = _script(tmp_path, NO_DATALOADER)
    code = main(["tune", "--set", "num_workers=2", "--steps", "5", "--script", str(script)])
    err = capsys.readouterr().err
    assert code != 0 and "never iterated a torch DataLoader" in err


def test_tune_needs_a_target_or_a_script_and_advice(tmp_path, capsys):
    assert main(["tune"]) == 2
    assert "or --script train.py" in capsys.readouterr().err
    assert main(["tune", "--script", str(_script(tmp_path, SCRIPT))]) == 2
    assert "give the advice to check" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--set", "num_workers", "--script", "x.py"])
    assert exit_.value.code == 2 and "expected KEY=VALUE" in capsys.readouterr().err


LEAVES_A_WORKER = textwrap.dedent('''
    import multiprocessing, subprocess, sys, time
    lock = multiprocessing.get_context("spawn").Lock()  # named: the script's resource tracker holds it
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(lock._semlock.name, worker.pid, flush=True)
    time.sleep(60)
''')


@pytest.mark.timeout(60)
def test_a_stopped_scripts_group_is_killed_but_its_resource_tracker_unlinks_what_it_held():
    """tune --script ends each run by killing what the script left in its process group. A SIGKILL
    to the whole group (its first version) took the resource tracker too, and the script's named
    semaphores stayed in /dev/shm."""
    script = subprocess.Popen([sys.executable, "-c", LEAVES_A_WORKER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        name, worker = script.stdout.readline().split()
        group = _group(script.pid)
        assert {script.pid, int(worker)} <= {p.pid for p in group}
        assert all(os.getpgid(p.pid) == script.pid for p in group)
        kill_all(group)  # it reaps the script too: Popen sees no status of its own
        assert script.poll() is not None
        assert not psutil.pid_exists(int(worker)) or psutil.Process(int(worker)).status() == psutil.STATUS_ZOMBIE
        assert semaphore_unlinked(name), f"{name} left in /dev/shm 5 s after the group was killed"
    finally:
        script.kill()
        script.wait(5)
        script.stdout.close()


EXITS_LEAVING_A_WORKER = textwrap.dedent('''
    import subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # holds our stderr
    print("the script's last words", file=sys.stderr)
''')


@pytest.mark.timeout(60)
def test_a_run_that_ends_is_read_at_once_not_when_the_workers_it_left_let_go_of_its_stderr(tmp_path):
    """Its first version read the script's stderr before it killed what the script left: a worker
    holding the pipe (a DataLoader worker, until it sees its parent gone) kept the run waiting, and
    one that outlives ``STOP_GRACE_S`` made it fail."""
    script = _script(tmp_path, EXITS_LEAVING_A_WORKER)
    with pytest.raises(SpdlLabError, match="never iterated.*the script's last words"):
        _run_until([sys.executable, str(script)], tmp_path / "run.sqlite", None, steps=10, timeout_s=30)


@pytest.mark.timeout(120)
def test_tune_script_counts_the_training_loop_not_a_validation_loop_run_before_it(tmp_path, monkeypatch):
    """Lightning's sanity check iterates the validation DataLoader first: its run takes the
    record's name, the training loop's comes next beside it; the steps counted are training's."""
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    validation_first = SCRIPT.replace("        for epoch in range(100):", textwrap.indent(textwrap.dedent("""
        for batch in DataLoader(Slow(), batch_size=4):  # the sanity check: 2 batches
            if batch[0, 0] >= 4: break
        for epoch in range(100):"""), "        "))
    script = _script(tmp_path, validation_first)
    report = check_script([sys.executable, str(script)], {"num_workers": 2}, tmp_path / "runs", steps=12,
                          warmup=2, rounds=1)
    rows = [line.split() for line in report.splitlines() if re.match(r"\s+\d+\s+(start|advice)\s", line)]
    assert [(r[1], r[2]) for r in rows] == [("start", "12"), ("advice", "12")]
    assert sorted(p.name for p in (tmp_path / "runs").glob("run01-*")) == [
        "run01-start-tune-script-run01-start-2.sqlite", "run01-start.sqlite"]


@pytest.mark.timeout(120)
def test_tune_script_counts_every_epoch_of_a_dataloader_built_each_epoch(tmp_path, monkeypatch):
    """An epoch of 8 steps, its DataLoader built anew each time: 20 steps are the job's, across
    three DataLoaders, in one record per run (it measured one epoch's, and stopped there)."""
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    each_epoch = SCRIPT.replace("        dl = DataLoader(Slow(), batch_size=4, num_workers=0)\n", "").replace(
        "        for epoch in range(100):\n",
        "        for epoch in range(100):\n            dl = DataLoader(Slow(), batch_size=4, num_workers=0, "
        "sampler=range(32))\n").replace('        print("num_workers", dl.num_workers, "prefetch_factor", '
                                         'dl.prefetch_factor, flush=True)\n', "")
    assert each_epoch.count("DataLoader(") == 1 and "sampler=range(32)" in each_epoch
    report = check_script([sys.executable, str(_script(tmp_path, each_epoch))], {"num_workers": 1},
                          tmp_path / "runs", steps=20, warmup=2, rounds=1)
    rows = [line.split() for line in report.splitlines() if re.match(r"\s+\d+\s+(start|advice)\s", line)]
    assert [(r[1], r[2]) for r in rows] == [("start", "20"), ("advice", "20")]
    assert sorted(p.name for p in (tmp_path / "runs").glob("run01-*")) == ["run01-start.sqlite"]


@pytest.mark.measurement
@pytest.mark.timeout(300)
def test_tune_script_reports_the_jobs_own_steps_per_second_both_ways(tmp_path, capsys, monkeypatch):
    # A Dataset of 4 ms per item, batches of 4: 16 ms of loading per 5 ms step in the loop's
    # thread; two workers load while the loop steps.
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    script = _script(tmp_path, SCRIPT)
    assert main(["tune", "--set", "num_workers=2", "--steps", "40", "--warmup", "5", "--script", str(script)]) == 0
    out = capsys.readouterr().out
    runs = [line.split()[1] for line in out.splitlines() if re.match(r"\s+\d+\s+(start|advice)\s", line)]
    assert runs == ["start", "advice", "advice", "start"]  # alternating, twice each
    assert "start:" in out and "advice:" in out and "the advice holds in the job" in out


def _env(tmp_path) -> dict[str, str]:
    import os

    return {**os.environ, "SPDL_LAB_RUNTIME_DIR": str(tmp_path / "rt"), "SPDL_LAB_RECORD": str(tmp_path / "r.sqlite")}
