"""How long a viewer takes to see that a published script was killed (SIGKILL).

Issue 17: "if the script ends or is killed, the RemoteSession's state says so within
5 s". Each trial starts a training script that publishes a ``lab.Loader``, attaches a
``RemoteSession`` here, waits for its first frames, sends SIGKILL, and times the span
from the signal to ``remote.state == "killed"``. The script is this machine's child, so
its zombie is reaped only after the measurement: the viewer must not rely on the pid
vanishing. Prints each trial, then the median and the maximum beside the viewer's poll
interval (``attach.POLL_S``: the wait is at most about one poll) and the 5 s allowed.

    python benchmarks/watch_kill_latency.py [--trials 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, print_table  # noqa: E402

SCRIPT = textwrap.dedent('''
    import time
    import spdl_lab as lab

    def slow(x):
        time.sleep(0.002)
        return x

    loader = lab.publish(lab.Loader(lab.Pipeline(range(10**9)).map(slow, concurrency=2, name="slow").batch(4)),
                         name="victim")
    print("published", flush=True)
    for batch in loader:
        time.sleep(0.01)
''')


def trial(workdir: Path, index: int) -> float:
    import spdl_lab as lab

    env = {**os.environ, "SPDL_LAB_RECORD": str(workdir / f"victim-{index}.sqlite")}
    proc = subprocess.Popen([sys.executable, str(workdir / "train.py")], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "published":
            raise RuntimeError("the script did not publish")
        remote = lab.attach(proc.pid, timeout=30)
        try:
            deadline = time.monotonic() + 30
            while len(remote.frames()) == 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("no frames from the script")
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            while remote.state != "killed":
                if time.monotonic() - t0 > 30:
                    raise RuntimeError(f"state still {remote.state!r} 30 s after SIGKILL")
                time.sleep(0.01)
            return time.monotonic() - t0
        finally:
            remote.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args(argv)
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="spdl_kill_") as tmp:
        workdir = Path(tmp)
        os.environ["SPDL_LAB_RUNTIME_DIR"] = str(workdir / "run")
        (workdir / "train.py").write_text(SCRIPT)
        spans = []
        for i in range(args.trials):
            spans.append(trial(workdir, i))
            print(f"# trial {i + 1}/{args.trials}: {spans[-1]:.3f} s", flush=True)
    from spdl_lab._watch.attach import POLL_S

    print()
    print_table(["trials", "median s", "max s", "poll interval s", "allowed s"],
                [[len(spans), f"{statistics.median(spans):.3f}", f"{max(spans):.3f}", f"{POLL_S:g}", "5"]])


if __name__ == "__main__":
    main()
