"""runner="process" in a script without an ``if __name__ == "__main__":`` guard.

spawn re-runs the main script in every worker; the process runner's workers need
nothing from it (the pipeline travels by value), so they do not run it again.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os
    import spdl_lab as lab

    print("top-level", os.getpid(), flush=True)

    def double(x):
        return 2 * x

    p = lab.Pipeline(range(40)).map(double, concurrency=2, name="double").batch(4)
    with lab.Loader(p, runner="process", num_workers=2) as loader:
        total = sum(sum(b) for b in loader)
    print("total", total, flush=True)
''')


@pytest.mark.timeout(120)
def test_a_script_without_a_main_guard_runs_and_its_top_level_runs_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("top-level") for line in lines) == 1, done.stdout
    assert "total 1560" in lines
