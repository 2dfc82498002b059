"""The spdl-lab command: help, info, compare and report end to end, and usage errors that exit 2."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import spdl_lab as lab
from spdl_lab import _cli_inputs as cli_inputs
from spdl_lab import cli
from spdl_lab._diagnose.env_mode import ENV, ENV_REPORT_DIR, EXIT_STATUS
from spdl_lab._diagnose.result import Diagnosis, Point, StageDiagnosis
from spdl_lab.cli import main

COMMANDS = ["info", "demo", "compare", "diagnose", "tune", "watch", "report"]
MODULE = "spdl_cli_tiny"  # a name no other test imports, so sys.modules holds only ours

TINY = textwrap.dedent('''
    import time
    import spdl_lab as lab

    def slow(x):
        time.sleep(0.002)
        return x

    def make_pipeline():
        return lab.Pipeline(range(10**6)).map(slow, concurrency=2, name="slow").batch(2)

    def step(batch):
        time.sleep(0.001)

    def fails(x):
        raise KeyError("no such item")

    failing = lab.Pipeline(range(100)).map(fails, name="lookup").batch(2)
    number = 42

    def broken():
        raise RuntimeError("the factory broke")
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
    folder = tmp_path_factory.mktemp("tiny")
    (folder / f"{MODULE}.py").write_text(TINY, encoding="utf-8")
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop(MODULE, None)


def no_external_scripts(html: str) -> None:
    assert not re.search(r"<script[^>]*\bsrc\s*=", html, re.IGNORECASE), "a script loads from elsewhere"
    assert "cdn.bokeh.org" not in html and "<link" not in html
    assert "Bokeh" in html  # BokehJS itself, inline


def options_of(command: str) -> list[str]:
    """What ``--help`` must name: every option string and positional of the subcommand."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    names = []
    for action in sub._actions:
        names += action.option_strings or [action.metavar or action.dest]
    return names


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_help_with_its_arguments_and_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: spdl-lab {command}" in out and "example:" in out and f"spdl-lab {command}" in out
    for name in options_of(command):
        assert name in out, f"{command} --help does not name {name}"


def test_top_level_help_lists_commands_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out
    assert cli.EXIT_CODES.strip() in out
    for code in ("0 ", f"{EXIT_STATUS} ", "2 ", "3 ", "130 "):
        assert f"\n  {code}" in cli.EXIT_CODES
    assert ENV in cli.EXIT_CODES  # diagnostic mode's exit 1 is tested in test_diagnose.py


def test_module_docstring_says_what_help_says():
    assert cli.EXIT_CODES.strip() in cli.__doc__


def test_python_m_spdl_lab_runs_the_same_command():
    done = subprocess.run([sys.executable, "-m", "spdl_lab", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: spdl-lab" in done.stdout and "report" in done.stdout


def test_info_runs(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "python" in out and "GIL" in out and "runners: thread" in out


@pytest.fixture(scope="module")
def compared(tiny, tmp_path_factory) -> tuple[Path, Path, str]:
    """``spdl-lab compare`` on the tiny pipeline, thread and cache, a few steps: (html, json, stdout)."""
    out = tmp_path_factory.mktemp("compare")
    html, data = out / "reports" / "cmp.html", out / "reports" / "cmp.json"
    buffer = io.StringIO()  # capsys is per test; this fixture runs once for the module
    with contextlib.redirect_stdout(buffer):
        code = main(["compare", f"{MODULE}:make_pipeline", "--step", f"{MODULE}:step", "--runners", "thread",
                     "cache", "--steps", "8", "--warmup", "1", "--report", str(html), "--json", str(data),
                     "--quiet"])
    assert code == 0
    return html, data, buffer.getvalue()


@pytest.mark.timeout(120)
def test_compare_prints_the_table_and_writes_report_and_json(compared):
    html, data, out = compared
    assert "vs cache [lo-hi]" in out and "thread" in out
    assert f"report: {html.resolve()}" in out and f"data:   {data.resolve()}" in out
    no_external_scripts(html.read_text(encoding="utf-8"))
    cmp = lab.Comparison.from_json(data)
    assert list(cmp.table.index) == ["thread", "cache"] and (cmp.table["steps"] == 8).all()


@pytest.mark.timeout(120)
def test_report_renders_a_saved_comparison(compared, tmp_path, capsys):
    _, data, _ = compared
    out = tmp_path / "again.html"
    assert main(["report", str(data), "-o", str(out)]) == 0
    assert f"report: {out.resolve()}" in capsys.readouterr().out
    page = out.read_text(encoding="utf-8")
    no_external_scripts(page)
    assert "cmp.json" in page and "thread" in page


def small_diagnosis() -> Diagnosis:
    points = tuple(Point("read", "thread", c, 100.0 * c, 0.02, 0.05, 0.01, 0.0, 10.0, 3) for c in (1, 2, 4))
    read = StageDiagnosis("read", "map", "scales", 4, "QPS grew 4x from 1 to 4 threads at 5% CPU.",
                          "Keep threads; set concurrency=4.", points=points, inputs=16, outputs=16)
    return Diagnosis(pipeline="Pipeline(range(16)).map(read)", stages={"read": read},
                     settings={"concurrency": [1, 2, 4]}, machine={"cores": 2}, created="2025-01-02T03:04:05",
                     elapsed_s=3.5)


def test_report_renders_a_saved_diagnosis_beside_it(tmp_path, capsys):
    data = small_diagnosis().to_json(tmp_path / "diag.json")
    assert main(["report", str(data)]) == 0
    out = capsys.readouterr().out
    page = (tmp_path / "diag.html").read_text(encoding="utf-8")
    no_external_scripts(page)
    assert "scales" in page and "read" in out and "report:" in out


def hostile_comparison(tmp_path: Path) -> Path:
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps({"format": "spdl_lab.comparison", "version": 1, "steps": 1, "warmup": 0,
                                "table": [], "frames": {}, "__reduce__": ["os.system", "id"]}))
    return path


def unknown_format(tmp_path: Path) -> Path:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": "pickle", "version": 1}))
    return path


def a_folder(tmp_path: Path) -> Path:
    (tmp_path / "taken").mkdir()
    return tmp_path / "taken"


USAGE_ERRORS = {
    "no colon": (["compare", "no_colon"], "expected module:attr"),
    "no such module": (["compare", "spdl_cli_no_such_module:p"], "cannot import 'spdl_cli_no_such_module'"),
    "no such attribute": (["compare", f"{MODULE}:nothing"], "has no attribute 'nothing'"),
    "not a pipeline": (["compare", f"{MODULE}:number"], "is an int; expected a lab.Pipeline"),
    "factory raises": (["compare", f"{MODULE}:broken"], "raised RuntimeError: the factory broke"),
    "bad simulated step": (["compare", f"{MODULE}:make_pipeline", "--step", "simulated:fast"],
                           "expected simulated:STEP_MS"),
    "step not callable": (["compare", f"{MODULE}:make_pipeline", "--step", f"{MODULE}:number"],
                          "expected a callable taking a batch"),
    "report is a folder": (["compare", f"{MODULE}:make_pipeline", "--report", a_folder],
                           "is a folder; give a file name"),
    "diagnose: no such attribute": (["diagnose", f"{MODULE}:nothing"], "has no attribute"),
    "missing file": (["report", lambda tmp: tmp / "nope.json"], "no such file"),
    "not JSON": (["report", lambda tmp: Path(__file__)], "not valid JSON"),
    "unknown format": (["report", unknown_format],
                       "format: expected 'spdl_lab.diagnosis' or 'spdl_lab.comparison', got string 'pickle'"),
    "hostile comparison": (["report", hostile_comparison], "__reduce__: Unexpected keyword argument"),
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_usage_error_exits_2_with_one_line(tiny, tmp_path, capsys, default_reports, case):
    argv, fragment = USAGE_ERRORS[case]
    argv = [str(a(tmp_path)) if callable(a) else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spdl-lab {argv[0]}: error: ") and err.count("\n") == 1, err
    assert fragment in err and "Traceback" not in err
    assert not default_reports.exists()  # refused before anything was written


@pytest.mark.parametrize("argv, fragment", [
    (["compare", "m:p", "--steps", "0"], "--steps: expected a whole number >= 1"),
    (["compare", "m:p", "--runners", "gpu"], "invalid choice: 'gpu'"),
    (["compare", "m:p", "--timeout", "never"], "--timeout: expected a number of seconds"),
    (["diagnose", "m:p", "--concurrency", "0"], "expected a whole number >= 1 and <= 1024"),
    (["compare"], "the following arguments are required: TARGET"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_option_exits_2_through_argparse(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_thread_leak", "no_child_leak")
def test_a_failing_pipeline_exits_3_with_its_traceback(tiny, tmp_path, capsys):
    code = main(["compare", f"{MODULE}:failing", "--step", f"{MODULE}:step", "--runners", "thread",
                 "--steps", "3", "--warmup", "0", "--report", str(tmp_path / "r.html"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 3
    assert "Traceback" in err and "no such item" in err
    assert err.strip().splitlines()[-1].startswith("spdl-lab compare: failed: ")


def test_simulated_step_lasts_what_it_says():
    device = cli_inputs.load_step("simulated:2")
    assert isinstance(device, lab.SimulatedDevice)
    assert device.kernels * device.kernel_us == pytest.approx(2000.0)
    assert device.launch_us < device.kernel_us  # the default ratio: the stream stays fed
    default = cli_inputs.load_step(cli.DEFAULT_STEP)
    assert default.kernels * default.kernel_us == pytest.approx(20_000)


def test_progress_bars_show_on_a_terminal_unless_quiet(monkeypatch):
    class Terminal:
        def isatty(self) -> bool:
            return True

    args = cli.build_parser().parse_args(["compare", "m:p"])
    assert cli._progress(args) is False  # pytest's stderr is no terminal: no bar in logs
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert cli._progress(args) is True
    args = cli.build_parser().parse_args(["compare", "m:p", "--quiet"])
    assert cli._progress(args) is False


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_thread_leak", "no_child_leak")
def test_diagnose_of_a_raising_stage_exits_3_and_gives_it_no_verdict(tiny, tmp_path, capsys):
    code = main(["diagnose", f"{MODULE}:failing", "--concurrency", "1", "2", "--num-items", "20",
                 "--no-processes", "--report-dir", str(tmp_path), "--quiet"])
    captured = capsys.readouterr()
    assert code == 3, captured.err
    assert "failed: KeyError on 20 of 20 inputs" in captured.out
    assert "no such item" in captured.err  # the first traceback
    assert captured.err.strip().splitlines()[-1].startswith("spdl-lab diagnose: failed: 1 stage(s) raised")
    saved = lab.Diagnosis.from_json(next(tmp_path.glob("*.json")))
    assert saved.stages["lookup"].verdict is None and saved.stages["lookup"].status == "failed"
