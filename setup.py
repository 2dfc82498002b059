"""Everything is in pyproject.toml; this only ships ``spdl_lab_watch.pth`` at the top of
site-packages (the ``SPDL_LAB_WATCH=1`` hook, see ``spdl_lab/_watch/hook.py``). An editable
install (``make venv``) copies it there itself, as setuptools' editable wheels leave it out."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "spdl_lab_watch.pth"


class BuildPyWithHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithHook})
