"""spdl-lab tune: usage errors that exit 2, the trials table, and one real tuning end to end."""

from __future__ import annotations

import math
import re
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

import spdl_lab as lab
from spdl_lab import _cli_inputs as cli_tune
from spdl_lab import cli
from spdl_lab._diagnose.env_mode import ENV_REPORT_DIR
from spdl_lab.cli import main

MODULE = "spdl_cli_tune_tiny"  # imported by no other test

TINY = textwrap.dedent('''
    import time
    import spdl_lab as lab

    def slow(x):
        time.sleep(0.004)
        return x

    def make_pipeline():
        return lab.Pipeline(range(10**6)).map(slow, concurrency=1, name="slow").batch(2)

    def fails(x):
        raise KeyError("no such item")

    failing = lab.Pipeline(range(100)).map(fails, name="lookup").batch(2)
    number = 42
''')


@pytest.fixture(autouse=True)
def default_reports(tmp_path, monkeypatch) -> Path:
    """Where reports go when no path is given: never the folder the tests run in."""
    folder = tmp_path / "default_reports"
    monkeypatch.setenv(ENV_REPORT_DIR, str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A folder with the pipeline module on sys.path, as if spdl-lab ran beside it."""
    folder = tmp_path_factory.mktemp("tiny_tune")
    (folder / f"{MODULE}.py").write_text(TINY, encoding="utf-8")
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop(MODULE, None)


# -- usage errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["--runners", "gpu"], "--runners: unknown runner 'gpu'; choose from thread, subprocess-threads, process"),
    (["--runners", "thread,gpu"], "unknown runner 'gpu'"),
    (["--runners", "cache"], "it is the headspace, not a way to load"),
    (["--runners", ","], "--runners: expected runner names, got ','"),
    (["--start", "gpu"], "--start: invalid choice: 'gpu'"),
    (["--budget", "0"], "--budget: expected a number of seconds > 0, got '0'"),
    (["--budget", "-5"], "--budget: expected a number of seconds > 0, got '-5'"),
    (["--budget", "abc"], "--budget: expected a number of seconds > 0, got 'abc'"),
    (["--budget", "inf"], "--budget: expected a number of seconds > 0, got 'inf'"),
])
def test_a_bad_option_exits_2_through_argparse(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "m:p", *argv])
    assert exit_.value.code == cli.EXIT_USAGE
    assert fragment in capsys.readouterr().err


def test_a_missing_target_is_a_usage_error(capsys):
    assert main(["tune"]) == cli.EXIT_USAGE
    assert "give TARGET (module:attr naming a lab.Pipeline) to tune, or --script" in capsys.readouterr().err


USAGE_ERRORS = {
    "no colon": (["no_colon"], "expected module:attr"),
    "no such module": (["spdl_cli_tune_no_such_module:p"], "cannot import 'spdl_cli_tune_no_such_module'"),
    "no such attribute": ([f"{MODULE}:nothing"], "has no attribute 'nothing'"),
    "not a pipeline": ([f"{MODULE}:number"], "is an int; expected a lab.Pipeline"),
    "bad simulated step": ([f"{MODULE}:make_pipeline", "--step", "simulated:fast"], "expected simulated:STEP_MS"),
    "a runner twice": ([f"{MODULE}:make_pipeline", "--runners", "thread,process", "thread"],
                       "--runners names thread more than once"),
    "start not among runners": ([f"{MODULE}:make_pipeline", "--runners", "thread", "--start", "process"],
                                "--start process is not among --runners thread"),
    "output is a folder": ([f"{MODULE}:make_pipeline", "-o", lambda tmp: tmp], "is a folder; give a file name"),
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_a_usage_error_exits_2_with_one_line(tiny, tmp_path, capsys, default_reports, case):
    argv, fragment = USAGE_ERRORS[case]
    argv = ["tune", *(str(a(tmp_path)) if callable(a) else a for a in argv)]
    assert main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("spdl-lab tune: error: ") and err.count("\n") == 1, err
    assert fragment in err and "Traceback" not in err
    assert not default_reports.exists()  # refused before anything was written


def test_runners_are_named_by_spaces_or_commas():
    args = cli.build_parser().parse_args(["tune", "m:p", "--runners", "process,thread", "subprocess-threads"])
    assert cli_tune._runners(args.runners) == ["process", "thread", "subprocess-threads"]
    args = cli.build_parser().parse_args(["tune", "m:p"])
    assert cli_tune._runners(args.runners) == ["thread", "subprocess-threads", "process"]
    assert args.budget == cli_tune.DEFAULT_BUDGET_S and args.step == cli.DEFAULT_STEP


# -- the table -----------------------------------------------------------------------------------

def trials() -> pd.DataFrame:
    base = {"options": {}, "predicted_batches_per_s": math.nan, "step_p50_ms": 21.04, "data_wait_frac": 0.42,
            "cpu_percent": 95.4, "kept": True}
    return pd.DataFrame([
        {**base, "runner": "thread", "concurrency": {"read": 8, "decode": 2}, "batches_per_s": 30.5,
         "batches_per_s_lo": 29.0, "batches_per_s_hi": 31.2, "move": "started from thread read=8 decode=2"},
        {**base, "runner": "process", "concurrency": {"read": 2, "decode": 2}, "options": {"num_workers": 2},
         "batches_per_s": 41.0, "batches_per_s_lo": 41.0, "batches_per_s_hi": 41.0,
         "predicted_batches_per_s": 45.25, "move": "switched to process workers=2", "kept": False},
    ])


def test_the_table_has_a_column_per_heading_and_a_line_per_trial():
    lines = cli_tune.trials_table(trials()).splitlines()
    assert re.split(r"\s{2,}", lines[0]) == ["runner", "concurrency", "batches/s [lo-hi]", "predicted",
                                              "step p50 ms", "data wait", "CPU %", "others CPU %", "move", "kept"]
    assert re.split(r"\s{2,}", lines[1]) == ["thread", "read=8 decode=2", "30.5 [29-31.2]", "-", "21.0", "42%",
                                              "95", "-", "started from thread read=8 decode=2", "kept"]
    assert re.split(r"\s{2,}", lines[2]) == ["process", "workers=2", "41", "45.2", "21.0", "42%", "95", "-",
                                              "switched to process workers=2", "-"]
    for heading in ("concurrency", "move", "kept"):  # fixed width: text starts under its heading
        at = lines[0].index(heading)
        assert all(line[at - 2:at] == "  " and line[at] != " " for line in lines[1:]), heading
    end = lines[0].index("CPU %") + len("CPU %")  # and numbers end under theirs
    assert all(line[end - 1] != " " and line[end:end + 2] == "  " for line in lines[1:])


# -- real runs -----------------------------------------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.usefixtures("no_thread_leak", "no_child_leak")
def test_tune_prints_table_log_and_code_and_writes_the_report(tiny, tmp_path, capsys, default_reports):
    data = tmp_path / "tuning.json"
    # Threads only: starting worker processes on a busy machine can take longer than a trial may.
    code = main(["tune", f"{MODULE}:make_pipeline", "--step", "simulated:5", "--budget", "6",
                 "--runners", "thread", "--json", str(data), "--quiet"])
    captured = capsys.readouterr()
    assert code == cli.EXIT_OK, captured.err
    out = captured.out
    html = default_reports / f"tune-{MODULE}-make_pipeline.html"  # the folder the other subcommands use
    assert f"report: {html.resolve()}" in out and f"data:   {data.resolve()}" in out
    tuning = lab.Tuning.from_json(data)
    table = cli_tune.trials_table(tuning.trials)
    assert table in out and table.startswith("runner  concurrency  batches/s [lo-hi]")
    assert "started from thread slow=1" in out and "stopped: " in out  # the log
    # The advice (move, or keep what you have with the ratio) and why no move, if so.
    assert tuning.advice.startswith(("move to", "keep what you have")) and tuning.advice in out
    assert all(f"warning: {w}" in out for w in tuning.warnings)
    assert tuning.code in out and "loader = lab.Loader(" in out
    order = [out.index(part) for part in (table, "stopped: ", tuning.code, "report: ")]
    assert order == sorted(order)
    page = html.read_text(encoding="utf-8")
    assert "Bokeh" in page and not re.search(r"<script[^>]*\bsrc\s*=", page, re.IGNORECASE)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_thread_leak", "no_child_leak")
def test_a_failing_pipeline_exits_3_with_its_traceback(tiny, tmp_path, capsys):
    code = main(["tune", f"{MODULE}:failing", "--step", "simulated:5", "--budget", "6", "--runners", "thread",
                 "-o", str(tmp_path / "t.html"), "--quiet"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILED
    assert "Traceback" in err and "no such item" in err
    assert err.strip().splitlines()[-1].startswith("spdl-lab tune: failed: ")
    assert not (tmp_path / "t.html").exists()
