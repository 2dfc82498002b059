"""runner="ray" when its local Ray instance dies under it: a prompt RunnerError, and close() leaves nothing.

The scenario runs in a fresh interpreter: it kills the instance, so it needs one of its own,
and a second local instance started in one process after another does not keep to its
temporary directory (Ray writes that one's session under /tmp/ray).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(180)

SCENARIO = textwrap.dedent('''
    import json, os, signal, time
    import spdl_lab as lab
    from spdl_lab.errors import RunnerError
    from spdl_lab._runners._ray_cluster import _LOCAL, ray_processes

    def nap(i):
        time.sleep(0.02)
        return i

    if __name__ == "__main__":
        # 2,000 items of 20 ms on 2 workers: 20 s of work, still going when the raylet dies.
        loader = lab.Loader(lab.Pipeline(range(2000)).map(nap, concurrency=2, name="nap").batch(8), runner="ray")
        out = {}
        try:
            it = iter(loader)
            next(it)
            out["temp"] = _LOCAL["temp_dir"]  # the instance this loader started
            raylet = [p for p in ray_processes() if p.name() == "raylet"]
            os.kill(raylet[0].pid, signal.SIGKILL)
            t0 = time.monotonic()
            try:
                for _ in it:
                    pass
                out["error"] = None
            except RunnerError as exc:
                out["error"] = str(exc)
            out["error_after_s"] = time.monotonic() - t0
        finally:
            t0 = time.monotonic()
            loader.close()
            out["close_s"] = time.monotonic() - t0
        deadline = time.monotonic() + 5
        while ray_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        out["left"] = [" ".join(p.cmdline())[:80] for p in ray_processes()]
        # Processes the raylet started are orphaned when it dies: look for the instance's
        # temporary directory on any command line, not only among this process's descendants.
        import psutil
        for proc in psutil.process_iter():
            try:
                line = " ".join(proc.cmdline())
            except psutil.Error:
                continue
            if out["temp"] in line and proc.pid != os.getpid():
                out["left"].append(f"orphan {proc.pid}: {line[:80]}")
        out["tmp_ray"] = sorted(n for n in os.listdir("/tmp/ray") if str(os.getpid()) in n) if os.path.isdir("/tmp/ray") else []
        out["temp_left"] = os.path.exists(out["temp"])
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)  # Ray's client threads stay blocked on the dead node: do not wait for them
''')


def kill_the_raylet_mid_run(tmp_path) -> dict:
    """Run the scenario in a fresh interpreter; what it saw (its timings among them)."""
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150,
                          cwd=tmp_path, env=dict(os.environ))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["error"] and "raylet" in out["error"] and "exited" in out["error"], out
    assert out["left"] == [], out
    assert not out["temp_left"], out
    assert out["tmp_ray"] == [], out  # no session of ours under Ray's default /tmp/ray either
    return out


# One run checks both (the scenario starts its own instance: ~25 s): a RunnerError naming the
# raylet, nothing left behind, and how soon.
@pytest.mark.measurement
def test_the_raylet_killed_mid_run_is_a_runner_error_reported_and_closed_promptly_leaving_nothing(tmp_path):
    out = kill_the_raylet_mid_run(tmp_path)
    assert out["error_after_s"] < 10, out
    assert out["close_s"] < 10, out
