"""%load_ext spdl_lab: registration, name lookup and the three line magics."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("IPython")

from IPython.core.error import UsageError  # noqa: E402
from IPython.testing import globalipapp  # noqa: E402

import spdl_lab as lab  # noqa: E402
from spdl_lab._experiments.session import Session  # noqa: E402
from spdl_lab._magics import MAGICS, SpdlMagics  # noqa: E402

DASHBOARD = object()
OUR_VARS = ("pipe", "step", "wl", "spdl_session", "spdl_comparison", "mine")


@pytest.fixture(scope="module")
def shell():
    # Module-scoped so the shell's history thread predates every no_thread_leak check. Started once
    # per process: a second start_ipython() returns None, and under xdist a module's tests can be
    # split (this fixture made again); the module's get_ipython is the started shell's after it.
    globalipapp.start_ipython()
    return globalipapp.get_ipython()


@pytest.fixture
def ip(shell, monkeypatch):
    """The shell with spdl_lab loaded, a tiny pipeline and step defined, and no real dashboard."""
    monkeypatch.setattr(Session, "dashboard", lambda self: DASHBOARD)
    shell.run_line_magic("load_ext", "spdl_lab")
    shell.user_ns["pipe"] = lab.Pipeline(range(64)).map(lambda x: x * 2, concurrency=2, name="double").batch(8)
    shell.user_ns["step"] = lambda batch: None
    yield shell
    shell.run_line_magic("unload_ext", "spdl_lab")
    for name in OUR_VARS:
        shell.user_ns.pop(name, None)


def _registered(shell) -> list[str]:
    return [name for name in MAGICS if name in shell.magics_manager.magics["line"]]


def test_importing_spdl_lab_does_not_import_ipython():
    code = "import sys, spdl_lab; assert 'IPython' not in sys.modules, 'IPython was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_load_unload_and_load_again(shell):
    assert _registered(shell) == []
    shell.run_line_magic("load_ext", "spdl_lab")
    assert _registered(shell) == list(MAGICS)
    first = shell.magics_manager.registry[SpdlMagics.__name__]
    lab.load_ipython_extension(shell)  # a second load changes nothing
    assert shell.magics_manager.registry[SpdlMagics.__name__] is first
    assert shell.magics_manager.magics["line"]["spdl_run"].__self__ is first

    shell.run_line_magic("unload_ext", "spdl_lab")
    assert _registered(shell) == []
    assert SpdlMagics.__name__ not in dict(shell.magics_manager.registry)
    lab.unload_ipython_extension(shell)  # unloading twice is harmless

    shell.run_line_magic("load_ext", "spdl_lab")
    assert _registered(shell) == list(MAGICS)
    shell.run_line_magic("unload_ext", "spdl_lab")


def test_spdl_info_prints_interpreter_version_and_runners(ip, capsys):
    ip.run_line_magic("spdl_info", "")
    out = capsys.readouterr().out
    assert "python " in out and "cpu cores" in out
    assert f"spdl_lab    {lab.__version__}; runners: {', '.join(lab.RUNNERS)}" in out


@pytest.mark.usefixtures("no_thread_leak", "no_child_leak")
@pytest.mark.parametrize("line", ["pipe --step step", "wl.pipeline --step wl.step"])
def test_spdl_run_starts_a_session_and_returns_the_dashboard(ip, line):
    ip.user_ns["wl"] = SimpleNamespace(pipeline=ip.user_ns["pipe"], step=ip.user_ns["step"])
    shown = ip.run_line_magic("spdl_run", f"{line} --steps 3 --runner thread")
    session = ip.user_ns["spdl_session"]
    try:
        assert shown is DASHBOARD
        assert isinstance(session, Session) and session.runner == "thread"
        assert session.wait(timeout=30) is True
        assert session.clock.steps == 3
    finally:
        session.stop()


@pytest.mark.usefixtures("no_thread_leak", "no_child_leak")
def test_spdl_run_without_a_dashboard_returns_the_session(ip, monkeypatch, capsys):
    def unavailable(self):
        raise lab.SpdlLabError("the dashboard is not available here: no ipywidgets")

    monkeypatch.setattr(Session, "dashboard", unavailable)
    shown = ip.run_line_magic("spdl_run", "pipe --step step --steps 2 --name mine")
    try:
        assert shown is ip.user_ns["mine"]
        assert shown.wait(timeout=30) is True
    finally:
        shown.stop()
    assert "no dashboard" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("pip --step step", r"no variable 'pip' in the notebook's namespace; define it first .*did you mean 'pipe'"),
        ("pipe --step stpe", r"no variable 'stpe'.*a function that takes a batch.*did you mean 'step'"),
        ("pipe.stages2 --step step", r"'pipe' \(Pipeline\) has no attribute 'stages2'"),
        ("pipe[0] --step step", r"'pipe\[0\]' is not a variable name"),
        ("pipe --step step --runner gpu", r"unknown runner 'gpu'; choose from thread, subprocess-threads"),
        ("pipe --step step --name 1x", r"--name '1x' is not a valid variable name"),
        ("pipe", r"--step"),  # argparse: the step is required
        ("pipe --step step --steps many", r"invalid int value"),
    ],
)
def test_spdl_run_usage_errors(ip, line, message):
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("spdl_run", line)
    assert "spdl_session" not in ip.user_ns


def test_errors_from_run_and_compare_propagate(ip):
    with pytest.raises(lab.PipelineSpecError, match="steps must be"):
        ip.run_line_magic("spdl_run", "pipe --step step --steps 0")
    ip.user_ns["wl"] = SimpleNamespace(items=[1, 2])
    with pytest.raises(lab.PipelineSpecError, match="takes a lab.Pipeline"):
        ip.run_line_magic("spdl_compare", "wl.items --step step")


def test_spdl_compare_rejects_unknown_runners(ip):
    with pytest.raises(UsageError, match=r"unknown runner 'gpu', 'tpu'; choose from"):
        ip.run_line_magic("spdl_compare", "pipe --step step --runners thread gpu tpu")


@pytest.mark.usefixtures("no_thread_leak", "no_child_leak")
def test_spdl_compare_returns_and_stores_the_comparison(ip):
    cmp = ip.run_line_magic(
        "spdl_compare", "pipe --step step --runners thread cache --steps 3 --warmup 1 --no-progress"
    )
    assert isinstance(cmp, lab.Comparison)
    assert ip.user_ns["spdl_comparison"] is cmp
    assert list(cmp.table.index) == ["thread", "cache"]
    assert (cmp.table["steps"] == 3).all()
    assert "<table" in cmp._repr_html_()


def test_spdl_attach_shows_a_published_runs_dashboard(ip, monkeypatch, tmp_path):
    from spdl_lab._watch.attach import RemoteSession
    from spdl_lab._watch.publish import unpublish

    monkeypatch.setenv("SPDL_LAB_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("SPDL_LAB_RECORD", str(tmp_path / "run.sqlite"))
    monkeypatch.setattr(RemoteSession, "dashboard", lambda self: DASHBOARD)
    session = lab.publish(lab.run(lab.Pipeline(range(10**6)).batch(4), step=lambda b: None, duration=30),
                          name="inproc")
    try:
        assert ip.run_line_magic("spdl_attach", "inproc --name mine") is DASHBOARD
        remote = ip.user_ns["mine"]
        assert isinstance(remote, RemoteSession) and remote.name == "inproc"
        remote.close()
        with pytest.raises(UsageError, match="no published run 'ghost'"):
            ip.run_line_magic("spdl_attach", "ghost --timeout 0.1")
    finally:
        session.stop()
        unpublish(session)
