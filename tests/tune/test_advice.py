"""The advice: ties go to what you have, with the ratio measured; a busy machine or windows spread
wider than the gain recommend no move, and say why; a DataLoader's knobs are only what it accepts."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import warnings

import psutil
import pytest

import spdl_lab as lab
from spdl_lab._tune import search as machine
from spdl_lab._tune.search import advise, decide
from spdl_lab._tune.space import WORKERS, Config, Space, Trial, dataloader_options
from spdl_lab.errors import PipelineSpecError

pytestmark = [pytest.mark.timeout(120)]

START = Config.of("process", {WORKERS: 2}, {"prefetch_factor": 2, "persistent_workers": False})
CHANGE = Config.of("thread", {"read": 4})


def trial(config: Config, *rates: float, others: float = math.nan) -> Trial:
    return Trial(config=config, rates=rates, step_p50_ms=5.0, data_wait_frac=0.2, cpu_percent=80.0,
                 train_gil_wait_frac=math.nan, gil_wait_frac=0.0, others_percent=others)


def test_a_tie_keeps_what_you_have_and_says_the_ratio():
    start, best = trial(START, 10.0, 10.1, 9.9), trial(CHANGE, 10.1, 10.2, 10.0)
    advice = advise(start, best, best, (1.01, 0.97, 1.05), cores=2)
    assert not advice.move
    assert advice.sentence == ("keep what you have: the best change (thread read=4) measured 1.01x [0.97-1.05] "
                               "side by side, within the noise")


def test_a_climb_that_kept_nothing_names_its_best_change_and_its_ratio():
    start = trial(START, 10.0, 10.5, 9.5)
    change = trial(CHANGE, 9.9, 10.3, 9.6)
    advice = advise(start, start, change, (1.0, 1.0, 1.0), cores=2)
    assert not advice.move and advice.sentence.startswith("keep what you have: the best change (thread read=4) "
                                                           "measured 0.99x [0.91-1.08]")


def test_a_change_beyond_the_noise_is_a_move():
    start, best = trial(START, 10.0, 10.1, 9.9), trial(CHANGE, 15.0, 15.2, 14.9)
    advice = advise(start, best, best, (1.5, 1.45, 1.55), cores=2)
    assert advice.move and advice.sentence == "move to thread read=4: it measured 1.50x [1.45-1.55] the start " \
                                              "side by side"
    assert advice.warnings == ()


def test_a_spread_wider_than_the_gain_recommends_no_move():
    # The loaded machine: the start at 3.95 batches/s [3.05-21.7].
    start, best = trial(START, 3.05, 3.95, 21.7), trial(CHANGE, 4.4, 4.5, 4.6)
    advice = advise(start, best, best, (1.14, 1.05, 1.2), cores=2)
    assert not advice.move and "within its spread" in advice.sentence
    assert any("spread 472%, wider than the +14%" in w for w in advice.warnings), advice.warnings
    # The climb refuses such a gain too, beyond the noise (many steady windows) but not the spread.
    verdict = decide(trial(START, 10.0, 10.0, 10.0, 10.0, 10.0, 11.5), trial(CHANGE, 11.0, 11.0, 11.0))
    assert not verdict.kept and "wider than that gain" in verdict.reason


def test_a_busy_machine_recommends_no_move_and_says_why():
    start, best = trial(START, 10.0, 10.1, 9.9), trial(CHANGE, 15.0, 15.2, 14.9, others=130.0)
    advice = advise(start, best, best, (1.5, 1.45, 1.55), cores=2)
    assert not advice.move and advice.sentence.startswith("keep what you have: the machine was busy")
    assert advice.warnings == ("other processes took 1.3 of the 2 cores (65%, more than 25%) while it was "
                               "measured: no move is recommended from this measurement; tune again on a "
                               "quieter machine",)
    assert "before it measured" in advise(start, best.__class__(**{**best.__dict__, "others_percent": 0.0}),
                                          best, (1.5, 1.45, 1.55), cores=2, before=120.0).warnings[0]
    verdict = decide(start, best, cores=2)
    assert not verdict.kept and "other processes took 1.3 of the 2 cores" in verdict.reason


def test_the_knobs_of_a_dataloader_are_its_own_and_only_what_it_accepts():
    from torch.utils.data import DataLoader

    p = lab.Pipeline(range(10)).map(abs, name="getitem").batch(2)
    space = Space(p, ["process", "thread"], 4, {"process": dict(START.options)},
                  process_options=dataloader_options(cuda=False))
    start = space.start("process")
    moves = {m.describe() for m in space.neighbours(start)}
    assert moves == {"raised workers 2 -> 3", "lowered workers 2 -> 1", "set prefetch_factor 2 -> 4",
                     "set prefetch_factor 2 -> 1", "set persistent_workers False -> True"}
    assert "pin_memory" in dataloader_options(cuda=True) and "pin_memory" not in dataloader_options(cuda=False)
    # Every configuration one move away is one torch's DataLoader accepts.
    for move in space.neighbours(start):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 3 workers on fewer cores: torch warns, and accepts
            DataLoader(range(4), num_workers=move.config.knob(WORKERS), **dict(move.config.options))
    # A thread configuration has no DataLoader options to move.
    assert all(m.kind != "set" for m in space.neighbours(space.start("thread")))


def test_dataloader_options_it_would_refuse_are_refused_before_anything_runs():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    dl = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=2)
    with pytest.raises(PipelineSpecError, match="DataLoader refuses num_workers=0 with prefetch_factor=2"):
        lab.tune(dl, lambda b: None, runner_options={"process": {"num_workers": 0, "prefetch_factor": 2}},
                 progress=False)


# -- a busy machine, for real -----------------------------------------------------------------
_BURN = """
import os, sys, time
if os.fork():
    os._exit(0)  # the burner is re-parented: it is not this test's child
os.setsid()
print(os.getpid(), flush=True)
quiet = os.open(os.devnull, os.O_WRONLY)
os.dup2(quiet, 1)  # the parent reads its output to the end: let it end
os.dup2(quiet, 2)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
"""


@pytest.fixture
def burner():
    """One core kept busy by a process outside this test's own process tree."""
    out = subprocess.run([sys.executable, "-c", _BURN, "60"], capture_output=True, text=True, timeout=30)
    pid = int(out.stdout.split()[0])
    try:
        yield pid
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


@pytest.mark.usefixtures("no_thread_leak", "no_child_leak")
def test_a_tuning_on_a_busy_machine_recommends_no_move_and_says_why(burner, monkeypatch):
    cores = psutil.cpu_count() or 1
    monkeypatch.setattr(machine, "BUSY_MACHINE", min(machine.BUSY_MACHINE, 0.5 / cores))  # one core is too many
    assert psutil.Process(burner).ppid() != os.getpid()
    assert machine.others_percent(0.3) > 50.0  # the burner is seen as another process

    def read(i):
        time.sleep(0.004)
        return i

    p = lab.Pipeline(range(10**6)).map(read, concurrency=1, name="read").batch(4)
    tuning = lab.tune(p, lambda batch: None, runners=("thread",), budget_s=6, progress=False)
    assert not tuning.moved and tuning.best == tuning.start
    assert tuning.advice.startswith("keep what you have"), tuning.log
    assert any("other processes took" in w for w in tuning.warnings), tuning.warnings
    assert "no move recommended" in tuning.summary() and "warning: other processes took" in repr(tuning)


def test_the_report_and_the_terminal_show_the_advice_and_why_no_move(tmp_path):
    from spdl_lab._tune.search import Step
    from spdl_lab._tune.space import Move
    from spdl_lab._ui.report import html_summary
    from spdl_lab.cli import trials_table

    p = lab.Pipeline(range(10)).map(abs, name="read").batch(2)
    start = Config.of("thread", {"read": 1})
    steps = [Step(trial(start, 10.0, 10.1, 9.9, others=150.0), Move("start", start), math.nan, "read", True, "s"),
             Step(trial(CHANGE, 15.0, 15.1, 14.9, others=150.0), Move("raise", CHANGE, "read", 1, 4), 20.0, "step",
                  False, "r")]
    advice = advise(steps[0].trial, steps[0].trial, steps[1].trial, (1.0, 1.0, 1.0), cores=2)
    tuning = lab.Tuning.build(pipeline=p, source_is_dataloader=False, start=start, best=steps[0].trial,
                              steps=steps, log=["s", "r", advice.sentence], speedup=(1.0, 1.0, 1.0), budget_s=10.0,
                              elapsed_s=9.0, cores=2, advice=advice, change=steps[1].trial)
    assert not tuning.moved and tuning.summary().startswith("keep what you have: the machine was busy; the best "
                                                            "change (thread read=4) "
                                                            "measured 1.50x [1.48-1.53]")
    assert "1 warning(s): no move recommended" in tuning.summary()
    page = html_summary(tuning)
    assert "No move recommended from this measurement" in page and "other processes took 1.5 of the 2 cores" in page
    assert "150" in trials_table(tuning.trials)  # the others' CPU, trial by trial
    back = lab.Tuning.from_json(tuning.to_json(tmp_path / "t.json"))
    assert back.warnings == tuning.warnings and back.advice == tuning.advice and back.change == tuning.change
