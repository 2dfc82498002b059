"""A compare parks the lab's own Ray instance while it measures another runner: idle, the instance
still takes ~5% of a core (GCS, raylet, agents and idle workers poll), which those windows would
count as their noise. Parked (SIGSTOP), it takes none. If the lab dies, parked or not, a small child
of it (the warden) kills what Ray leaves: its agents outlive a killed driver, and a parked instance
would stay stopped.

The scenario runs in a fresh interpreter: it needs an instance with no other user (the tests'
shared one has one) and it ends by SIGKILL, with the instance parked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(180)

SCENARIO = textwrap.dedent('''
    import json, os, signal, subprocess, sys, time
    import numpy as np
    import psutil
    import spdl_lab as lab
    from spdl_lab._experiments import compare as contender
    from spdl_lab._runners._ray_cluster import ray_processes

    def work(i):
        a = np.ones((32, 32), np.float32)
        return float((a @ a).sum()) + i

    plain_window = contender.Contender.window
    thread_windows = []

    # A child of the lab's that is not Ray's, though its command line has Ray's process names in it.
    DECOY = subprocess.Popen([sys.executable, "-c", "import os, time  # dashboard monitor.py raylet\\n"
                              "parent = os.getppid()\\nwhile os.getppid() == parent: time.sleep(0.2)"])

    def window(self, round_, *args, **kwargs):
        decoy = psutil.Process(DECOY.pid).status()
        procs = [p for p in ray_processes() if p.pid != DECOY.pid]
        states = sorted({p.status() if p.status() == "stopped" else f"{p.status()}: {p.name()}" for p in procs})
        each_a, t_a = cpu_each(), time.monotonic()
        w = plain_window(self, round_, *args, **kwargs)
        each_b, span = cpu_each(), time.monotonic() - t_a
        used = sorted(((round(s - each_a[k], 3), k) for k, s in each_b.items() if k in each_a), reverse=True)
        row = {"runner": self.runner, "round": round_, "states": states, "processes": len(procs), "decoy": decoy,
               "pids": [p.pid for p in procs], "ray_cpu_percent": 100 * sum(s for s, _ in used) / span,
               "most_cpu_s": used[:3], "new": sorted(set(each_b) - set(each_a))}
        print("WINDOW " + json.dumps(row), flush=True)
        if self.runner == "thread" and round_ == 2:  # the ray instance parked: end now
            os.kill(os.getpid(), getattr(signal, os.environ["END_WITH"]))
        return w

    def cpu_each():
        """CPU seconds of each of the instance's processes: the decoy's are not the instance's. A
        process's CPU reads in 10 ms steps, and a window is about 0.3 s: the decoy's one step in
        ~20 s, landing in a window, read as 3-4% of a core (a unit run under load failed so)."""
        out = {}
        for p in ray_processes():
            try:
                if p.pid != DECOY.pid:
                    out[f"{p.pid} {' '.join(p.cmdline())[:50]}"] = sum(p.cpu_times()[:2])
            except psutil.Error:
                pass
        return out

    contender.Contender.window = window

    if __name__ == "__main__":
        pipeline = lab.Pipeline(range(10**7)).map(work, concurrency=2, name="work").batch(16)
        # Rounds: thread, ray | ray, thread | thread (killed at its end).
        lab.compare(pipeline, lambda batch: time.sleep(0.002), runners=("thread", "ray"), steps=300,
                    repeats=3, warmup=10, progress=False)
''')


# SIGKILL: the warden's case. SIGINT (Ctrl-C): the compare's own close resumes and shuts it down.
@pytest.mark.parametrize("end_with, exit_code", [("SIGKILL", -9), ("SIGINT", -2)])
def test_a_compare_parks_the_labs_ray_instance_in_other_runners_windows_and_an_ended_lab_leaves_none(
        tmp_path, end_with, exit_code):
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150,
                          cwd=tmp_path, env={**os.environ, "END_WITH": end_with})
    rows = [json.loads(line[len("WINDOW "):]) for line in done.stdout.splitlines() if line.startswith("WINDOW ")]
    assert done.returncode == exit_code and len(rows) == 5, done.stdout[-2000:] + done.stderr[-3000:]
    parked = [r for r in rows if r["runner"] == "thread" and r["processes"]]
    assert [r["round"] for r in parked] == [1, 2], rows  # round 0's thread window came before ray started
    for r in parked:
        assert r["states"] == ["stopped"], r
        assert r["ray_cpu_percent"] < 2.0, r  # stopped processes take no CPU: the target is under 2%
    for r in rows:
        assert r["decoy"] != "stopped", r  # only the instance's own processes are stopped
        if r["runner"] == "ray":
            assert "stopped" not in r["states"], r
    # Ended with its instance parked: every process of it ends.
    deadline, left = time.monotonic() + 5.0, ["?"]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = []
        for pid in parked[-1]["pids"]:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {proc.status()} {' '.join(proc.cmdline())[:80]}")
            except psutil.NoSuchProcess:
                continue
    assert left == [], left


WARDEN = textwrap.dedent('''
    import os, signal, subprocess, sys
    import psutil
    from spdl_lab._runners import _ray_cluster as cluster

    def child(text):
        return subprocess.Popen([sys.executable, "-c", f"import time  # {text}\\ntime.sleep(60)"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    ray_like, other = child("ray::IDLE"), child("not an instance's")
    with cluster._LOCK:
        cluster._tell_warden([psutil.Process(p.pid) for p in (ray_like, other)])
    psutil.Process(ray_like.pid).suspend()  # parked
    print("PIDS", ray_like.pid, other.pid, cluster._LOCAL["warden"].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
''')


def test_the_warden_kills_the_instance_it_was_told_of_when_the_lab_is_killed_and_nothing_else(tmp_path):
    script = tmp_path / "warden.py"
    script.write_text(WARDEN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    pids = next(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("PIDS"))
    ray_like, other, warden = (psutil.Process(int(pid)) for pid in pids)
    try:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (_alive(ray_like) or _alive(warden)):
            time.sleep(0.05)
        assert not _alive(ray_like) and not _alive(warden)
        if "ray" not in sys.executable:  # the warden checks a pid is still Ray's (a pid may be reused)
            assert _alive(other)
    finally:
        for proc in (ray_like, other, warden):
            if _alive(proc):
                proc.kill()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ray_processes_are_the_ray_packages_programs_and_workers_not_any_with_rays_names():
    """A user's child whose command line only holds Ray's names (``monitor.py``) is not Ray's: a
    compare took its CPU for the idle instance's (as the park scenario's decoy read 3-4%)."""
    from spdl_lab._runners._ray_cluster import ray_processes

    sleep = "import time; time.sleep(30)"
    log_monitor = os.path.join(os.path.dirname(pytest.importorskip("ray").__file__), "_private", "log_monitor.py")
    children = {
        "decoy": subprocess.Popen([sys.executable, "-c", f"{sleep}  # dashboard monitor.py raylet"]),
        "program": subprocess.Popen([sys.executable, "-c", sleep, log_monitor]),
        "worker": subprocess.Popen(["ray::IDLE", "-c", sleep], executable=sys.executable),
    }
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(psutil.Process(c.pid).cmdline() for c in children.values()):
            time.sleep(0.05)
        listed = {p.pid for p in ray_processes()}
        assert {name for name, c in children.items() if c.pid in listed} == {"program", "worker"}
    finally:
        for child in children.values():
            child.kill()
            child.wait(5)
