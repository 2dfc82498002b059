"""runner="ray" joining a cluster that is already running (issue 30, item 5): `ray start --head` on
127.0.0.1 in Ray's single-machine mode, token authentication on (Ray 2.60's default), then a
Loader with ``address="auto"`` and with the explicit GCS address. Closing leaves the cluster
running, with none of the lab's actors in it (Ray Data's own stay, as they would for any of
its users). Everything stays on loopback; the cluster is this
test's own (its own RAY_TMPDIR), and only its processes are stopped."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from ray_own_dir import mentions, own_ray_dir

pytest.importorskip("ray")

pytestmark = [pytest.mark.timeout(300)]

DRIVER = textwrap.dedent('''
    import sys
    import numpy as np
    import ray
    import spdl_lab as lab

    def decode(i):
        return np.full((2, 2), i, dtype=np.float32)

    if __name__ == "__main__":
        p = lab.Pipeline(range(48)).map(decode, concurrency=2, name="decode").batch(8)
        with lab.Loader(p, runner="ray", address=sys.argv[1]) as loader:
            firsts = [int(batch[0][0, 0]) for batch in loader]
        print("batches", firsts, "connected", ray.is_initialized())
''')

ACTORS = textwrap.dedent('''
    import sys
    import ray
    from ray._private import state

    ray.init(address=sys.argv[1], log_to_driver=False)
    # The lab's own: its meter board and a stage's actors (Ray Data keeps actors of its own).
    alive = [a for a in state.actors().values() if a["State"] == "ALIVE"
             and any(n in a["ActorClassName"] for n in ("MeterBoard", "_ActorStages"))]
    drivers = [j["DriverIPAddress"] for j in state.jobs() if j["IsDead"]]
    print("alive actors", len(alive), "ended drivers at", sorted(set(drivers)), len(drivers))
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A one-node cluster of this test's own: (GCS address, environment to reach it)."""
    with own_ray_dir("rayj") as tmp:
        env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        port = _free_port()
        ray_bin = str(Path(sys.executable).with_name("ray"))
        subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                        "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"],
                       env=env, check=True, timeout=180, capture_output=True)
        yield f"127.0.0.1:{port}", env


def _run(code: str, arg: str, env: dict[str, str], tmp_path: Path) -> str:
    script = tmp_path / "driver.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script), arg], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("how", ["auto", "explicit"])
def test_a_loader_joins_a_running_cluster_and_leaves_it_running(cluster, how, tmp_path):
    address, env = cluster
    out = _run(DRIVER, "auto" if how == "auto" else address, env, tmp_path)
    assert f"batches {list(range(0, 48, 8))}" in out, out
    assert "connected False" in out, out  # close() disconnected the driver
    assert "Token authentication" not in out and "InvalidAuthToken" not in out, out
    gcs = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "gcs_server"
           and mentions(p, env["RAY_TMPDIR"])]
    assert gcs, "closing the Loader stopped the cluster"
    state = _run(ACTORS, address, {**env, "RAY_AUTH_MODE": "token"}, tmp_path)  # an explicit address wants it
    # None of the lab's actors is left, and its driver was in this cluster, on loopback.
    assert "alive actors 0 ended drivers at ['127.0.0.1']" in state, state


def test_a_wrong_address_names_it_and_what_to_check(tmp_path):
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path)}
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    done = subprocess.run([sys.executable, str(script), f"127.0.0.1:{_free_port()}"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=200)
    assert done.returncode != 0
    assert "could not join the Ray cluster at '127.0.0.1:" in done.stderr, done.stderr
    assert "nothing answers there" in done.stderr and "Check the address" in done.stderr, done.stderr


FAILING = textwrap.dedent('''
    import threading

    import spdl_lab as lab

    def parse(i):
        if i == 13:
            raise ValueError("corrupt record")
        return i

    def load(failed):
        try:
            with lab.Loader(lab.Pipeline(range(40)).map(parse, name="parse").batch(4), runner="ray") as loader:
                list(loader)
        except Exception as exc:
            failed.append(exc)

    if __name__ == "__main__":
        # Off the main thread, where a notebook's lab.run starts Ray.
        failed = []
        thread = threading.Thread(target=load, args=(failed,))
        thread.start()
        thread.join(150)
        raise failed[0]
''')


def test_a_stage_failure_is_told_once_by_the_lab_not_by_ray_too(tmp_path):
    """The instance the lab starts keeps Ray's own banners and error logs out of the terminal: the
    lab's PipelineError (stage, item, the user's traceback) is the one report."""
    script = tmp_path / "fails.py"
    script.write_text(FAILING)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=200, env={**os.environ, "RAY_TMPDIR": str(tmp_path)})
    assert done.returncode == 1
    err = done.stderr
    assert "PipelineError" in err and "parse" in err and "corrupt record" in err, err
    for ray_own in ("Token authentication", "streaming_executor", "Full stack trace",
                    "An exception was raised from a task", "SIGTERM handler"):
        assert ray_own not in err, f"Ray printed {ray_own!r}:\n{err}"
    assert err.count("corrupt record") <= 2, err  # the user's exception and the lab's line, once each
