"""The --help examples name the files the commands really write."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from spdl_lab import cli
from spdl_lab._diagnose.env_mode import ENV_REPORT_DIR

MODULE = "spdl_help_tiny"  # imported by no other test
SOURCE = textwrap.dedent('''
    import spdl_lab as lab

    def double(x):
        return 2 * x

    def make_pipeline():
        return lab.Pipeline(range(10**5)).map(double, concurrency=1, name="double").batch(2)
''')


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return capsys.readouterr().out


def _named_files(help_text: str, target: str) -> list[str]:
    """The paths after "(writes", with the example's target replaced by ``target``."""
    found = re.search(r"\(writes (\S+) and (\S+)\)", help_text)
    assert found, help_text
    example, ours = cli._stem(cli.EXAMPLE_TARGET), cli._stem(target)
    return [path.replace(example, ours) for path in found.groups()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command, options", [
    ("compare", ["--runners", "thread", "--steps", "3", "--warmup", "0"]),
    ("diagnose", ["--concurrency", "1", "--num-items", "4", "--no-processes"]),
])
def test_help_names_what_the_command_writes(command, options, tmp_path, monkeypatch, capsys):
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(ENV_REPORT_DIR, raising=False)
    sys.modules.pop(MODULE, None)
    target = f"{MODULE}:make_pipeline"
    paths = _named_files(_help(command, capsys), target)
    assert cli.main([command, target, *options]) == cli.EXIT_OK
    for path in paths:
        assert (tmp_path / path).is_file(), f"--help says {command} writes {path}; it did not"


def test_report_example_reads_what_diagnose_writes(capsys):
    diagnose_writes = _named_files(_help("diagnose", capsys), cli.EXAMPLE_TARGET)
    report_example = _help("report", capsys)
    json_file = next(p for p in diagnose_writes if p.endswith(".json"))
    assert f"spdl-lab report {json_file}" in report_example
