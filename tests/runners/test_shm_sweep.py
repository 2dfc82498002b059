"""Nothing left in /dev/shm: a process-runner owner killed with SIGKILL cannot unlink its meters'
segment, and the first segment another process makes removes it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from spdl_lab._runners import _shm
from spdl_lab._watch.command import kill_all

pytestmark = pytest.mark.timeout(120)

HOLDER = textwrap.dedent('''
    import sys, time
    import spdl_lab as lab

    def slow(x):
        time.sleep(0.01)
        return x

    if __name__ == "__main__":
        loader = lab.Loader(lab.Pipeline(range(10**9)).map(slow, concurrency=2), runner="process")
        for i, _ in enumerate(loader):
            if i == 5:
                print("running", flush=True)
''')


def _segments_of(pid: int) -> list[str]:
    return [name for name in os.listdir(_shm.shm_dir()) if name.startswith(f"spdl_lab_{pid}_")]


def test_a_killed_owners_segments_are_removed_by_the_next_process_that_makes_one(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    for _ in range(3):  # a process another test starts meanwhile (xdist) may sweep them first: again
        dead = _killed_holder(script)
        if _segments_of(dead):
            break
    else:
        pytest.fail("SIGKILL left nothing to sweep, three times")
    # Elsewhere, a new Loader makes its first segment (its meters): that sweeps.
    fresh = subprocess.run([sys.executable, "-c", "import spdl_lab as lab\n"
                            "with lab.Loader(lab.Pipeline(range(4)), runner='process') as loader:\n"
                            "    assert list(loader) == [0, 1, 2, 3]"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    deadline = time.monotonic() + 5
    while _segments_of(dead) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _segments_of(dead) == []


def _killed_holder(script) -> int:
    """The pid of a holder of segments, SIGKILLed with its workers once it runs."""
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "running"
        assert _segments_of(holder.pid), "the holder's Loader made no segment"
    finally:
        if holder.poll() is None:
            _kill_all_but_the_resource_tracker(holder.pid)  # the owner and its workers: no one unlinks
        holder.wait(30)
        holder.stdout.close()
    return holder.pid


def _kill_all_but_the_resource_tracker(pid: int) -> None:
    """SIGKILL the holder and its workers, as the OOM killer might; multiprocessing's resource
    tracker then unlinks the workers' named semaphores, which no sweep of the lab's may touch (a
    SIGKILL to the whole group left 14 in /dev/shm each run)."""
    root = psutil.Process(pid)
    kill_all([root, *root.children(recursive=True)])


def test_a_live_owners_segments_stay():
    name = f"{_shm.new_prefix()}probe"
    segment = _shm.ShmFile(name, 4096, create=True)
    try:
        assert name not in _shm.sweep_dead_owners()
        assert os.path.exists(segment.path)
    finally:
        segment.close()
        segment.unlink()
