"""The tuner's decisions on synthetic telemetry: the model, the moves, what is kept."""

from __future__ import annotations

import math

import pytest

from spdl_lab._tune.search import Climb, climb, decide
from spdl_lab._tune.space import MIN_GAIN, WORKERS, Config, RateModel, Trial, batch_items

from .world import Law, World

pytestmark = pytest.mark.timeout(60)


def run_climb(world: World, first: Config, runners=("thread", "subprocess-threads", "process"), limit=40):
    space = world.space(runners)
    search = Climb(space, RateModel(space.pipeline, world.cores))
    steps = []
    for step in climb(search, first, world.measure):
        steps.append(step)
        assert len(steps) <= limit, "the climb did not end"
    best = next(s.trial for s in reversed(steps) if s.kept)
    return best, steps, space


def trial(rates, cpu=100.0, runner="thread") -> Trial:
    return Trial(config=Config.of(runner, {"a": 1}), rates=tuple(rates), step_p50_ms=10.0, data_wait_frac=0.0,
                 cpu_percent=cpu, train_gil_wait_frac=math.nan, gil_wait_frac=0.0)


# -- what is kept ---------------------------------------------------------------------
def test_a_gain_beyond_the_noise_is_kept_and_one_inside_it_is_not():
    base = trial([10.0, 10.1, 9.9, 10.0])
    assert decide(base, trial([12.0, 12.1, 11.9, 12.0])).kept
    within = decide(base, trial([10.2, 10.3, 10.1, 10.2]))
    assert not within.kept and "within the noise" in within.reason
    slower = decide(base, trial([8.0, 8.1, 7.9, 8.0]))
    assert not slower.kept and "slower" in slower.reason


def test_noisy_windows_widen_the_margin():
    base = trial([10.0, 13.0, 7.0, 10.0])
    assert not decide(base, trial([11.0, 14.0, 8.0, 11.0])).kept  # +10%, but the windows scatter by 30%
    assert decide(trial([10.0] * 4), trial([10.0 * (1 + 2 * MIN_GAIN)] * 4)).kept  # quiet: the floor is MIN_GAIN


def test_the_same_rate_for_clearly_less_cpu_is_kept_a_sliver_less_is_not():
    base = trial([10.0, 10.1, 9.9, 10.0], cpu=180.0)
    cheaper = decide(base, trial([10.0, 10.1, 9.9, 10.0], cpu=120.0))
    assert cheaper.kept and "CPU" in cheaper.reason
    assert not decide(base, trial([10.0, 10.1, 9.9, 10.0], cpu=175.0)).kept


# -- the model --------------------------------------------------------------------------
def test_batch_items_counts_tasks_per_training_batch():
    w = World({"read": Law(4, 0.01), "decode": Law(4, 0.01)}, step_s=0.01, batch=8)
    p = w.pipeline().map(abs, name="collate")
    assert batch_items(p) == {"read": 8.0, "decode": 8.0, "collate": 1.0}


def test_the_model_learns_how_task_time_grows_with_concurrency():
    w = World({"decode": Law(4, 0.01, alpha=1.0)}, step_s=0.001)
    model = RateModel(w.pipeline(), cores=2)
    for c in (1, 2):
        model.observe(w.measure(Config.of("thread", {"decode": c})))
    assert model.alpha("threads", "decode") == pytest.approx(1.0, abs=0.05)
    # Flat under threads: four threads are predicted no faster than one.
    one = model.predict(Config.of("thread", {"decode": 1})).batches_per_s
    assert model.predict(Config.of("thread", {"decode": 4})).batches_per_s == pytest.approx(one, rel=0.05)


def test_the_limit_is_the_slowest_of_stages_step_and_cores():
    w = World({"read": Law(4, 0.02), "decode": Law(4, 0.001, cpu=1.0)}, step_s=0.005)
    model = RateModel(w.pipeline(), cores=2)
    model.observe(w.measure(Config.of("thread", {"read": 1, "decode": 1})))
    assert model.predict(Config.of("thread", {"read": 1, "decode": 1})).limit == "read"
    assert model.predict(Config.of("thread", {"read": 64, "decode": 1})).limit in ("step", "decode")


# -- the climb ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, world", [
    ("io-bound stage: more threads", World({"read": Law(4, 0.02)}, step_s=0.01)),
    ("two stages, one cpu-bound", World({"read": Law(4, 0.01), "decode": Law(4, 0.004, cpu=1.0)}, step_s=0.004)),
    ("gil-bound decode: processes", World({"decode": Law(4, 0.003, alpha=1.0, cpu=1.0)}, step_s=0.002,
                                          gil_wait=0.6)),
    ("noisy neighbour: out of the interpreter", World({"read": Law(16, 0.002), "decode": Law(16, 0.001, alpha=1.0,
                                                       cpu=1.0)}, step_s=0.08, thread_step_slowdown=0.6)),
])
def test_the_climb_reaches_the_grid_best_in_a_quarter_of_its_trials(name, world):
    space = world.space()
    best_rate, grid_size = world.grid(space)
    best, steps, _ = run_climb(world, space.start("thread"))
    assert world.rate(best.config)[0] >= 0.95 * best_rate, (name, [s.sentence for s in steps])
    assert len(steps) <= 0.25 * grid_size, (name, len(steps), grid_size)


def test_every_move_shows_its_prediction_next_to_its_measurement():
    world = World({"read": Law(4, 0.02)}, step_s=0.01)
    _, steps, _ = run_climb(world, world.space().start("thread"))
    assert steps[0].sentence.startswith("started from thread read=1")
    for s in steps[1:]:
        assert "predicted" in s.sentence and "measured" in s.sentence and ("kept" in s.sentence
                                                                          or "reverted" in s.sentence)
        assert math.isfinite(s.predicted)


def test_the_limiting_stage_jumps_to_the_concurrency_that_lifts_it():
    world = World({"read": Law(4, 0.02)}, step_s=0.01)
    _, steps, _ = run_climb(world, world.space().start("thread"))
    first_move = steps[1]
    assert first_move.move.kind == "raise" and first_move.move.new >= 8, first_move.sentence
    assert first_move.kept


def test_the_gil_on_the_training_thread_makes_it_try_another_runner():
    world = World({"read": Law(16, 0.001), "decode": Law(16, 0.001, alpha=1.0, cpu=1.0)}, step_s=0.08,
                  thread_step_slowdown=0.6)
    best, steps, _ = run_climb(world, world.space().start("thread"))
    assert any(s.move.kind == "switch" for s in steps)
    assert best.config.runner != "thread", [s.sentence for s in steps]


def test_no_more_worker_processes_than_cores_unless_measured_to_help():
    # Processes scale until the cores are full, then not at all (the world's process law).
    world = World({"decode": Law(4, 0.003, alpha=1.0, cpu=0.3)}, step_s=0.001, cores=2)
    best, steps, space = run_climb(world, world.space(("process",)).start("process"), runners=("process",))
    for i, s in enumerate(steps):
        if s.trial.config.knob(WORKERS) > world.cores:
            earlier = [t.trial for t in steps[:i]]
            at_cores = [t.batches_per_s for t in earlier if t.config.knob(WORKERS) == world.cores]
            fewer = [t.batches_per_s for t in earlier if t.config.knob(WORKERS) < world.cores]
            assert at_cores and fewer and max(at_cores) > max(fewer), [t.sentence for t in steps]
    assert best.config.knob(WORKERS) <= world.cores
    # Never measured to help: a start at one worker, and a step-bound world, never go above the cores.
    world2 = World({"decode": Law(4, 0.001, cpu=1.0)}, step_s=0.02, cores=2)
    _, steps2, space2 = run_climb(world2, world2.space(("process",)).start("process"), runners=("process",))
    assert not space2.allow_more_workers
    assert all(s.trial.config.knob(WORKERS) <= world2.cores for s in steps2)


def test_a_converged_climb_stops_by_itself_and_measures_nothing_twice():
    world = World({"read": Law(4, 0.004)}, step_s=0.02)
    _, steps, _ = run_climb(world, world.space(("thread",)).start("thread"), runners=("thread",))
    configs = [s.trial.config for s in steps]
    assert len(configs) == len(set(configs))
    assert len(steps) <= 8


def test_a_runner_switch_also_offers_the_limiting_stage_raised_out_of_the_way():
    # The GIL says "leave the interpreter" at the start, where read (I/O, 1 thread) also limits:
    # subprocess-threads at the same threads is no faster than processes, with read raised it is.
    world = World({"read": Law(16, 0.004), "decode": Law(16, 0.0005, cpu=1.0)}, step_s=0.02,
                  thread_step_slowdown=0.6, batch=16)
    space = world.space()
    best_rate, _ = world.grid(space)
    best, steps, _ = run_climb(world, space.start("thread"))
    switches = [s for s in steps if s.move.kind == "switch" and s.trial.config.runner == "subprocess-threads"]
    assert any(s.trial.config.knob("read") > 1 for s in switches), [s.sentence for s in steps]
    assert best.config.runner == "subprocess-threads" and world.rate(best.config)[0] >= 0.95 * best_rate


def test_a_jump_is_followed_by_a_rung_down_of_the_same_knob_when_the_model_sees_no_loss():
    # The jump aims past the next limit (the core) with headroom; whether the headroom was needed
    # is measured: read 6 -> 4 (under the thread runner more threads can cost the step its GIL).
    world = World({"read": Law(4, 0.015), "decode": Law(4, 0.004, cpu=1.0)}, step_s=0.001, cores=1)
    _, steps, _ = run_climb(world, world.space().start("thread"))
    jump = steps[1]
    assert jump.move.kind == "raise" and jump.kept and "enough read workers" in jump.sentence
    after = steps[2]
    assert after.move.kind == "lower" and after.move.knob == "read" and after.move.old == jump.move.new, \
        [s.sentence for s in steps]
    assert "jumped past" in after.sentence
