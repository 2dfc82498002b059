"""Functions defined in a script's ``__main__`` (as in a notebook) work across processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import spdl_lab as lab

    SCALE = 3

    def scale(x):                       # a plain function of __main__
        return np.full(4, x * SCALE)

    def make_adder(k):                  # a closure
        return lambda a: a + k

    def main():
        p = (lab.Pipeline(range(20)).map(scale, concurrency=2)
               .map(make_adder(1), name="add").batch(5).map(lambda b: int(np.sum(b)), name="total"))
        with lab.Loader(p, runner=RUNNER, **OPTIONS) as loader:
            print(sorted(loader))
    """
)

# subprocess-threads starts a fresh interpreter that never imports the user's
# script, so it needs no guard; DataLoader's spawn workers re-import __main__,
# so (as with torch today) a script needs `if __name__ == "__main__":`.
GUARDED = 'if __name__ == "__main__":\n    main()\n'
UNGUARDED = "main()\n"


@pytest.mark.parametrize(
    "runner, options, tail",
    [("subprocess-threads", "{}", UNGUARDED), ("process", "{'num_workers': 2}", GUARDED)],
)
def test_main_module_functions_cross_processes(tmp_path, runner, options, tail):
    script = tmp_path / "user_script.py"
    script.write_text(f"RUNNER = {runner!r}\nOPTIONS = {options}\n" + SCRIPT + tail)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    expected = sorted(sum((x * 3 + 1) * 4 for x in range(i, i + 5)) for i in range(0, 20, 5))
    assert done.stdout.strip() == str(expected)
