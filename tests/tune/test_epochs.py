"""Epochs as a training loop runs them: a finite loader is iterated again when a pass ends, and each
batch is charged its share of the restart; a one-epoch DataLoader is tuned without running out."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

import spdl_lab as lab
from spdl_lab._tune.bench import Passes, endless, epoch_rate, restart_extras
from spdl_lab.errors import SpdlLabError

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_thread_leak", "no_child_leak")]


def test_passes_run_epoch_after_epoch_and_note_where_each_began():
    p = lab.Pipeline(list(range(10))).map(abs, name="a").batch(4)  # 3 batches a pass
    with lab.Loader(p, runner="thread") as loader:
        passes = Passes(loader)
        got = [next(passes) for _ in range(8)]
    assert [len(b) for b in got] == [4, 4, 2, 4, 4, 2, 4, 4]
    assert passes.restarts == [3, 6] and passes.passes == 3 and passes.epoch_batches == 3


def test_a_source_that_runs_once_says_so_instead_of_looping():
    p = lab.Pipeline(iter(range(6))).map(abs, name="a").batch(3)  # a plain iterator: one pass
    with lab.Loader(p, runner="thread") as loader:
        passes = Passes(loader)
        assert len(next(passes)) == 3 and len(next(passes)) == 3
        with pytest.raises(SpdlLabError, match="gave no batch; the source ran out.*re-iterable"):
            next(passes)


def test_endless_runs_every_epoch_in_one_run():
    p = lab.Pipeline(list(range(5))).map(abs, concurrency=2, name="a").batch(2)
    looped = endless(p)
    assert [s.name for s in looped.stages] == ["a", "batch"] and looped.stage("a").concurrency == 2
    with lab.Loader(looped, runner="thread") as loader:
        it = iter(loader)
        items = [x for _ in range(7) for x in next(it)]
    assert items == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3]  # passes run into each other


def test_each_batch_pays_its_share_of_a_restart():
    step = SimpleNamespace
    records = [step(data_wait_s=0.0, step_s=0.01)] * 3 + [step(data_wait_s=2.0, step_s=0.01)] + \
        [step(data_wait_s=0.0, step_s=0.01)] * 2
    extras, steady = restart_extras(records, first=100, restarts=[103, 500])
    assert steady == pytest.approx(0.01) and extras == [pytest.approx(2.0)]
    # 62 batches an epoch: each carries 2 s / 62 on top of its 10 ms.
    assert epoch_rate(steady, 2.0, 62) == pytest.approx(1 / (0.01 + 2.0 / 62))
    assert epoch_rate(steady, math.nan, 62) == pytest.approx(100.0)  # no restart known
    assert epoch_rate(steady, 2.0, None) == pytest.approx(100.0)  # an endless source
    assert math.isnan(epoch_rate(math.nan, 2.0, 62))


def test_a_one_epoch_dataloader_is_tuned_within_its_budget():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset

    class Small(Dataset):
        def __len__(self):
            return 62 * 4

        def __getitem__(self, i):
            time.sleep(0.001)
            return torch.full((4,), float(i))

    dl = DataLoader(Small(), batch_size=4, shuffle=True, num_workers=1)
    assert len(dl) == 62
    tuning = lab.tune(dl, lambda batch: time.sleep(0.002), runners=("process", "thread"), budget_s=20,
                      progress=False)
    assert len(tuning.trials) >= 1, tuning.log  # how many fit the budget depends on the machine
    assert tuning.advice.startswith(("move to", "keep what you have")), tuning.log
    # Epochs were crossed and charged: a restart was measured.
    assert tuning.trials["restart_s"].notna().any(), tuning.trials
    assert "dataloader_kwargs = dict(num_workers=" in tuning.code or tuning.best["runner"] != "process"
    assert "prefetch_factor" in tuning.start["options"] and "persistent_workers" in tuning.start["options"]


def test_windows_before_the_first_restart_pay_for_it_as_later_ones_do():
    from spdl_lab._experiments.compare import Window
    from spdl_lab._tune.bench import Bench
    from spdl_lab._tune.space import Config

    def window(*waits: float) -> Window:
        records = tuple(SimpleNamespace(data_wait_s=w, step_s=0.01) for w in waits)
        return Window(runner="thread", round=1, started_s=0.0, records=records, cpu_percent=50.0,
                      others_percent=0.0, gil_wait_frac=math.nan, runqueue_wait_frac=math.nan,
                      train_gil_wait_frac=math.nan, train_runqueue_wait_frac=math.nan)

    bench = Bench(lab.Pipeline(range(4)).map(abs, name="a").batch(2), lambda b: None, window_s=0.3, probes=False)
    try:
        config = Config.of("thread", {"a": 1})
        early = bench._charged(window(0, 0, 0, 0), config, first=0, restarts=[], epoch_batches=62)
        assert early.batches_per_s == pytest.approx(100.0) and math.isnan(early.restart_s)  # none known yet
        later = bench._charged(window(0, 0, 2.0, 0), config, first=10, restarts=[12], epoch_batches=62)
        charged = 1 / (0.01 + 2.0 / 62)
        assert later.batches_per_s == pytest.approx(charged) and later.restart_s == pytest.approx(2.0)
        assert bench._recharged(early, config, 62).batches_per_s == pytest.approx(charged)
        # A window that is all restart is taken as measured.
        alone = bench._charged(window(3.0), config, first=20, restarts=[20], epoch_batches=62)
        assert alone.batches_per_s == pytest.approx(1 / 3.01)
    finally:
        bench.close()
