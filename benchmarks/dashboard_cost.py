"""What the live dashboard costs the training loop it watches.

The same training loop on ``lab.workloads.noisy_neighbour()`` runs in a real
IPython kernel (started with jupyter_client), once with the dashboard's
publisher running and once without, alternating, ``--repeats`` times per
runner. The dashboard's widgets and Bokeh document live in that kernel and
every update goes out as comm messages on IOPub; this process drains IOPub
like a front end would (no browser renders anything). Printed per runner:

* step p50 (ms) with and without, and the inflation (target <= 3%);
* the publisher thread's CPU as a share of one core at ``--hz`` (target <= 5%),
  in steady state (after the warm-up steps) and over the whole run, which
  includes drawing the plots once;
* IOPub traffic while the dashboard ran (messages/s, KB/s).

    python benchmarks/dashboard_cost.py [--runners thread subprocess-threads]
        [--steps 150] [--warmup 20] [--repeats 3] [--hz 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from queue import Empty

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, print_table  # noqa: E402

KERNEL_SETUP = r'''
import json, statistics, time
import spdl_lab as lab
from bokeh.io import output_notebook
from bokeh.resources import INLINE
output_notebook(INLINE, hide_banner=True)

def _measure(runner, dashboard, steps, warmup, hz):
    pipeline, step = lab.workloads.noisy_neighbour()
    session = lab.run(pipeline, step, runner=runner, steps=warmup + steps)
    dash = session.dashboard(hz=hz) if dashboard else None
    if dash is not None:
        display(dash)
    deadline = time.monotonic() + 600
    while session.clock.steps < warmup and session.running and time.monotonic() < deadline:
        time.sleep(0.05)
    cpu0 = dash.publisher_cpu_s if dash else 0.0
    t0 = time.perf_counter()
    assert session.wait(timeout=600), "the session did not finish"
    span = time.perf_counter() - t0
    records = session.clock.records()[warmup:]
    out = {
        "step_p50_ms": statistics.median(r.step_s for r in records) * 1e3,
        "steps": len(records),
    }
    if dash is not None:
        out["steady_cpu_frac"] = (dash.publisher_cpu_s - cpu0) / span
        out["total_cpu_frac"] = dash.publisher_cpu_s / session.elapsed_s
        out["publishes"] = dash.publishes
        dash.close()
    return json.dumps(out)
'''


class Kernel:
    """An ipykernel with an IOPub drain thread that counts messages and bytes."""

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3")
        self.messages = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._results: dict[str, str] = {}
        self._lock = threading.Lock()
        self._drain = threading.Thread(target=self._run, daemon=True)
        self._drain.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.client.iopub_channel.get_msg(timeout=0.2)
            except Empty:
                continue
            size = len(json.dumps(msg["content"], default=str)) + sum(
                len(b) for b in msg.get("buffers", []))
            with self._lock:
                self.messages += 1
                self.bytes += size
            parent = msg.get("parent_header", {}).get("msg_id")
            if msg["msg_type"] == "execute_result":
                self._results[parent] = msg["content"]["data"]["text/plain"]
            elif msg["msg_type"] == "error":
                self._results[parent] = "ERROR: " + "\n".join(msg["content"]["traceback"])

    def run(self, code: str, *, result: bool = False, timeout: float = 900) -> str | None:
        """Execute ``code``; with ``result``, return the repr of its last expression."""
        msg_id = self.client.execute(code)
        reply = self.client.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.client.get_shell_msg(timeout=timeout)
        deadline = time.monotonic() + 10  # IOPub may trail the shell reply
        while result and msg_id not in self._results and time.monotonic() < deadline:
            time.sleep(0.05)
        text = self._results.get(msg_id)
        if reply["content"]["status"] != "ok" or (text or "").startswith("ERROR"):
            raise RuntimeError(f"kernel error:\n{text or reply['content']}")
        return text

    def counters(self) -> tuple[int, int]:
        with self._lock:
            return self.messages, self.bytes

    def close(self) -> None:
        self._stop.set()
        self._drain.join(2)
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runners", nargs="+", default=["thread", "subprocess-threads"])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hz", type=float, default=4.0)
    args = ap.parse_args(argv)

    print(machine_line())
    print(f"# noisy_neighbour(); {args.steps} measured steps after {args.warmup} warm-up; "
          f"dashboard at {args.hz:g} Hz; on/off alternate, {args.repeats} repeats; in one ipykernel")
    kernel = Kernel()
    try:
        kernel.run(KERNEL_SETUP)
        results: dict[tuple[str, bool], list[dict]] = {}
        traffic: dict[str, list[tuple[float, float]]] = {}
        for rep in range(args.repeats):
            for runner in args.runners:
                # ABBA order within each runner, so a drift in CPU speed cancels.
                order = [False, True] if rep % 2 == 0 else [True, False]
                for dashboard in order:
                    m0, b0 = kernel.counters()
                    t0 = time.perf_counter()
                    text = kernel.run(
                        f"_measure({runner!r}, {dashboard}, {args.steps}, {args.warmup}, {args.hz})",
                        result=True)
                    elapsed = time.perf_counter() - t0
                    m1, b1 = kernel.counters()
                    row = json.loads(text.strip("'\""))
                    results.setdefault((runner, dashboard), []).append(row)
                    if dashboard:
                        traffic.setdefault(runner, []).append(((m1 - m0) / elapsed, (b1 - b0) / elapsed / 1e3))
                    print(f"  rep {rep + 1} {runner:<20} dashboard={'on ' if dashboard else 'off'} "
                          f"step p50 {row['step_p50_ms']:.1f} ms"
                          + (f", publisher {row['steady_cpu_frac']:.1%} of a core" if dashboard else ""),
                          flush=True)
    finally:
        kernel.close()

    rows = []
    for runner in args.runners:
        off = statistics.median(r["step_p50_ms"] for r in results[(runner, False)])
        on = statistics.median(r["step_p50_ms"] for r in results[(runner, True)])
        steady = statistics.median(r["steady_cpu_frac"] for r in results[(runner, True)])
        total = statistics.median(r["total_cpu_frac"] for r in results[(runner, True)])
        msgs = statistics.median(t[0] for t in traffic[runner])
        kbs = statistics.median(t[1] for t in traffic[runner])
        rows.append([runner, off, on, f"{on / off - 1:+.1%}", f"{steady:.1%}", f"{total:.1%}",
                     f"{msgs:.0f}", f"{kbs:.1f}"])
    print()
    print_table(["runner", "step p50 off (ms)", "on (ms)", "inflation", "publisher CPU steady",
                 "whole run", "iopub msg/s", "iopub KB/s"], rows)
    print("\ntargets: inflation <= +3%, publisher CPU <= 5% of one core at 4 Hz")


if __name__ == "__main__":
    main()
