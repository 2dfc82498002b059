"""The fault battery: every way a run can go wrong, under every runner it applies to.

Each case runs under the autouse hygiene check (``conftest.py``): after it, no
thread, child process, /dev/shm entry or file descriptor may be left behind.
Every error must name the stage or runner involved and, where there is one,
the fix; the cases assert on the message text.

Stage functions that children must run by reference (they use ``RELEASE``)
live at module level: a child process imports this module afresh.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import traceback
from contextlib import contextmanager

import numpy as np
import pytest

import spdl_lab as lab
from spdl_lab._loader import CLOSE_TIMEOUT_S
from spdl_lab._runners import _shm

#: Options that keep each case small: one DataLoader worker (every spawn
#: imports torch, ~2 s), and a cache that holds the whole run so that every
#: fault happens while its source runner still runs (a cache that has started
#: replaying runs no user code, so no fault can happen there).
OPTIONS: dict[str, dict] = {
    "thread": {},
    "subprocess-threads": {},
    "process": {"num_workers": 1},
    "cache": {"num_caches": 10**6},
    "ray": {},  # on the session's shared local instance (see conftest.py)
}
#: The process runner with num_workers=0 runs the stages in its pump thread:
#: the one configuration of it whose stuck stage is a thread of this process.
INLINE = "process-inline"
CLOSE_S = 1.0
#: Runners whose stages run in other processes (the others run them here).
CHILD_RUNNERS = ("subprocess-threads", "process")

#: Set after each test by the ``release`` fixture. In a child process this is a
#: fresh Event that nobody sets, so a held stage there waits until it is killed.
RELEASE = threading.Event()
#: Items that entered ``hold_after_first`` in this process.
HELD: list[int] = []


def open_loader(p: lab.Pipeline, runner: str, **options) -> lab.Loader:
    if runner == INLINE:
        runner, options = "process", {"num_workers": 0, **options}
    return lab.Loader(p, runner=runner, **{"close_timeout": CLOSE_S, **OPTIONS[runner], **options})


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- stage functions ------------------------------------------------------------------
def fail_on(bad: set[int]):
    def decode(x):
        if x in bad:
            raise ValueError(f"corrupt record {x}")
        return x

    return decode


def hold_after_first(x):
    if x > 0:
        HELD.append(x)
        RELEASE.wait()
    return x


def nap(x):
    time.sleep(0.002)
    return x


def nap_array(x):
    # An array travels through shared memory under subprocess-threads.
    time.sleep(0.002)
    return np.full(256, x)


def source_failing_after_five():
    yield from range(5)
    raise OSError("disk gone")


def make_lock(x):
    return threading.Lock()


def make_generator(x):
    return (c for c in x)


@pytest.fixture
def release():
    """A fresh RELEASE for held stages in this process, set when the test ends."""
    global RELEASE
    RELEASE = event = threading.Event()
    HELD.clear()
    yield event
    event.set()


# -- a stage raises ---------------------------------------------------------------------
@pytest.mark.parametrize("runner", lab.RUNNERS)
def test_stage_raising_on_the_first_item(runner):
    p = lab.Pipeline(range(20)).map(fail_on({0}), name="decode")
    with open_loader(p, runner) as loader, pytest.raises(lab.PipelineError) as info:
        list(loader)
    err = info.value
    assert (err.stage, err.index) == ("decode", 0)
    assert "stage 'decode' failed on item 0: ValueError: corrupt record 0" in str(err)
    assert "Pass max_failures=N" in str(err)
    assert isinstance(err.__cause__, ValueError)


ONE_PERCENT = set(range(37, 1000, 100))


@pytest.mark.parametrize("runner", lab.RUNNERS)
def test_one_percent_failing_stops_at_the_first_without_max_failures(runner):
    p = lab.Pipeline(range(1000)).map(fail_on(ONE_PERCENT), concurrency=2, name="decode")
    with open_loader(p, runner) as loader, pytest.raises(lab.PipelineError) as info:
        list(loader)
    assert (info.value.stage, info.value.index) == ("decode", 37)
    assert "stage 'decode' failed on item 37" in str(info.value) and "max_failures=N" in str(info.value)


@pytest.mark.parametrize("runner", lab.RUNNERS)
def test_one_percent_failing_is_dropped_and_counted_under_max_failures(runner):
    p = lab.Pipeline(range(1000)).map(fail_on(ONE_PERCENT), concurrency=2, name="decode")
    with open_loader(p, runner, max_failures=len(ONE_PERCENT)) as loader:
        assert list(loader) == [x for x in range(1000) if x not in ONE_PERCENT]
        assert loader.stats().stages["decode"].failures == len(ONE_PERCENT)
    # One more failure than allowed stops the run, saying how to allow more.
    with open_loader(p, runner, max_failures=len(ONE_PERCENT) - 1) as loader:
        with pytest.raises(lab.PipelineError, match=r"stage 'decode' failed on item 937.*already dropped.*max_failures=9.*raise max_failures"):
            list(loader)


@pytest.mark.parametrize("runner", lab.RUNNERS)
def test_batch_stage_raising_names_the_batch(runner):
    def collate(batch):
        if batch[0] == 20:
            raise RuntimeError("ragged batch")
        return batch

    p = lab.Pipeline(range(100)).batch(10).map(collate, name="collate")
    with open_loader(p, runner) as loader, pytest.raises(lab.PipelineError) as info:
        list(loader)
    assert (info.value.stage, info.value.index) == ("collate", 2)
    assert "stage 'collate' failed on item 2: RuntimeError: ragged batch" in str(info.value)


@pytest.mark.parametrize("runner", lab.RUNNERS)
def test_source_raising_mid_iteration(runner):
    p = lab.Pipeline(source_failing_after_five).map(str, name="fmt")
    with open_loader(p, runner) as loader, pytest.raises(lab.PipelineError) as info:
        list(loader)
    err = info.value
    assert (err.stage, err.index) == ("source", 5)
    assert "the source failed on item 5: OSError: disk gone" in str(err)
    assert "Fix the source" in str(err)


# -- a stage hangs ----------------------------------------------------------------------
@pytest.mark.timeout(30)
def hang_then_close(runner: str, hygiene) -> float:
    """Close a loader whose stage hangs; the seconds close() took."""
    p = lab.Pipeline(range(100)).map(hold_after_first, concurrency=2, name="hang")
    loader = open_loader(p, runner, close_timeout=CLOSE_TIMEOUT_S)  # the default: the promise is for it
    it = iter(loader)
    assert next(it) == 0
    if runner in ("thread", "cache"):
        # Both workers are inside the stage before close, so both are abandoned.
        assert wait_until(lambda: len(HELD) == 2, 10)
        hygiene.allow_abandoned("spdl_lab:hang:")
    elif runner == INLINE:
        hygiene.allow_abandoned("spdl_lab:process-pump")
    t0 = time.monotonic()
    loader.close()
    took = time.monotonic() - t0
    reports = hygiene.reports()
    if runner in ("thread", "cache"):
        assert any("stage 'hang': 2 thread(s)" in r and "timeout" in r for r in reports), reports
    elif runner == INLINE:
        assert any("stage 'hang'" in r and "num_workers" in r for r in reports), reports
    else:  # its child processes were killed: nothing was abandoned here
        assert reports == []
    with pytest.raises(StopIteration):
        next(it)
    return took


# Each scenario below runs once, in the measurement set: its behaviour asserts and its timing
# assert come from the same run (the timing one cannot be a unit test's).
@pytest.mark.measurement
@pytest.mark.parametrize("runner", [*lab.RUNNERS, INLINE])
def test_hanging_stage_close_reports_what_it_abandons_and_is_prompt(runner, release, hygiene):
    assert hang_then_close(runner, hygiene) < 5


# -- a child process dies ---------------------------------------------------------------
def child_pid(loader: lab.Loader, runner: str) -> int:
    inner = loader._state.run.runner
    if runner == "subprocess-threads":
        return inner._child.proc.pid
    assert wait_until(lambda: inner.worker_pids(), 30)
    return inner.worker_pids()[0]


# cache and thread have no child process of their own to kill.
def kill_a_child_mid_iteration(runner: str) -> float:
    """SIGKILL a child of a running loader; the seconds until its RunnerError came."""
    p = lab.Pipeline(range(10**9)).map(nap, name="nap")
    loader = open_loader(p, runner)
    it = iter(loader)
    next(it)
    pid = child_pid(loader, runner)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(lab.RunnerError) as info:
        for _ in it:
            pass
    took = time.monotonic() - t0
    text = str(info.value)
    assert runner in text and f"pid {pid}" in text and "killed by signal SIGKILL" in text
    assert "smaller" in text  # the fix when it was the out-of-memory killer
    loader.close()
    return took


@pytest.mark.measurement
@pytest.mark.timeout(60)
@pytest.mark.parametrize("runner", CHILD_RUNNERS)
def test_sigkill_of_a_child_mid_iteration_is_a_runner_error_reported_promptly(runner):
    assert kill_a_child_mid_iteration(runner) < 5


# -- the consumer goes away -------------------------------------------------------------
@pytest.mark.parametrize("runner", lab.RUNNERS)
def test_breaking_out_and_dropping_the_loader_stops_everything(runner):
    p = lab.Pipeline(range(10**9)).map(nap, concurrency=2, name="nap").batch(4)
    loader = open_loader(p, runner)
    for i, _ in enumerate(loader):
        if i == 5:
            break
    del loader
    gc.collect()


class CtrlC:
    """Ctrl-C for a test: SIGINT to the main thread from a timer, heeded only while armed."""

    def __init__(self) -> None:
        self._armed = False
        self.pressed = threading.Event()
        self._timer: threading.Thread | None = None
        self._previous = signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum, frame) -> None:
        if self._armed:
            self._armed = False
            self.pressed.set()
            raise KeyboardInterrupt

    @contextmanager
    def pressed_after(self, delay_s: float, then=None):
        """Press Ctrl-C ``delay_s`` after entering; then call ``then`` once it was heeded."""
        main = threading.main_thread().ident

        def press() -> None:
            time.sleep(delay_s)
            signal.pthread_kill(main, signal.SIGINT)
            if self.pressed.wait(10) and then is not None:
                then()

        self._armed = True
        self._timer = threading.Thread(target=press, name="test:ctrl-c")
        self._timer.start()
        try:
            yield
        finally:
            self._armed = False

    def restore(self) -> None:
        if self._timer is not None:
            self._timer.join(15)
        signal.signal(signal.SIGINT, self._previous)


@pytest.fixture
def ctrl_c():
    assert threading.current_thread() is threading.main_thread()
    presser = CtrlC()
    yield presser
    presser.restore()


def ctrl_c_then_close(runner: str, release, ctrl_c) -> float:
    """Ctrl-C while blocked in next(), then close(); the seconds close() took."""
    p = lab.Pipeline(range(100)).map(hold_after_first, name="slow")
    loader = open_loader(p, runner)
    it = iter(loader)
    assert next(it) == 0
    # Released once Ctrl-C was heeded, so the thread runners' workers can stop.
    with pytest.raises(KeyboardInterrupt), ctrl_c.pressed_after(0.3, then=release.set):
        next(it)
    assert ctrl_c.pressed.is_set()
    t0 = time.monotonic()
    loader.close()
    took = time.monotonic() - t0
    with pytest.raises(StopIteration):
        next(it)
    return took


@pytest.mark.measurement
@pytest.mark.timeout(60)
@pytest.mark.parametrize("runner", lab.RUNNERS)
def test_ctrl_c_while_blocked_in_next_propagates_leaves_nothing_and_close_is_prompt(runner, release, ctrl_c):
    assert ctrl_c_then_close(runner, release, ctrl_c) < 5


# -- close ------------------------------------------------------------------------------
def close_from_another_thread(runner: str) -> float:
    """Close a loader from another thread while this one iterates; the seconds until both ended."""
    p = lab.Pipeline(range(10**9)).map(nap_array, name="nap")
    loader = open_loader(p, runner)
    it = iter(loader)
    next(it)
    closer = threading.Thread(target=loader.close, name="test:closer")
    t0 = time.monotonic()
    closer.start()
    for _ in it:  # ends, without an error, once the run is closed
        pass
    closer.join(10)
    took = time.monotonic() - t0
    assert not closer.is_alive()
    loader.close()
    loader.close()
    with pytest.raises(lab.SpdlLabError, match="this Loader is closed; create a new one"):
        iter(loader)
    return took


@pytest.mark.measurement
@pytest.mark.timeout(60)
@pytest.mark.parametrize("runner", lab.RUNNERS)
def test_close_from_another_thread_ends_iteration_promptly_and_close_twice_is_safe(runner):
    assert close_from_another_thread(runner) < 5


# -- set_concurrency --------------------------------------------------------------------
@pytest.mark.parametrize("runner", lab.RUNNERS)
def test_set_concurrency_rejects_bad_values_naming_stage_and_range(runner):
    p = lab.Pipeline(range(3)).map(str, name="a").batch(2)
    with open_loader(p, runner) as loader:
        for bad in (0, -1, 10**6):
            with pytest.raises(lab.PipelineSpecError, match=rf"stage 'a'.*in 1\.\.1024, got {bad}"):
                loader.set_concurrency("a", bad)
        for bad in (1.5, "4"):
            with pytest.raises(lab.PipelineSpecError, match=r"stage 'a'.*an int in 1\.\.1024, got"):
                loader.set_concurrency("a", bad)
        with pytest.raises(lab.PipelineSpecError, match="no stage named 'nope'.*stages: 'a', 'batch'"):
            loader.set_concurrency("nope", 2)
        assert loader.controls() == ({"workers": 1} if runner == "process" else {"a": 1})


# -- outputs that cannot cross a process boundary -------------------------------------
# Under thread and cache (over threads) outputs never leave this process. Each
# object kind is tried under one runner (a run of either costs a child start).
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "runner, make, what", [("subprocess-threads", make_lock, "lock"), ("process", make_generator, "generator")]
)
def test_output_that_cannot_cross_processes_names_the_stage_and_the_fix(runner, make, what):
    p = lab.Pipeline(range(1, 10)).map(str, name="fmt").map(make, name="wrap")
    with open_loader(p, runner) as loader, pytest.raises(lab.PipelineError) as info:
        list(loader)
    text = str(info.value)
    assert info.value.stage == "wrap" and info.value.index == 0
    assert text.startswith(f"{runner} runner: stage 'wrap' returned an object on item 0 that cannot be sent")
    assert what in text
    assert "runner='thread'" in text


# -- shared memory runs out -------------------------------------------------------------
# Only subprocess-threads moves outputs through spdl_lab's shared memory; the
# thread runners share nothing, and the process runner's batches travel by
# torch's own mechanism (its meter block is covered by the start-up case below).
@pytest.mark.timeout(60)
def test_batch_larger_than_free_shm_is_a_runner_error_with_the_sizes_and_the_fix():
    def huge(x):
        # 1 TiB as far as shared memory is concerned, yet no memory at all here.
        return np.broadcast_to(np.zeros(1, np.uint8), (1 << 40,))

    p = lab.Pipeline(range(3)).map(huge, name="huge")
    with open_loader(p, "subprocess-threads") as loader, pytest.raises(lab.RunnerError) as info:
        list(loader)
    text = str(info.value)
    assert text.startswith("subprocess-threads:")
    assert "not enough shared memory for the transfer buffer of an output (1.2 TiB) in /dev/shm (" in text
    assert "iB free); make batches smaller" in text and "--shm-size" in text


@pytest.mark.parametrize("runner", CHILD_RUNNERS)
def test_no_room_in_shm_at_start_is_a_runner_error_and_creates_nothing(runner, monkeypatch):
    monkeypatch.setattr(_shm, "free_bytes", lambda directory: 512)
    loader = open_loader(lab.Pipeline(range(3)).map(str, name="fmt"), runner)
    with pytest.raises(lab.RunnerError, match=rf"shared memory for the {runner} runner's meters .*\(512 B free\).*--shm-size"):
        iter(loader)
    loader.close()


# -- a Session's step raises ------------------------------------------------------------
def failing_step(batch):
    if batch[0] >= 12:
        raise ValueError("loss is nan")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("runner", lab.RUNNERS)
def test_session_step_error_surfaces_with_its_traceback(runner):
    p = lab.Pipeline(range(10**6)).map(nap, name="nap").batch(4)
    session = lab.run(p, step=failing_step, runner=runner, steps=100, **OPTIONS[runner])
    with pytest.raises(ValueError, match="loss is nan") as info:
        session.wait(timeout=30)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "failing_step" in frames
    assert session.state == "failed" and not session.running
