"""pyproject.toml and environment.yml must list the same packages."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    name = re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0]
    return name.lower().replace("-", "_")


def _pyproject_packages() -> set[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return {_name(r) for r in reqs}


def _environment_packages() -> set[str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    names = set()
    for entry in env["dependencies"]:
        entries = entry["pip"] if isinstance(entry, dict) else [entry]
        for e in entries:
            if e in {"pip"} or e.startswith(("python", "-e")):
                continue
            names.add(_name(e))
    return names


def test_environment_yml_matches_pyproject():
    assert _pyproject_packages() == _environment_packages()


def test_readme_opens_with_the_two_commands():
    head = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    assert "make lab" in head and "make test" in head


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_public_namespace_is_the_api():
    """``dir(lab)`` shows the API, the package's modules and the IPython hooks, nothing borrowed
    (``lab.Any`` or ``lab.annotations`` would look like part of the API)."""
    import types

    import spdl_lab as lab

    hooks = {"load_ipython_extension", "unload_ipython_extension"}
    stray = [n for n in dir(lab) if not n.startswith("_") and n not in lab.__all__ and n not in hooks
             and not isinstance(getattr(lab, n), types.ModuleType)]
    assert stray == []


def test_the_public_names_are_sorted_and_curated():
    import spdl_lab as lab

    assert lab.__all__ == sorted(lab.__all__), "keep spdl_lab.__all__ sorted"
    assert all(hasattr(lab, name) for name in lab.__all__)
    assert "FileFormatError" in lab.__all__ and "Dashboard" not in lab.__all__


def test_import_star_loads_no_bokeh_and_no_torch():
    # torch comes with the process runner, when it is first used: every child interpreter that
    # imports spdl_lab (the subprocess-threads child, diagnose's) would otherwise pay ~2 s for it.
    code = ("import sys; from spdl_lab import *; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'bokeh', 'torch'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)
