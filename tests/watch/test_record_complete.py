"""A record holds every step of the script's loop, however the script ends: counted, step by step,
against the loop's own count; and a finished record reads what the live run read at its end."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from test_attach import assert_same_frames

import spdl_lab as lab
from spdl_lab._watch.publish import published_by, unpublish
from spdl_lab._watch.records import record_meta

SCRIPT = '''
    import os, signal, sys, threading, time
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Items(Dataset):
        def __len__(self): return 40
        def __getitem__(self, i): return torch.full((4,), float(i))

    END, STOP_AT = sys.argv[1], 45
    counted = 0

    def note():
        with open("counted.txt", "w") as f:
            f.write(str(counted))

    def batches(dl):
        if END == "sized":  # as Lightning does: never asks past the epoch's length
            it = iter(dl)
            return (next(it) for _ in range(len(dl)))
        return dl

    def train():
        global counted
        dl = DataLoader(Items(), batch_size=2, num_workers=0)
        for epoch in range(3):
            for batch in batches(dl):
                if counted == STOP_AT and END in FAIL:  # the step does not happen
                    note()
                    if END == "exception":
                        raise RuntimeError("the script fails here")
                    if END in ("sigterm", "sigint"):
                        os.kill(os.getpid(), getattr(signal, END.upper()))
                        time.sleep(30)
                    if END == "sigkill":
                        time.sleep(2.6)  # the record flushes every 2 s
                        os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.002)
                counted += 1
                if counted == STOP_AT + 1 and END in ("thread_exit", "break"):  # after the step
                    note()
                    if END == "thread_exit":
                        sys.exit(0)
                    return
        note()

    FAIL = ("exception", "sigterm", "sigint", "sigkill")

    if __name__ == "__main__":
        if END == "thread_exit":
            t = threading.Thread(target=train)
            t.start()
            t.join()
        else:
            train()
'''

#: how the script ends -> (the record's state, the steps the loop counted)
ENDS = {"normal": ("finished", 60), "sized": ("finished", 60), "break": ("finished", 46),
        "thread_exit": ("finished", 46), "exception": ("failed", 45), "sigterm": ("stopped", 45),
        "sigint": ("stopped", 45), "sigkill": ("killed", 45)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("end", list(ENDS))
def test_the_record_holds_every_step_however_the_script_ends(tmp_path, end):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    record = tmp_path / "run.sqlite"
    env = {**os.environ, "SPDL_LAB_RUNTIME_DIR": str(tmp_path / "rt"), "SPDL_LAB_RECORD": str(record),
           "SPDL_LAB_WATCH": "1"}
    # A shell's background jobs (`make test &`) ignore SIGINT, and Python keeps it ignored in what they
    # start: restore it, as a terminal has it, or the script's own SIGINT would do nothing.
    done = subprocess.run([sys.executable, str(script), end], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=80, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    counted = int((tmp_path / "counted.txt").read_text())
    state, expected = ENDS[end]
    assert counted == expected, done.stderr
    assert record_meta(record)["state"] == state, done.stderr
    step = lab.open(record).stats().step
    assert step is not None and step.steps == counted, done.stderr


def test_a_finished_record_reads_what_the_live_run_read_at_its_end(runtime_dir, no_thread_leak):
    items = list(range(300))
    batches = lab.publish(items, "live-vs-record")
    for i, _ in enumerate(batches):
        sum(range(2000 + 50 * (i % 7)))  # steps of a few sizes: percentiles between buckets
    publisher = published_by(items)
    live_stats = publisher.source.clock.summary()
    remote = lab.attach("live-vs-record")
    try:
        live_summary = remote.summary()
    finally:
        remote.close()
    record = publisher.writer.path
    unpublish(batches)
    opened = lab.open(record)
    assert _same(opened.stats().step.to_dict(), live_stats.to_dict())
    assert opened.stats().step.steps == 300
    recorded = opened.summary()
    assert list(recorded.columns) == list(live_summary.columns)
    assert _same(recorded.loc["step"].to_dict(), live_summary.loc["step"].to_dict())


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (isinstance(a[k], float) and isinstance(b[k], float) and math.isnan(a[k]) and math.isnan(b[k]))
        or a[k] == b[k] for k in a)


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    return tmp_path


def _run_watched(tmp_path, name: str, code: str, *args: str, record: str = "r.sqlite",
                 **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` as the script ``name`` with publishing on (``SPDL_LAB_WATCH=1``), recording to
    ``record``; its output kept."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "SPDL_LAB_RUNTIME_DIR": str(tmp_path / "rt"), "SPDL_LAB_RECORD": str(tmp_path / record),
           "SPDL_LAB_WATCH": "1", **env}
    return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=80)


NO_CYCLE = '''
    import gc, weakref
    import torch
    from torch.utils.data import DataLoader

    gc.disable()  # what is freed must be freed by reference count, as without the lab
    class Combined:  # as Lightning's CombinedLoader makes its iterators
        def __iter__(self):
            self.iterators = [iter(dl) for _ in range(1)]
            return self

        def __next__(self):
            return next(self.iterators[0])

    dl = DataLoader(list(range(8)), batch_size=4, num_workers=1)
    seen = []
    for epoch in range(3):
        combined = iter(Combined())
        seen.append(weakref.ref(combined.iterators[0]))
        for _ in range(len(dl)):
            next(combined)
        combined = None
    print("alive", sum(ref() is not None for ref in seen))
'''


@pytest.mark.timeout(90)
def test_an_epoch_the_loop_drops_is_freed_at_once_not_by_a_garbage_collection(tmp_path):
    # Freed by a collection instead, torch takes 5 s per worker to stop the old epoch's workers,
    # and did so in the middle of a Lightning job's steps.
    done = _run_watched(tmp_path, "epochs.py", NO_CYCLE)
    assert done.returncode == 0, done.stderr
    assert "alive 0" in done.stdout, done.stdout


SIGTERM_IN_WAIT = '''
    import os, signal, threading, time
    import torch
    from torch.utils.data import DataLoader, Dataset

    SCRIPT = os.getpid()

    class Slow(Dataset):
        def __len__(self): return 64
        def __getitem__(self, i):
            # The loop waits in next() from the 5th batch, 8 s or until the script is gone: then
            # the worker stops at once, and with it the pipes it shares with the test.
            until = time.monotonic() + (2.0 if i >= 16 else 0.001)
            while time.monotonic() < until and os.getppid() == SCRIPT:
                time.sleep(0.01)
            return torch.full((4,), float(i))

    def terminate():
        os.kill(os.getpid(), signal.SIGTERM)
        if os.environ.get("TWICE"):  # a job's group kill, then torchrun's own, within the flush
            from spdl_lab._watch.publish import _PUBLISHED
            while not any(p._stop.is_set() for p in list(_PUBLISHED.values())):
                time.sleep(0.0005)
            os.kill(os.getpid(), signal.SIGTERM)

    if __name__ == "__main__":
        print("pid", os.getpid(), flush=True)
        steps = 0
        for batch in DataLoader(Slow(), batch_size=4, num_workers=1):
            steps += 1
            if steps == 4:  # the next next() waits 8 s: SIGTERM arrives inside it
                threading.Timer(0.5, terminate).start()

'''


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signals", ["once", "twice"])
def test_sigterm_while_the_loop_waits_for_data_closes_the_run_and_its_shared_memory(tmp_path, signals):
    """Twice: a second SIGTERM in the first one's flush waits for it (the records stay whole)."""
    record = tmp_path / "run.sqlite"
    done = _run_watched(tmp_path, "wait.py", SIGTERM_IN_WAIT, record=record.name,
                        **({"TWICE": "1"} if signals == "twice" else {}))
    assert done.returncode == -15, done.stderr  # the signal still ends it, as without the lab
    pid = done.stdout.split()[1]
    assert record_meta(record)["state"] == "stopped"
    assert lab.open(record).stats().step.steps == 4
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"spdl_lab_{pid}_")]


SIGNAL_IN_HAND_OVER = '''
    import os, signal, sys, threading, time
    import torch
    from torch.utils.data import DataLoader
    from spdl_lab._watch import publish

    SIGNAL, WINDOW, PAUSE = getattr(signal, sys.argv[1]), sys.argv[2], float(sys.argv[3])  # PAUSE: between
    # epochs, for the pump to close the run
    opened, closed = publish.RecordWriter.__init__, publish.RecordWriter.close

    def terminate():
        if not getattr(terminate, "sent", False):
            terminate.sent = True
            print("in", threading.current_thread().name, flush=True)
            os.kill(os.getpid(), SIGNAL)

    def opening(self, *args, resume=False, **kwargs):  # the next epoch's record opened, not yet its run
        opened(self, *args, resume=resume, **kwargs)
        if resume and WINDOW == "opening":
            terminate()

    def closing(self, *args, **kwargs):  # the epoch's run half closed
        if WINDOW == "closing":
            terminate()
        closed(self, *args, **kwargs)

    publish.RecordWriter.__init__, publish.RecordWriter.close = opening, closing

    if __name__ == "__main__":
        for epoch in range(3):
            for batch in DataLoader([torch.zeros(2)] * 16, batch_size=2):
                time.sleep(0.002)
            time.sleep(PAUSE)
            if WINDOW == "between":  # the run closed whole, with the DataLoader the script let go of
                terminate()
'''


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("sent", "window", "pause", "closer"), [
    ("SIGTERM", "opening", 0.0, "MainThread"), ("SIGTERM", "closing", 0.0, "MainThread"),
    ("SIGTERM", "closing", 0.6, "spdl_lab:dropped"), ("SIGINT", "closing", 0.0, "MainThread"),
    ("SIGINT", "between", 0.6, "MainThread")])
def test_a_signal_while_a_dataloader_built_each_epoch_hands_its_run_on_leaves_a_whole_record(
        tmp_path, sent, window, pause, closer):
    """Between epochs the run is closed and opened again: a SIGTERM or Ctrl-C inside either waits
    for it (it ended the process with the record open: no state, no steps, its -wal beside it).
    The run was stopped, though closed as "finished" when its DataLoader went (it said so before)."""
    done = _run_watched(tmp_path, "handover.py", SIGNAL_IN_HAND_OVER, sent, window, str(pause))
    assert done.returncode == -getattr(signal, sent), done.stderr  # as without the lab
    assert sent == "SIGTERM" or done.stderr.rstrip().endswith("KeyboardInterrupt"), done.stderr
    assert f"in {closer}" in done.stdout, done.stdout
    assert sorted(p.name for p in tmp_path.glob("r.sqlite*")) == ["r.sqlite"]
    assert record_meta(tmp_path / "r.sqlite")["state"] == "stopped"
    opened = lab.open(tmp_path / "r.sqlite")
    assert opened.stats().step.steps == 8  # the first epoch, the second never began
    opened.close()


EPOCH_BY_EPOCH = '''
    import sys, threading, time
    import psutil
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Items(Dataset):
        def __len__(self): return 16
        def __getitem__(self, i): return torch.zeros(2)

    if __name__ == "__main__":
        for epoch in range(4):  # a new DataLoader each epoch, as some loops build them
            dl = DataLoader(Items(), batch_size=4, num_workers=1, persistent_workers=sys.argv[1] == "persistent")
            for batch in dl:
                pass
            del dl
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(t.name.startswith("spdl_lab") for t in threading.enumerate()):
            time.sleep(0.05)
        print("lab threads", sorted(t.name for t in threading.enumerate() if t.name.startswith("spdl_lab")))
        print("workers", len(psutil.Process().children()))
'''


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", ["persistent", "fresh"])
def test_a_dataloader_the_script_drops_ends_its_run_as_without_the_lab(tmp_path, workers):
    """Its run ends once the script lets go of it and its epoch: the record finished, the lab's
    threads and endpoint gone, persistent workers stopped; not one more run per epoch kept until
    the script exits. The next epoch's DataLoader, from the same line, goes on with that run: one
    record with every step, as the script counts them."""
    done = _run_watched(tmp_path, "epochs.py", EPOCH_BY_EPOCH, workers)
    assert done.returncode == 0, done.stderr
    assert "lab threads []" in done.stdout and "workers 0" in done.stdout, done.stdout
    records = sorted(tmp_path.glob("r*.sqlite"))
    assert records == [tmp_path / "r.sqlite"], records
    meta = record_meta(records[0])
    assert meta["state"] == "finished" and meta["name"] == "epochs-14", meta  # the line of the loop over it
    opened = lab.open(records[0])
    assert opened.stats().step.steps == 4 * 4
    assert {s.name: s.tasks for s in opened.stats().stages.values()} == {"fetch": 4 * 16, "collate": 4 * 4}
    opened.close()
    assert not list((tmp_path / "rt").glob("*.sock")), "an endpoint left open"


TRAIN_AND_VALIDATION = '''
    import torch
    from torch.utils.data import DataLoader

    if __name__ == "__main__":
        for epoch in range(3):  # both rebuilt each epoch, iterated from one line, as Lightning does
            for dl in (DataLoader([torch.zeros(2)] * 32, batch_size=4, shuffle=True),
                       DataLoader([torch.zeros(2)] * 8, batch_size=4)):
                for batch in dl:
                    pass
'''


@pytest.mark.timeout(90)
def test_a_training_and_a_validation_dataloader_rebuilt_on_one_line_each_go_on_with_their_own_run(tmp_path):
    done = _run_watched(tmp_path, "fit.py", TRAIN_AND_VALIDATION)
    assert done.returncode == 0, done.stderr
    steps = _steps_by_run(tmp_path)
    assert steps == {"fit-9": 3 * 8, "fit-9-2": 3 * 2}, steps


def _steps_by_run(tmp_path) -> dict[str, int]:
    """Each record's run name and steps."""
    steps = {}
    for record in tmp_path.glob("r*.sqlite"):
        opened = lab.open(record)
        steps[record_meta(record)["name"]] = opened.stats().step.steps
        opened.close()
    return steps


KEPT_ITERATORS = '''
    import time
    import torch
    from torch.utils.data import DataLoader

    def loader():
        return DataLoader([torch.zeros(2)] * 16, batch_size=2)

    if __name__ == "__main__":
        for epoch in range(3):
            it = iter(loader())  # the DataLoader goes at once; its iterator, run out, until the next
            for batch in it:
                pass
        steps, it = 0, iter(())
        while steps < 20:  # a stream of steps
            batch = next(it, None)
            if batch is None:
                it = iter(loader())  # a new DataLoader when one runs out
                continue
            steps += 1
        its = [iter(DataLoader([torch.zeros(2)] * 16, batch_size=2)) for _ in range(2)]
        for step in range(16):  # two datasets in turn, each DataLoader let go of at once: two runs
            next(its[step % 2])
            time.sleep(0.002)  # the step: the last one's, held as the script ends, counts
'''


@pytest.mark.timeout(90)
def test_a_loop_that_keeps_its_run_out_iterator_goes_on_with_one_run(tmp_path):
    """A DataLoader's iterator is kept until the next replaces it: the epoch it ran out of is over
    all the same (one run per DataLoader before: 8 steps each). An epoch kept mid-way is not: two
    DataLoaders from one line, taken in turn, each count their own steps."""
    done = _run_watched(tmp_path, "kept.py", KEPT_ITERATORS)
    assert done.returncode == 0, done.stderr
    steps = _steps_by_run(tmp_path)
    assert steps == {"kept-11": 3 * 8, "kept-18": 20, "kept-21": 8, "kept-21-2": 8}, steps


SLOW_EPOCHS = '''
    import time
    import torch
    from torch.utils.data import DataLoader

    if __name__ == "__main__":
        for epoch in range(4):
            for batch in DataLoader([torch.zeros(2)] * 16, batch_size=2):  # 8 steps of 0.1 s
                time.sleep(0.1)
            time.sleep(0.3)  # between epochs: the run is closed
'''


@pytest.mark.timeout(90)
def test_a_viewer_of_a_dataloader_built_each_epoch_follows_every_epoch(tmp_path, monkeypatch, wait_until):
    """Between the DataLoaders the run is closed; the viewer waits for the next to go on with it."""
    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent(SLOW_EPOCHS))
    env = os.environ.copy()
    proc = subprocess.Popen([sys.executable, "-m", "spdl_lab", "watch", "--name", "epochs", "--record",
                             str(tmp_path / "r.sqlite"), "--", sys.executable, str(script)], cwd=tmp_path, env=env)
    try:
        remote = lab.attach("epochs", timeout=60)
        try:
            states = []  # as the script trains, its epochs and what it does between them
            while proc.poll() is None:
                states.append(remote.state)
                time.sleep(0.05)
            assert proc.wait(60) == 0
            assert set(states[:-5]) == {"running"}, "".join(s[0] for s in states)  # the last: as it ends
            wait_until(lambda: remote.state == "finished" and remote._thread is not None
                       and not remote._thread.is_alive(), timeout=20)
            steps = remote.frames().query("series == 'steps' and stage == 'step'").value
            # Ticks to the run's end (the last ones after its last poll from its record), as the record.
            assert steps.max() == 4 * 8 and remote.stats().step.steps == 4 * 8
            assert_same_frames(remote, tmp_path / "r.sqlite")
        finally:
            remote.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


LEAKS_A_SEGMENT = textwrap.dedent('''
    import os
    from spdl_lab._runners._shm import ShmFile, new_prefix

    segment = ShmFile(new_prefix() + "dataloader", 4096, create=True)
    print(segment.path, flush=True)
    os._exit(0)  # as a script killed, or interrupted before its removal was arranged: no cleanup
''')


@pytest.mark.timeout(60)
def test_what_a_watched_script_leaves_in_shared_memory_is_removed_when_it_ends(tmp_path):
    """The Ctrl-C matrix once found a watched DataLoader's meter block in /dev/shm 5 s after the
    script ended: watch removes what its script's process could not, as it returns."""
    script = tmp_path / "leak.py"
    script.write_text(LEAKS_A_SEGMENT)
    out = subprocess.run([sys.executable, "-m", "spdl_lab", "watch", "--", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip().splitlines()[-1]
    assert path.startswith(os.sep) and "spdl_lab_" in path, out.stdout
    assert not os.path.exists(path), f"{path} left behind by the script, and by watch"
