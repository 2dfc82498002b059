"""lab.diagnose end to end: verdicts on functions with known behaviour, robustness, no-code-change mode."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import spdl_lab as lab
from spdl_lab._diagnose._sweep import StageFeed, StageSweep, SweepSettings
from spdl_lab._diagnose.measure import StageRun, _judge, _Pass
from spdl_lab._diagnose.result import Point
from spdl_lab._pipeline import Stage
from spdl_lab.cli import main as cli_main

sys.path.insert(0, str(Path(__file__).parent))
import battery_stages as b  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")

FAST = SweepSettings(warmup_s=0.2, window_s=0.3, min_windows=3, max_windows=5, point_timeout_s=5.0)
HERE = Path(__file__).parent


BATTERY = {
    "pure_python": (b.pure_python, "gil-bound"),
    "sleeps": (b.sleeps, "scales"),
    "compresses": (b.compresses, "cpu-bound"),
    "hashes": (b.hashes, "cpu-bound"),
    "locked": (b.locked, "contended"),
    "legacy_rng": (b.legacy_rng, "contended"),
}


def busy(stage) -> bool:
    """The stage was measured while other processes took the cores, and says so in place of a verdict."""
    return (stage.status == "unstable" and stage.verdict is None
            and stage.evidence.startswith("unstable: the machine was busy (other processes used "))


def _battery(names):
    p = lab.Pipeline(range(32))
    for name in names:
        p = p.map(BATTERY[name][0], name=name)
    return lab.diagnose(p, (1, 2, 4), num_items=32, processes=False, settings=FAST, progress=False)


@pytest.mark.measurement
@pytest.mark.timeout(300)
def test_battery_verdicts():
    diag = _battery(list(BATTERY))
    wrong = [n for n, s in diag.stages.items() if s.verdict != BATTERY[n][1]]
    if wrong:
        # Another process taking a core for a second can mislead one sweep (the
        # evidence then says so); a wrong rule is wrong twice.
        again = _battery(wrong)
        still = {n: s.verdict for n, s in again.stages.items() if s.verdict != BATTERY[n][1]}
        assert not still, f"{still}\n{diag.summary()}\n{again.summary()}"
    assert diag.stages["sleeps"].best_concurrency == 4
    table = diag.table
    assert list(table.columns[:9]) == ["stage", "executor", "concurrency", "qps", "cpu_util",
                                       "gil_wait_frac", "runqueue_wait_frac", "p50_ms", "repeats"]
    assert len(table) == 18 and (table["repeats"] >= 3).all()


@pytest.mark.timeout(120)
def test_gil_bound_stage_gets_a_process_sweep_that_says_processes_help():
    p = lab.Pipeline(range(16)).map(b.pure_python, name="parse")
    diag = lab.diagnose(p, (1, 2), num_items=16, settings=FAST, progress=False)
    stage = diag.stages["parse"]
    if busy(stage):  # other processes (the unit set runs in parallel) took the cores: no verdict
        return
    assert stage.verdict == "gil-bound", diag.summary()
    assert [pt.concurrency for pt in stage.points if pt.executor == "process"] == [1, 2]
    assert "worker process" in " ".join(stage.notes)  # the numbers live in the details
    assert len(stage.evidence) < 160


def _diagnose_a_hanging_stage() -> tuple[lab.Diagnosis, float]:
    release = threading.Event()

    def hangs_on_third(x):
        if x == 3:
            release.wait()
        return x

    p = (lab.Pipeline(range(8)).map(lambda x: x + 1, name="ok")
         .map(hangs_on_third, name="hangs").map(lambda x: x, name="after"))
    settings = SweepSettings(warmup_s=0.1, window_s=0.2, point_timeout_s=1.0)
    t0 = time.monotonic()
    try:
        diag = lab.diagnose(p, (1, 2), num_items=8, settings=settings, processes=False, progress=False)
    finally:
        release.set()
    return diag, time.monotonic() - t0


# One run checks the report and how soon it came (a timing assert: the measurement set).
@pytest.mark.measurement
@pytest.mark.timeout(60)
def test_a_hanging_stage_is_cut_off_in_time_and_the_rest_reported():
    diag, elapsed = _diagnose_a_hanging_stage()
    assert diag.stages["ok"].verdict is not None
    hang = diag.stages["hangs"]
    assert hang.verdict is None and "did not finish within 1 s" in hang.error
    assert diag.stages["after"].error.startswith("not measured: no inputs: stage 'hangs'")
    assert elapsed < 30


@pytest.mark.timeout(60)
def test_raising_dropping_and_batch_stages():
    def odd_fails(x):
        if x % 2:
            raise ValueError(f"odd item {x}")
        return x

    def always_fails(batch):
        raise ZeroDivisionError("boom")

    p = (lab.Pipeline(range(20)).map(odd_fails, name="drops").batch(4, drop_last=True, name="group")
         .map(lambda batch: sum(batch), name="total").map(always_fails, name="fails")
         .map(lambda x: x, name="after"))
    diag = lab.diagnose(p, (1, 2), num_items=20, settings=FAST, processes=False, progress=False)
    drops = diag.stages["drops"]
    assert (drops.inputs, drops.outputs) == (20, 10)
    # A stage that raised gets no verdict (timing its exceptions would measure the error path).
    assert drops.verdict is None and drops.status == "failed"
    assert drops.evidence == "failed: ValueError on 10 of 20 inputs" and "ValueError" in drops.error
    group = diag.stages["group"]
    assert (group.kind, group.inputs, group.outputs, group.verdict) == ("batch", 10, 2, None)
    assert diag.stages["total"].inputs == 2 and diag.stages["total"].status in ("measured", "unstable")
    fails = diag.stages["fails"]
    assert fails.verdict is None and "ZeroDivisionError: boom" in fails.error
    assert diag.stages["after"].error.startswith("not measured")


def test_bad_arguments_are_refused_with_the_fix():
    p = lab.Pipeline(range(4)).map(lambda x: x, name="f")
    for bad in [(), (0,), ("2",), (True,), 4]:
        with pytest.raises(lab.PipelineSpecError, match="concurrency must be ints in 1..1024"):
            lab.diagnose(p, bad)
    with pytest.raises(lab.PipelineSpecError, match="num_items must be an int >= 1"):
        lab.diagnose(p, num_items=0)
    with pytest.raises(lab.PipelineSpecError, match="diagnose takes a lab.Pipeline"):
        lab.diagnose([1, 2, 3])
    with pytest.raises(lab.PipelineSpecError, match="the source produced no items"):
        lab.diagnose(lab.Pipeline([]).map(lambda x: x), progress=False)

    def broken():
        yield 1
        raise OSError("disk gone")

    with pytest.raises(lab.PipelineError, match="the source raised .*OSError: disk gone"):
        lab.diagnose(lab.Pipeline(broken).map(lambda x: x), num_items=5, progress=False)


def test_json_round_trip_of_a_real_diagnosis(tmp_path):
    p = lab.Pipeline(range(8)).map(b.sleeps, name="fetch")
    diag = lab.diagnose(p, (1, 2), num_items=8, settings=FAST, progress=False)
    back = lab.Diagnosis.from_json(diag.to_json(tmp_path / "d.json"))
    assert back.stages["fetch"].verdict == diag.stages["fetch"].verdict
    assert back.table.equals(diag.table) or back.table.shape == diag.table.shape
    html = diag.to_html(tmp_path / "d.html").read_text()
    assert "fetch" in html and "<script src=" not in html  # INLINE: nothing fetched


SCRIPT = """
import spdl_lab as lab
import battery_stages as b

with lab.Loader(b.sleepy_pipeline(), runner="{runner}") as loader:
    for batch in loader:
        raise SystemExit("diagnostic mode should have exited before the first batch")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("runner", ["thread", "subprocess-threads"])
def test_env_var_mode_diagnoses_instead_and_exits_1(tmp_path, runner):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(runner=runner))
    env = {**os.environ, "SPDL_PIPELINE_DIAGNOSTIC_MODE": "1", "SPDL_PIPELINE_DIAGNOSTIC_MODE_NUM_ITEMS": "12",
           "SPDL_PIPELINE_DIAGNOSTIC_MODE_CONCURRENCY": "1,2", "SPDL_LAB_REPORT_DIR": str(tmp_path / "reports"),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "diagnosing the pipeline instead of running it (12 inputs, concurrency 1, 2)" in done.stdout
    # Its verdict, or that other processes took the cores (the unit set runs in parallel).
    assert "fetch" in done.stdout and ("scales" in done.stdout or "unstable" in done.stdout), done.stdout
    reports = sorted((tmp_path / "reports").iterdir())
    assert [r.suffix for r in reports] == [".html", ".json"]
    assert f"report: {reports[0]}" in done.stdout
    data = json.loads(reports[1].read_text())
    assert data["settings"]["num_items"] == 12


def test_env_var_mode_rejects_bad_values(monkeypatch):
    monkeypatch.setenv("SPDL_PIPELINE_DIAGNOSTIC_MODE", "maybe")
    with pytest.raises(lab.PipelineSpecError, match="set it to 1 .on. or 0 .off."):
        iter(lab.Loader(b.sleepy_pipeline()))
    monkeypatch.setenv("SPDL_PIPELINE_DIAGNOSTIC_MODE", "1")
    monkeypatch.setenv("SPDL_PIPELINE_DIAGNOSTIC_MODE_NUM_ITEMS", "lots")
    with pytest.raises(lab.PipelineSpecError, match="expected a whole number"):
        lab.run(b.sleepy_pipeline(), lambda batch: None, steps=1)


@pytest.mark.timeout(120)
def test_cli_diagnose(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(HERE))
    code = cli_main(["diagnose", "battery_stages:sleepy_pipeline", "--concurrency", "1", "2",
                     "--num-items", "8", "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "fetch" in out and "report:" in out
    assert {p.suffix for p in tmp_path.iterdir()} == {".html", ".json"}
    assert cli_main(["diagnose", "battery_stages:nothing_here"]) == 2
    assert "has no attribute" in capsys.readouterr().err
    assert cli_main(["diagnose", "no_colon"]) == 2


# -- the evidence names points whose windows disagreed -------------------------------------

def _judged(spreads: list[float]) -> str:
    points = [Point(stage="parse", executor="thread", concurrency=c, qps=1000.0, qps_spread=s, cpu_util=0.5,
                    gil_wait_frac=0.6, runqueue_wait_frac=0.0, p50_ms=1.0, repeats=10, status="unstable")
              for c, s in zip((1, 2, 4), spreads)]
    once = StageRun(outputs=[0] * 10, ok_inputs=list(range(10)), failures=0, first_error=None, hung=False,
                    abandoned_threads=0)
    p = _Pass(Stage("parse", "map", 1, fn=abs), 10, StageFeed("parse", abs, list(range(10))), once)
    diag = _judge(p, StageSweep(points, abandoned=0, others=0.0), None, 2, SweepSettings())
    assert not math.isnan(diag.points[0].qps)
    # Unstable points give no advice: the stage must be measured again, and it says how.
    assert diag.status == "unstable" and diag.recommendation.startswith("measure again")
    assert "SweepSettings(max_windows=" in diag.recommendation
    return " ".join(diag.notes)


def test_evidence_names_points_whose_windows_differed() -> None:
    text = _judged([0.40, 0.10, 0.30])
    assert "The windows of 2 of its 3 thread points differed by more than 25% (up to 40% at concurrency 1)" in text
    assert "second-best window" in text


def test_evidence_is_quiet_about_quiet_points() -> None:
    assert "windows of" not in _judged([0.05, 0.10, float("nan")])


def _judged_under(others: float):
    """A stage whose points rose 3.5x with the GIL free (``scales`` on a quiet machine), while other
    processes took ``others`` of the cores."""
    points = [Point(stage="fetch", executor="thread", concurrency=c, qps=q, qps_spread=0.02, cpu_util=0.05,
                    gil_wait_frac=0.01, runqueue_wait_frac=0.0, p50_ms=1.0, repeats=5, status="ok",
                    machine_cpu_util=0.05 + others)
              for c, q in ((1, 100.0), (2, 190.0), (4, 350.0))]
    once = StageRun(outputs=[0] * 10, ok_inputs=list(range(10)), failures=0, first_error=None, hung=False,
                    abandoned_threads=0)
    p = _Pass(Stage("fetch", "map", 1, fn=abs), 10, StageFeed("fetch", abs, list(range(10))), once)
    return _judge(p, StageSweep(points, abandoned=0, others=others), None, 2, SweepSettings())


def test_a_stage_measured_on_a_busy_machine_is_unstable_and_says_why_not_a_verdict() -> None:
    quiet = _judged_under(0.10)
    assert (quiet.status, quiet.verdict) == ("measured", "scales")
    stage = _judged_under(0.48)
    assert busy(stage) and stage.evidence == (
        "unstable: the machine was busy (other processes used 48% of the cores)")
    assert stage.recommendation == "diagnose it again on a quieter machine"
    assert any(n.startswith("Under that load it measured as scales") for n in stage.notes)
    diag = lab.Diagnosis(pipeline="p", stages={"fetch": stage}, machine={"cpu_cores": 2})
    assert diag.verdicts().loc["fetch", "verdict"] == "unstable"
    assert "(unstable)" in diag.headline() and "quieter machine" in diag.headline()
    assert "unstable" in diag.summary()
