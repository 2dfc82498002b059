"""A real tuning with a short budget, on a pipeline whose answer is known: more readers."""

from __future__ import annotations

import time

import pytest

import spdl_lab as lab

pytestmark = [pytest.mark.measurement, pytest.mark.timeout(180),
              pytest.mark.usefixtures("no_thread_leak", "no_child_leak")]


def read(i):
    time.sleep(0.02)  # I/O-like: one reader makes 12.5 batches/s of 4
    return i


def step(batch):
    time.sleep(0.004)  # the step alone allows 250 batches/s


def test_a_starved_step_gets_its_readers_within_the_budget():
    p = lab.Pipeline(range(10**7)).map(read, concurrency=1, name="read").batch(4)
    t0 = time.perf_counter()
    tuning = lab.tune(p, step, runners=("thread", "subprocess-threads"), budget_s=20, progress=False)
    wall = time.perf_counter() - t0
    assert wall < 20 + 15, tuning.log  # the budget, plus at most one window's overrun
    assert tuning.elapsed_s < 20 + 10, tuning.log  # and as the tuning itself counts it
    assert tuning.best["concurrency"]["read"] >= 4, tuning.log
    # 1 reader against >= 4: a factor the noise of a shared machine cannot make up.
    assert tuning.speedup >= 2.0, tuning.log
    assert tuning.trials["predicted_batches_per_s"].iloc[1] > 2 * tuning.trials["batches_per_s"].iloc[0]
