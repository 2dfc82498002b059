"""What the live dashboard costs the training loop it watches.

The training loop of ``lab.workloads.noisy_neighbour()`` runs in a real
IPython kernel (started with jupyter_client) with the dashboard shown in it;
its widgets and Bokeh document live in that kernel and every update goes out
as comm messages on IOPub, which this process drains like a front end would
(no browser renders anything).

One long session per repeat and runner, cut into windows of ``--window``
seconds in the order on, off, off, on, ...: in an "off" window the publisher
is paused (this process holds the dashboard's lock, so the publisher thread
sleeps on it and takes no GIL), in an "on" window it publishes at ``--hz``,
catching up on the paused window first. Two neighbouring windows are seconds
apart, so load that other processes put on a shared machine, which comes and
goes over tens of seconds, moves both alike; separate on and off runs a minute
apart did not (pairs of runs read anywhere from -18% to +30%). Printed per runner:

* step p50 (ms) over every step of the "off" and of the "on" windows, and
  the inflation (target <= 3%): on/off - 1 of those, with the same figure per
  repeat beside it. A step counts in the window it ended in; the first step of
  each window is left out (it may have started in the other state). Also the
  median over neighbouring window pairs of on/off - 1, with its quartiles: a
  window holds a dozen steps, so one pair says little; it shows the spread;
* the publisher thread's CPU as a share of one core over the "on" windows
  (target <= 5%);
* the "senders", the publisher and ipykernel's IOPub thread, which wakes for
  every comm message: their CPU (% of a core) and voluntary context switches per second
  in the "off" and in the "on" windows. Every switch is a hand-off of the GIL
  the training thread may lose; unlike step times, these hardly move with
  other processes' load, so they compare versions on a busy machine;
* IOPub traffic over the "on" windows (messages/s, KB/s).

    python benchmarks/dashboard_cost.py [--runners thread subprocess-threads]
        [--seconds 60] [--window 2] [--repeats 2] [--hz 2]
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
import json, os, statistics, threading, time
import spdl_lab as lab
from bokeh.io import output_notebook
from bokeh.resources import INLINE
output_notebook(INLINE, hide_banner=True)

def _start(runner, seconds, warmup, hz):
    """A session with its dashboard shown and drawn, after ``warmup`` steps."""
    global session, dash
    pipeline, step = lab.workloads.noisy_neighbour()
    session = lab.run(pipeline, step, runner=runner, duration=seconds + 120)
    dash = session.dashboard(hz=hz)
    display(dash)
    deadline = time.monotonic() + 120
    while session.clock.steps < warmup and session.running and time.monotonic() < deadline:
        time.sleep(0.05)

def _senders():
    """CPU seconds and voluntary context switches (waits: for the GIL, a lock, a
    socket) of the threads that serve the dashboard: the publisher and ipykernel's
    IOPub thread. Each switch is a GIL hand-off the training thread may lose;
    neither figure depends much on other processes' load."""
    tids = [t.native_id for t in threading.enumerate() if t.name in ("IOPub", "spdl_lab:dashboard")]
    cpu = switches = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += int(fields[11]) + int(fields[12])  # utime, stime
            with open(f"/proc/self/task/{tid}/status") as f:
                switches += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except OSError:
            pass
    return cpu / os.sysconf("SC_CLK_TCK"), switches

def _toggled(seconds, window_s):
    """Windows of the publisher on and paused; per window: state, step p50, publisher CPU."""
    windows = []
    n = max(2, int(seconds / window_s))
    states = [(i % 4) in (0, 3) for i in range(n)]  # on, off, off, on: a drift within a pair of pairs cancels
    held = False
    try:
        for i, on in enumerate(states):
            if not on and not held:
                dash._lock.acquire()  # the publisher waits on it, off the GIL
                held = True
            first, cpu0, t0, (s_cpu0, s_sw0) = session.clock.steps, dash.publisher_cpu_s, time.monotonic(), _senders()
            time.sleep(window_s)
            s_cpu1, s_sw1 = _senders()
            windows.append((on, first, session.clock.steps, dash.publisher_cpu_s - cpu0, time.monotonic() - t0,
                            s_cpu1 - s_cpu0, s_sw1 - s_sw0))
            if held and (i + 1 == n or states[i + 1]):  # held across off, off: no publish between
                dash._lock.release()
                held = False
    finally:
        if held:
            dash._lock.release()
    session.stop()
    dash.close()
    records = session.clock.records()
    by_index = {r.index: r.step_s for r in records}
    out = []
    for on, first, last, cpu, span, s_cpu, s_sw in windows:
        steps = [by_index[j] for j in range(first + 1, last) if j in by_index]
        if steps:
            out.append({"on": on, "p50_ms": statistics.median(steps) * 1e3, "steps": steps,
                        "cpu_frac": cpu / span, "span_s": span, "senders_cpu_s": s_cpu, "senders_switches": s_sw})
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
    ap.add_argument("--seconds", type=float, default=60.0, help="measured seconds per session")
    ap.add_argument("--window", type=float, default=2.0, help="seconds per on or off window")
    ap.add_argument("--warmup", type=int, default=20, help="steps before the first window")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--save", type=Path, help="write every window (state, steps, CPU) here as JSON")
    ap.add_argument("--hz", type=float, default=None, help="publishes per second (default: the dashboard's)")
    args = ap.parse_args(argv)
    if args.hz is None:
        from spdl_lab._ui.dashboard import DEFAULT_HZ

        args.hz = DEFAULT_HZ

    print(machine_line())
    print(f"# noisy_neighbour(); {args.repeats} x {args.seconds:g} s per runner in windows of "
          f"{args.window:g} s, publisher on/off/off/on; dashboard at {args.hz:g} Hz; in one ipykernel")
    kernel = Kernel()
    windows: dict[str, list[dict]] = {}
    traffic: dict[str, list[tuple[float, float]]] = {}
    try:
        kernel.run(KERNEL_SETUP)
        for rep in range(args.repeats):
            for runner in args.runners:
                kernel.run(f"_start({runner!r}, {args.seconds}, {args.warmup}, {args.hz})")
                m0, b0 = kernel.counters()  # after the first drawing: steady traffic only
                text = kernel.run(f"_toggled({args.seconds}, {args.window})", result=True)
                m1, b1 = kernel.counters()
                got = json.loads(text.strip("'\""))
                on_s = sum(w["span_s"] for w in got if w["on"]) or 1.0
                traffic.setdefault(runner, []).append(((m1 - m0) / on_s, (b1 - b0) / on_s / 1e3))
                windows.setdefault(runner, []).extend(got)
                print(f"  rep {rep + 1} {runner:<20} {len(got)} windows, inflation "
                      f"{_pooled(got):+.1%}", flush=True)
    finally:
        kernel.close()

    if args.save:
        args.save.write_text(json.dumps({"hz": args.hz, "windows": windows}))
    rows = []
    for runner in args.runners:
        got = windows[runner]
        off = statistics.median(s for w in got if not w["on"] for s in w["steps"]) * 1e3
        on = statistics.median(s for w in got if w["on"] for s in w["steps"]) * 1e3
        pairs = _pair_inflations(got)
        q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (pairs * 3)
        size = len(got) // args.repeats
        each = " ".join(f"{_pooled(got[i:i + size]):+.1%}" for i in range(0, size * args.repeats, size))
        cpu = sum(w["cpu_frac"] * w["span_s"] for w in got if w["on"]) / sum(w["span_s"] for w in got if w["on"])
        msgs = statistics.median(t[0] for t in traffic[runner])
        kbs = statistics.median(t[1] for t in traffic[runner])
        senders = [_per_s(got, state, "senders_cpu_s") * 100 for state in (False, True)]
        switches = [_per_s(got, state, "senders_switches") for state in (False, True)]
        rows.append([runner, off, on, f"{on / off - 1:+.1%}", each,
                     f"{statistics.median(pairs):+.1%} [{q1:+.1%}, {q3:+.1%}] of {len(pairs)}",
                     f"{cpu:.1%}", "{:.1f}% -> {:.1f}%".format(*senders), "{:.0f} -> {:.0f}".format(*switches),
                     f"{msgs:.0f}", f"{kbs:.1f}"])
    print()
    print_table(["runner", "step p50 off (ms)", "on (ms)", "inflation", "per repeat",
                 "window pairs [quartiles]", "publisher CPU", "senders CPU off -> on",
                 "senders switches/s", "iopub msg/s", "iopub KB/s"], rows)
    print(f"\ntargets: inflation <= +3%, publisher CPU <= 5% of one core at {args.hz:g} Hz")


def _per_s(windows: list[dict], on: bool, field: str) -> float:
    """``field`` summed over the windows in state ``on``, per second of them."""
    chosen = [w for w in windows if w["on"] == on and field in w]
    return sum(w[field] for w in chosen) / (sum(w["span_s"] for w in chosen) or 1.0)


def _pooled(windows: list[dict]) -> float:
    """on/off - 1 of the step p50 over every step of the "on" and of the "off" windows."""
    on = [s for w in windows if w["on"] for s in w["steps"]]
    off = [s for w in windows if not w["on"] for s in w["steps"]]
    return statistics.median(on) / statistics.median(off) - 1 if on and off else float("nan")


def _pair_inflations(windows: list[dict]) -> list[float]:
    """on/off - 1 of step p50 for each neighbouring (on, off) pair of windows, in order."""
    out = []
    for a, b in zip(windows[::2], windows[1::2]):
        if a["on"] != b["on"]:
            on, off = (a, b) if a["on"] else (b, a)
            out.append(on["p50_ms"] / off["p50_ms"] - 1)
    return out


if __name__ == "__main__":
    main()
