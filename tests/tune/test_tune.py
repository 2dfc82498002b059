"""lab.tune on real runners: bad input, a step that raises, the result as data (JSON, code, HTML)."""

from __future__ import annotations

import json
import math
import time

import pytest

import spdl_lab as lab
from spdl_lab._tune.result import TRIAL_COLUMNS, TuningFormatError
from spdl_lab.errors import PipelineSpecError, SpdlLabError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_thread_leak", "no_child_leak")]


def sleepy(i):
    time.sleep(0.005)
    return i


def step(batch):
    time.sleep(0.002)


def pipeline():
    return lab.Pipeline(range(10**7)).map(sleepy, concurrency=1, name="read").batch(4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(runners=("thread", "warp")), "unknown runner 'warp'"),
    (dict(runners=("cache",)), "not a way to load"),
    (dict(runners=()), "at least one"),
    (dict(runners=("thread", "thread")), "each runner once"),
    (dict(budget_s=0), "budget_s must be a number of seconds > 0"),
    (dict(budget_s=-5), "budget_s"),
    (dict(budget_s=math.inf), "budget_s"),
    (dict(budget_s="60"), "budget_s"),
    (dict(start="process", runners=("thread",)), "start must be one of runners"),
    (dict(start={"runner": "thread", "concurrency": {"nope": 2}}), "unknown stage"),
])
def test_bad_input_is_refused_before_anything_runs(kwargs, match):
    with pytest.raises(PipelineSpecError, match=match):
        lab.tune(pipeline(), step, progress=False, **kwargs)


def test_what_is_not_a_pipeline_or_a_step_is_named():
    with pytest.raises(PipelineSpecError, match="lab.Pipeline or a torch DataLoader, got list"):
        lab.tune([1, 2, 3], step)
    with pytest.raises(PipelineSpecError, match="step must be a callable"):
        lab.tune(pipeline(), step=42)
    with pytest.raises(PipelineSpecError, match="no map stage"):
        lab.tune(lab.Pipeline(range(100)).batch(4), step)


def test_a_step_that_raises_ends_the_tuning_with_its_error_and_nothing_left_running():
    def broken(batch):
        raise ValueError("loss is NaN")

    with pytest.raises(SpdlLabError, match="loss is NaN"):
        lab.tune(pipeline(), broken, budget_s=10, progress=False)


def test_a_stage_that_raises_names_the_stage():
    def bad(i):
        raise KeyError(i)

    p = lab.Pipeline(range(100)).map(bad, name="decode").batch(2)
    with pytest.raises(SpdlLabError, match="decode"):
        lab.tune(p, step, budget_s=10, progress=False)


@pytest.fixture(scope="module")
def tuning():
    return lab.tune(pipeline(), step, runners=("thread", "subprocess-threads"), budget_s=12, progress=False)


def test_a_short_tuning_returns_data_a_user_can_act_on(tuning):
    assert tuning.best["runner"] in ("thread", "subprocess-threads")
    assert tuning.best["concurrency"]["read"] >= 1 and tuning.best["options"] == {}
    assert list(tuning.trials.columns) == TRIAL_COLUMNS
    assert tuning.trials["kept"].iloc[0] and tuning.trials["move"].iloc[0].startswith("started from")
    # (after a word on the machine, if other processes were busy before it measured)
    assert next(line for line in tuning.log if line.startswith("started from")).startswith("started from thread read=1")
    assert any(line.startswith("stopped:") for line in tuning.log)
    assert tuning.speedup > 0
    # The trials never show what cannot be.
    t = tuning.trials
    assert (t["batches_per_s"] > 0).all() and (t["data_wait_frac"].between(0, 1)).all()
    assert (t["cpu_percent"] <= 100 * tuning.cores).all() and (t["spread"] >= 0).all()


def test_the_code_builds_the_tuned_loader(tuning):
    namespace = {"p": pipeline()}
    exec(compile(tuning.code, "<tuning.code>", "exec"), namespace)  # noqa: S102 - our own generated code
    loader = namespace["loader"]
    try:
        assert loader.runner == tuning.best["runner"]
        assert loader.controls() == tuning.best["concurrency"]
    finally:
        loader.close()
    with tuning.loader() as loader:
        assert next(iter(loader)) is not None


def test_json_round_trip_and_the_reader_refuses_what_does_not_fit(tuning, tmp_path):
    path = tuning.to_json(tmp_path / "t.json")
    back = lab.Tuning.from_json(path)
    assert back.best == tuning.best and back.log == tuning.log and back.code == tuning.code
    assert back.trials["batches_per_s"].tolist() == pytest.approx(tuning.trials["batches_per_s"].tolist())
    with pytest.raises(PipelineSpecError, match="pass it"):
        back.loader()
    doc = json.loads(path.read_text())
    doc["trials"][0]["data_wait_frac"] = 7
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(TuningFormatError, match=r"trials\[0\]\.data_wait_frac"):
        lab.Tuning.from_json(bad)
    doc = json.loads(path.read_text())
    doc["best"]["runner"] = "rm -rf"
    bad.write_text(json.dumps(doc))
    with pytest.raises(TuningFormatError, match="best.runner"):
        lab.Tuning.from_json(bad)


def test_the_html_report_is_self_contained_and_escapes_the_log(tuning, tmp_path):
    tuning.log.append("<script>alert(1)</script>")
    try:
        page = tuning.to_html(tmp_path / "t.html").read_text()
    finally:
        tuning.log.pop()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page
    assert "cdn.bokeh.org" not in page and "Bokeh" in page
    assert tuning.best["runner"] in tuning._repr_html_()


def test_a_dataloader_starts_as_itself_and_comes_back_as_keyword_arguments():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            time.sleep(0.002)
            return torch.zeros(4)

    dl = DataLoader(Slow(), batch_size=4, num_workers=1)
    tuning = lab.tune(dl, step, runners=("process",), budget_s=12, progress=False)
    assert tuning.start["runner"] == "process" and tuning.start["options"]["num_workers"] == 1
    assert tuning.best["runner"] == "process"
    assert 1 <= tuning.best["options"]["num_workers"] <= 2 * tuning.cores
    assert "dataloader_kwargs = dict(num_workers=" in tuning.code
